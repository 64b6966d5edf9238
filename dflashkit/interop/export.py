"""Export a drafter to serving engines: the published HF layout (vLLM, SGLang) and a GGUF (llama.cpp).

The HF export is the published DFlash layout (see `checkpoint.py`) with the fields each engine's loader reads
(`ENGINE_FIELDS`). The GGUF is written by llama.cpp's own `convert_hf_to_gguf.py --target-model-dir` from a
llama.cpp checkout the user names; dflashkit only checks what it wrote and, for a drafter with a draft
vocabulary, adds the two tensors llama.cpp's DFlash runtime reads for it (`d2t`, `output.weight`).

How our two drafter extras map to each engine (read from their loaders):
* learned mask vector (`mask_embedding.pt`): vLLM substitutes it for the mask id's embedding row; llama.cpp's
  converter writes the target's embedding table with that row replaced into the drafter GGUF (plus the target's
  head); SGLang ignores the file and embeds masks with the target's own row of `mask_token_id`.
* draft vocabulary: vLLM reads `draft_vocab_size`, a drafter `lm_head.weight` of that many rows and `d2t`
  (target id minus draft index); llama.cpp's DFlash runtime reads `d2t` (absolute target ids, int64) and a
  reduced `output.weight`; SGLang always drafts with the target's full head.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from dflashkit.drafter.checkpoint import MASK_EMBEDDING_FILE, load_drafter, write_drafter_files
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.identity import check_compatible
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.drafter.ngram_store import FILENAME as NGRAM_STORE_FILE
from dflashkit.errors import DFlashError, IncompatibleDrafterError
from dflashkit.fsutil import atomic_dir

LLAMA_CPP_ENV = "DFLASHKIT_LLAMA_CPP"
DRAFTER_GGUF = "drafter-bf16.gguf"
TARGET_GGUF = "target-bf16.gguf"

# The config.json fields each engine's DFlash loader reads (the engine's source files beside each). Values come from
# `engine_config`; (dflash_config, key) is a nested field.
ENGINE_FIELDS: dict[str, list[str | tuple[str, str]]] = {
    "vllm": [  # model_executor/models/qwen3_dflash.py, v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "max_position_embeddings",
        "vocab_size",
        "attention_bias",
        "layer_types",
        "is_causal",
        ("dflash_config", "mask_token_id"),
        ("dflash_config", "target_layer_ids"),
    ],
    "sglang": [  # srt/models/dflash.py, srt/speculative/dflash_utils.py (parse_dflash_draft_config)
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "attention_bias",
        "layer_types",
        "num_target_layers",
        "block_size",
        ("dflash_config", "mask_token_id"),
        ("dflash_config", "target_layer_ids"),
        ("dflash_config", "block_size"),
    ],
    "llama.cpp": [  # conversion/qwen.py (DFlashModel) on Qwen3Model
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "vocab_size",
        "is_causal",
        "use_sliding_window",
        ("dflash_config", "mask_token_id"),
        ("dflash_config", "target_layer_ids"),
        ("dflash_config", "block_size"),
    ],
}


class ExportError(DFlashError):
    """An export that cannot be made: no llama.cpp converter, a converter failure, a wrong GGUF."""


@dataclass
class ExportResult:
    format: str
    path: Path  # the exported drafter: a folder (hf) or a .gguf file
    commands: dict[str, str]  # engine -> command line that serves it
    target_gguf: Path | None = None
    notes: list[str] = field(default_factory=list)  # where an engine does not reproduce the drafter exactly


def engine_config(config: DrafterConfig) -> dict[str, Any]:
    """config.json of an exported drafter: the published layout plus fields some engines need spelled out."""
    d = config.to_hf_dict()
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
    d["is_causal"] = False  # bidirectional block attention (vLLM and llama.cpp read it; defaults vary)
    if config.draft_vocab is not None:
        d["draft_vocab_size"] = len(config.draft_vocab)  # vLLM: a reduced drafter head with d2t
    return d


def draft_vocab_tensors(config: DrafterConfig, lm_head: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A draft vocabulary in the EAGLE-3 convention vLLM reads: the head's rows of the draft vocabulary and
    `d2t` (target id minus draft index, int64); the drafter's logits outside it are -inf there too."""
    assert config.draft_vocab is not None
    ids = torch.tensor(config.draft_vocab, dtype=torch.long)
    rows = lm_head.weight.detach()[ids.to(lm_head.weight.device)].to("cpu", dtype).contiguous()
    return {"lm_head.weight": rows, "d2t": ids - torch.arange(len(ids))}


def engine_notes(config: DrafterConfig, fmt: str) -> list[str]:
    """What an engine does differently from dflashkit with this drafter (outputs stay lossless either way)."""
    notes = []
    if fmt == "hf" and config.learned_mask_embedding:
        notes.append(
            f"SGLang ignores {MASK_EMBEDDING_FILE}: it embeds mask positions with the target's own embedding row "
            f"of mask_token_id {config.mask_token_id}, so its drafts differ from dflashkit's and acceptance drops "
            "(vLLM and llama.cpp use the learned vector). For SGLang, train with --mask-token-id."
        )
    if fmt == "hf" and config.draft_vocab is not None:
        notes.append(
            f"SGLang drafts over the target's full head and ignores the draft vocabulary ({len(config.draft_vocab)} "
            "ids): its proposals differ where the full-vocabulary argmax lies outside it (vLLM reads "
            "draft_vocab_size, lm_head.weight and d2t)."
        )
    return notes


# ---- loading and checking ---------------------------------------------------------------------------------


def stored_dtype(drafter_path: Path) -> torch.dtype:
    """dtype of the drafter's stored weights (bf16 if unknown)."""
    for f in sorted(drafter_path.glob("*.safetensors")):
        if f.name == NGRAM_STORE_FILE:  # token ids, not weights
            continue
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                dtype = st.get_slice(key).get_dtype()
                return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(dtype, torch.bfloat16)
    return torch.bfloat16


def target_folder(target: str | None) -> Path:
    """The local folder (config.json, tokenizer, safetensors) of a target, as llama.cpp's converter needs it."""
    from dflashkit.target.loading import DEFAULT_TARGET, cache_dir, packaged_model

    if target is None or target == DEFAULT_TARGET:
        return cache_dir() / DEFAULT_TARGET  # made by load_target, which runs first
    if (model := packaged_model(target)) is not None:
        from dflashkit.target.packaged import model_folder

        return model_folder(model)
    local = Path(target).expanduser()
    if local.is_dir():
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(target, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        )
    except Exception as e:
        raise ExportError(f"target {target!r}: no local folder, and the hub download failed ({e})") from e


def load_pair(drafter_path: str | os.PathLike, target: str | None) -> tuple[DFlashDrafter, nn.Module]:
    """The drafter (in its stored dtype) and the target it is exported against; refuses a mismatched pair."""
    from dflashkit.target.loading import load_target

    path = Path(drafter_path)
    drafter = load_drafter(path, dtype=stored_dtype(path))
    model, _ = load_target(target, dtype=torch.bfloat16)
    try:
        check_compatible(drafter.config, model)
    except IncompatibleDrafterError as e:
        raise IncompatibleDrafterError(f"refusing to export: {e}") from e
    return drafter, model


def write_hf(drafter: DFlashDrafter, model: nn.Module, folder: Path, *, draft_vocab: bool = True) -> None:
    """The published layout of `drafter` for vLLM/SGLang into an existing folder."""
    write_drafter_files(drafter, folder)
    config = engine_config(drafter.config)
    if drafter.config.draft_vocab is not None and draft_vocab:
        weights = load_file(folder / "model.safetensors")
        dtype = drafter.fc.weight.dtype
        weights.update(draft_vocab_tensors(drafter.config, model.get_output_embeddings(), dtype))
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    else:
        config.pop("draft_vocab_size", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---- serving command lines --------------------------------------------------------------------------------


def _q(p: Any) -> str:
    return shlex.quote(str(p))


def hf_commands(target: str | Path, drafter_dir: Path, block_size: int) -> dict[str, str]:
    spec = json.dumps({"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": block_size - 1})
    return {
        "vllm": f"vllm serve {_q(target)} --speculative-config {_q(spec)}",
        "sglang": (
            f"python -m sglang.launch_server --model-path {_q(target)} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {_q(drafter_dir)} --speculative-num-draft-tokens {block_size} "
            "--dtype bfloat16"
        ),
    }


def gguf_command(server: str | Path, target_gguf: str | Path, drafter_gguf: Path, block_size: int) -> str:
    return (
        f"{_q(server)} -m {_q(target_gguf)} -md {_q(drafter_gguf)} --spec-type draft-dflash "
        f"--spec-draft-n-max {block_size - 1} -fa on --jinja"
    )


# ---- exports ----------------------------------------------------------------------------------------------


HF_EXPORT_FILES = frozenset({"config.json", "model.safetensors", "mask_embedding.pt"})  # what write_hf writes


def check_output_folder(drafter_path: str | os.PathLike, out: Path, replaceable: frozenset[str] | None) -> None:
    """Refuse an output that would destroy something: the drafter's own folder (or one holding it, or inside it),
    a file, or (when `replaceable` is given, for exports that replace the folder) a folder holding anything but an
    earlier export's files."""
    source, dest = Path(drafter_path).resolve(), out.resolve()
    if dest == source or source.is_relative_to(dest) or dest.is_relative_to(source):
        raise ExportError(
            f"the output {out} would overwrite the drafter being exported ({drafter_path}): choose another --out"
        )
    if dest.exists() and not dest.is_dir():
        raise ExportError(f"the output {out} is a file, not a folder: choose another --out")
    if replaceable is not None and dest.is_dir():
        others = sorted(p.name for p in dest.iterdir() if p.name not in replaceable)
        if others:
            raise ExportError(
                f"the output folder {out} holds files an export did not write ({', '.join(others[:5])}"
                f"{', ...' if len(others) > 5 else ''}); the export would replace it: choose another "
                "--out or empty it"
            )


def export_hf(drafter_path: str | os.PathLike, out: str | os.PathLike, *, target: str | None = None) -> ExportResult:
    """The drafter in the published HF layout that vLLM (`method: dflash`) and SGLang (`DFLASH`) load. An existing
    output folder is replaced only when it holds nothing but an earlier export's files."""
    out = Path(out)
    check_output_folder(drafter_path, out, HF_EXPORT_FILES)
    drafter, model = load_pair(drafter_path, target)
    with atomic_dir(out) as tmp:
        write_hf(drafter, model, tmp)
    target_ref = target if target is not None else target_folder(None)
    return ExportResult(
        "hf",
        out,
        hf_commands(target_ref, out.resolve(), drafter.config.block_size),
        notes=engine_notes(drafter.config, "hf"),
    )


def find_llama_cpp(llama_cpp: str | os.PathLike | None = None) -> Path:
    """The llama.cpp checkout: `llama_cpp`, else $DFLASHKIT_LLAMA_CPP, else <cache>/llama.cpp (where
    scripts/get_llama_cpp.sh puts it); it must hold a converter that knows DFlash drafters."""
    from dflashkit.target.loading import cache_dir

    given = llama_cpp or os.environ.get(LLAMA_CPP_ENV)
    if not given and (cache_dir() / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        given = str(cache_dir() / "llama.cpp")
    if not given:
        raise ExportError(
            f"GGUF export needs a llama.cpp checkout: pass --llama-cpp DIR or set {LLAMA_CPP_ENV} "
            "(get one with `bash scripts/get_llama_cpp.sh`)"
        )
    root = Path(given).expanduser()
    for candidate in (root, root / "llama.cpp"):
        if (candidate / "convert_hf_to_gguf.py").is_file():
            root = candidate
            break
    else:
        raise ExportError(f"{given}: no convert_hf_to_gguf.py there (a llama.cpp checkout is expected)")
    sources = [root / "convert_hf_to_gguf.py", *sorted((root / "conversion").glob("*.py"))]
    if not any("DFlashDraftModel" in p.read_text(encoding="utf-8", errors="replace") for p in sources):
        raise ExportError(f"{root}: this llama.cpp converter does not know DFlash drafters; use a newer llama.cpp")
    return root


def run_converter(llama_cpp: Path, args: list[str], python: str | None = None) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py (with its own gguf-py) in `python` (default: this interpreter)."""
    cmd = [python or sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), *args]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ExportError(f"llama.cpp's converter failed ({shlex.join(cmd)}):\n{tail}")


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def add_draft_vocab(path: Path, config: DrafterConfig, lm_head: nn.Module) -> None:
    """Rewrite the GGUF at `path` with the drafter's draft vocabulary as llama.cpp's DFlash runtime reads it
    (`d2t`: absolute target ids, int64; `output.weight`: those rows of the head, f32). Its DFlash converter
    does not write them (only its DSpark one does)."""
    import gguf
    import numpy as np

    assert config.draft_vocab is not None
    reader = gguf.GGUFReader(path)
    rows = lm_head.weight.detach()[torch.tensor(config.draft_vocab, device=lm_head.weight.device)]
    extra = {
        "output.weight": (rows.float().cpu().numpy(), gguf.GGMLQuantizationType.F32),
        "d2t": (np.asarray(config.draft_vocab, dtype=np.int64), gguf.GGMLQuantizationType.I64),
    }
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, _field(reader, "general.architecture"))
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    kept = [t for t in reader.tensors if t.name not in extra]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    for name, (data, kind) in extra.items():
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    for data, _ in extra.values():
        writer.write_tensor_data(data)
    writer.close()
    del reader
    os.replace(tmp, path)


def check_gguf(path: Path, drafter: DFlashDrafter) -> None:
    """Refuse a drafter GGUF that does not say what the drafter is (architecture, block, layers, mask)."""
    import gguf

    cfg = drafter.config
    reader = gguf.GGUFReader(path)
    expected = {
        "general.architecture": "dflash",
        "dflash.block_size": cfg.block_size,
        "dflash.target_layers": [i + 1 for i in cfg.target_layer_ids],  # llama.cpp stores them offset by one
        "tokenizer.ggml.mask_token_id": cfg.mask_token_id,
    }
    wrong = {k: (_field(reader, k), v) for k, v in expected.items() if _field(reader, k) != v}
    tensors = {t.name: t for t in reader.tensors}
    if drafter.mask_embedding is not None:
        embd = tensors.get("token_embd.weight")
        if embd is None:
            wrong["token_embd.weight"] = (
                "absent",
                f"the target's table with row {cfg.mask_token_id} = the mask vector",
            )
        else:
            row = torch.from_numpy(gguf_rows(embd, [cfg.mask_token_id]))[0]
            want = drafter.mask_embedding.detach().to(torch.bfloat16).float()
            if not torch.allclose(row, want, atol=0, rtol=1e-2):
                wrong["token_embd.weight"] = (f"row {cfg.mask_token_id} is not the mask vector", "the mask vector")
    if wrong:
        detail = "; ".join(f"{k}: {got!r} (expected {want!r})" for k, (got, want) in wrong.items())
        raise ExportError(f"{path}: llama.cpp's converter wrote an unexpected drafter GGUF: {detail}")


def gguf_rows(tensor: Any, rows: list[int]) -> Any:
    """Rows of a 2-D F32/F16/BF16 GGUF tensor as float32 numpy."""
    import gguf
    import numpy as np

    data = np.asarray(tensor.data)
    if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:
        bits = data.view(np.uint16).reshape(-1, int(tensor.shape[0]))[rows].astype(np.uint32) << 16
        return bits.view(np.float32)
    return data.reshape(-1, int(tensor.shape[0]))[rows].astype(np.float32)


def export_target_gguf(
    target: str | None,
    out_file: str | os.PathLike,
    *,
    llama_cpp: str | os.PathLike | None = None,
    python: str | None = None,
) -> Path:
    """The target itself as a bf16 GGUF (llama.cpp's converter on its cached safetensors), written atomically."""
    root = find_llama_cpp(llama_cpp)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    partial = out_file.with_name(f".{out_file.name}.partial")
    try:
        run_converter(root, [str(target_folder(target)), "--outtype", "bf16", "--outfile", str(partial)], python)
        os.replace(partial, out_file)
    finally:
        partial.unlink(missing_ok=True)
    return out_file


def export_gguf(
    drafter_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    target: str | None = None,
    llama_cpp: str | os.PathLike | None = None,
    target_gguf: bool = False,
    python: str | None = None,
) -> ExportResult:
    """A GGUF drafter (OUT/drafter-bf16.gguf) made by llama.cpp's converter; with `target_gguf`, the target too."""
    out = Path(out)
    check_output_folder(drafter_path, out, None)  # files are added to an existing folder, nothing removed
    root = find_llama_cpp(llama_cpp)
    drafter, model = load_pair(drafter_path, target)
    target_dir = target_folder(target)
    out.mkdir(parents=True, exist_ok=True)
    result = out / DRAFTER_GGUF
    partial = out / f".{DRAFTER_GGUF}.partial"
    try:
        with tempfile.TemporaryDirectory(prefix="dflashkit-export-") as tmp:
            stage = Path(tmp) / Path(drafter_path).resolve().name  # the GGUF's general.name comes from it
            stage.mkdir()
            # The draft vocabulary goes in after conversion: the DFlash converter cannot map `d2t`.
            write_hf(drafter, model, stage, draft_vocab=False)
            run_converter(
                root,
                [str(stage), "--target-model-dir", str(target_dir), "--outtype", "bf16", "--outfile", str(partial)],
                python,
            )
        if drafter.config.draft_vocab is not None:
            add_draft_vocab(partial, drafter.config, model.get_output_embeddings())
        check_gguf(partial, drafter)
        os.replace(partial, result)
    finally:
        partial.unlink(missing_ok=True)
    target_file = export_target_gguf(target, out / TARGET_GGUF, llama_cpp=root, python=python) if target_gguf else None
    server = root / "build" / "bin" / "llama-server"
    command = gguf_command(
        server.resolve() if server.is_file() else "llama-server",
        target_file.resolve() if target_file else "TARGET.gguf",
        result.resolve(),
        drafter.config.block_size,
    )
    notes = [] if target_file else ["TARGET.gguf: the target as GGUF (--target-gguf writes a bf16 one)."]
    if not server.is_file():
        notes.append(f"llama-server is not built in {root}: `bash scripts/get_llama_cpp.sh {root} --build`.")
    return ExportResult("gguf", result, {"llama.cpp": command}, target_file, notes)
