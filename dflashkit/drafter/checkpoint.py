"""Drafter checkpoints in the published DFlash layout, and the identity of the target they belong to.

A checkpoint folder holds:
  config.json          published layout (see DrafterConfig.to_hf_dict) + `dflashkit.target.adapter` metadata
  model.safetensors    drafter weights only, un-prefixed keys (`layers.0.self_attn.q_proj.weight`, `fc.weight`, ...)
  mask_embedding.pt    only for a learned mask vector: {"mask_token_id": id, "embedding": tensor[hidden]}

Official drafters (no `dflashkit` metadata) load too; they are checked by shape only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.drafter.ngram_store import FILENAME as NGRAM_STORE_FILE
from dflashkit.drafter.ngram_store import NgramStore, find_store
from dflashkit.errors import CheckpointError
from dflashkit.fsutil import atomic_dir

MASK_EMBEDDING_FILE = "mask_embedding.pt"


def save_drafter(drafter: DFlashDrafter, path: str | os.PathLike) -> Path:
    """Write config.json + model.safetensors (+ mask_embedding.pt) atomically into folder `path`."""
    path = Path(path)
    with atomic_dir(path) as tmp:
        write_drafter_files(drafter, tmp)
    return path


def write_drafter_files(drafter: DFlashDrafter, folder: Path) -> None:
    """The checkpoint files of `drafter`, written into an existing folder (not atomic by itself)."""
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items() if k != "mask_embedding"}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(drafter.config.to_hf_dict(), indent=2) + "\n")
    if drafter.mask_embedding is not None:
        torch.save(
            {"mask_token_id": drafter.config.mask_token_id, "embedding": drafter.mask_embedding.detach().cpu()},
            folder / MASK_EMBEDDING_FILE,
        )


def load_drafter(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> DFlashDrafter:
    """Load a drafter folder written by `save_drafter` or published in the same layout."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: not a drafter checkpoint (no config.json)")
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / 'config.json'}: invalid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path / 'config.json'}: expected a JSON object, got {type(raw).__name__}")
    archs = raw.get("architectures") or []
    if archs and not any("DFlash" in a for a in archs):
        raise CheckpointError(f"{path}: architectures {archs} is not a DFlash drafter")
    mask_file = path / MASK_EMBEDDING_FILE
    mask = _read_mask_embedding(mask_file, raw) if mask_file.exists() else None
    config = DrafterConfig.from_hf_dict(raw)
    if config.learned_mask_embedding and mask is None:  # it would draft with the mask token's own embedding
        raise CheckpointError(
            f"{path}: config.json says the drafter learned its mask vector, but {MASK_EMBEDDING_FILE} "
            "is missing: copy it from where the drafter was trained"
        )
    config = config.replace(learned_mask_embedding=mask is not None)
    drafter = DFlashDrafter(config)
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        if f.name == NGRAM_STORE_FILE:  # the drafter's n-gram store (token ids), loaded below
            continue
        try:
            state.update(load_file(f))
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
    if not state:
        raise CheckpointError(f"{path}: no *.safetensors weights")
    state = {k.removeprefix("model."): v for k, v in state.items()}
    # Shared with the target here: embedding, head, and the head's draft-vocabulary map (exports carry them).
    state = {k: v for k, v in state.items() if not k.startswith(("lm_head", "embed_tokens", "d2t", "t2d"))}
    if mask is not None:
        state["mask_embedding"] = mask
    expected = drafter.state_dict()
    wrong = [
        (k, tuple(v.shape), tuple(expected[k].shape))
        for k, v in state.items()
        if k in expected and v.shape != expected[k].shape
    ]
    if wrong:
        k, got, want = wrong[0]
        raise CheckpointError(
            f"{path}: {k} has shape {list(got)} but config.json (hidden_size {config.hidden_size}, "
            f"{config.num_hidden_layers} layers) implies {list(want)}"
            + (f", and {len(wrong) - 1} more tensors differ" if len(wrong) > 1 else "")
            + ": the config does not belong to these weights"
        )
    try:
        missing, unexpected = drafter.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise CheckpointError(f"{path}: weights do not match the config: {e}") from e
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    store = find_store(path)
    drafter.ngram_store = NgramStore.load(store) if store is not None else None
    return drafter.to(device=device, dtype=dtype).eval()


def _read_mask_embedding(file: Path, raw: dict[str, Any]) -> torch.Tensor:
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt pickles raise many different error types
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {e})") from e
    if isinstance(obj, dict):
        if "embedding" not in obj:
            raise CheckpointError(f"{file}: a dict without the key 'embedding'")
        mask_id = (raw.get("dflash_config") or {}).get("mask_token_id")
        if obj.get("mask_token_id") is not None and mask_id is not None and int(obj["mask_token_id"]) != int(mask_id):
            raise CheckpointError(f"{file}: mask_token_id {obj['mask_token_id']} != config's {mask_id}")
        obj = obj["embedding"]
    if not isinstance(obj, torch.Tensor) or obj.numel() != int(raw.get("hidden_size", -1)):
        raise CheckpointError(f"{file}: expected a tensor of hidden_size={raw.get('hidden_size')} values")
    return obj.reshape(-1).float()
