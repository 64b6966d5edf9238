"""Which target a drafter belongs to: identity metadata, an embedding fingerprint, and the check that
refuses a drafter used with the wrong target (a wrong target silently destroys acceptance)."""

from __future__ import annotations

import os
from pathlib import Path, PureWindowsPath
from typing import Any

import torch
from torch import nn

from dflashkit.drafter.config import DrafterConfig
from dflashkit.errors import IncompatibleDrafterError

FINGERPRINT_ROWS = 32
FINGERPRINT_DIMS = 16
FINGERPRINT_MIN_COSINE = 0.95  # fp32 vs bf16 copies of one model: 0.999999 (measured); unrelated models ~0


def embedding_fingerprint(embed_tokens: nn.Module) -> list[float]:
    """A small, dtype-robust signature of an embedding table: a fixed grid of its entries, in fp32."""
    weight = embed_tokens.weight
    rows = torch.linspace(0, weight.shape[0] - 1, FINGERPRINT_ROWS).long()
    dims = torch.linspace(0, weight.shape[1] - 1, FINGERPRINT_DIMS).long()
    grid = weight.detach()[rows.to(weight.device)][:, dims.to(weight.device)].float().cpu()
    return [round(x, 5) for x in grid.flatten().tolist()]


def portable_name(name_or_path: str | os.PathLike | None) -> str | None:
    """A target's name as a drafter records it: a hub id ("Qwen/Qwen3-0.6B") as it is; a local folder (an absolute
    path, one from ``~`` or ``.``, or a relative one that exists here) as its last component only, since the path
    means nothing on another machine and would publish the training machine's layout. None for no name."""
    if not name_or_path:
        return None
    text = str(name_or_path)
    if PureWindowsPath(text).is_absolute() and not os.path.isabs(text):  # C:\... read on another system
        return PureWindowsPath(text).name or None
    path = Path(text).expanduser()
    local = os.path.isabs(text) or text in (".", "..") or text.startswith(("~", "./", "../", ".\\", "..\\"))
    if local or (("/" in text or os.sep in text) and path.exists()):
        return path.name or path.resolve().name or None  # "/a/b/" -> "b"; "." -> the folder's own name
    return text


def config_identity(config: Any) -> dict[str, Any]:
    """The identity fields a target's configuration alone gives (no fingerprint; the vocabulary as configured):
    what identifies a target whose weights are elsewhere (a server's). A local folder's path is recorded as its
    last component (:func:`portable_name`)."""
    return {
        "architecture": (getattr(config, "architectures", None) or [config.model_type])[0],
        "model_type": getattr(config, "model_type", None),
        "name_or_path": portable_name(getattr(config, "_name_or_path", None)),
        "hidden_size": int(config.hidden_size),
        "vocab_size": int(config.vocab_size),
        "num_hidden_layers": int(config.num_hidden_layers),
    }


def target_identity(model: nn.Module) -> dict[str, Any]:
    """Metadata that identifies a target model, stored in the drafter's config.json."""
    embed = model.get_input_embeddings()
    ident = config_identity(model.config)
    if not getattr(model.config, "architectures", None):
        ident["architecture"] = type(model).__name__
    ident["vocab_size"] = int(embed.weight.shape[0])  # the table's rows (may be padded past the configured size)
    ident["embedding_fingerprint"] = embedding_fingerprint(embed)
    return ident


def check_compatible(config: DrafterConfig, model: nn.Module) -> None:
    """Refuse, with a message that says why, a drafter built for another target."""
    embed = model.get_input_embeddings()
    tc = model.config
    problems = []
    if config.hidden_size != tc.hidden_size:
        problems.append(f"hidden size {config.hidden_size} (target: {tc.hidden_size})")
    if config.vocab_size != embed.weight.shape[0]:
        problems.append(f"vocabulary {config.vocab_size} (target: {embed.weight.shape[0]})")
    if max(config.target_layer_ids) >= tc.num_hidden_layers:
        problems.append(f"feature layers {config.target_layer_ids} (target has {tc.num_hidden_layers} layers)")
    ident = config.target or {}
    if not problems and ident.get("num_hidden_layers") not in (None, tc.num_hidden_layers):
        problems.append(
            f"trained for a {ident['num_hidden_layers']}-layer target (this one has {tc.num_hidden_layers})"
        )
    if not problems and ident.get("embedding_fingerprint"):
        ours = torch.tensor(ident["embedding_fingerprint"])
        theirs = torch.tensor(embedding_fingerprint(embed))
        if ours.shape != theirs.shape:
            problems.append("embedding fingerprint of another format")
        else:
            cos = float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0))
            if not cos >= FINGERPRINT_MIN_COSINE:
                problems.append(f"embedding fingerprint (cosine similarity {cos:.3f} < {FINGERPRINT_MIN_COSINE})")
    if problems:
        trained_for = ident.get("name_or_path") or ident.get("architecture") or "another target"
        raise IncompatibleDrafterError(
            f"this drafter does not fit the target {getattr(tc, '_name_or_path', '') or type(model).__name__!s}: "
            + "; ".join(problems)
            + f". It was built for {trained_for}."
        )


def drafter_config_for(model: nn.Module, **kwargs: Any) -> DrafterConfig:
    """A drafter config shaped for `model` (see DrafterConfig.for_target) that records the target's identity."""
    return DrafterConfig.for_target(model.config, **kwargs).replace(target=target_identity(model))
