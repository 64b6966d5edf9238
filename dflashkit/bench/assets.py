"""GGUFs of the benchmark's llama.cpp peers: the target's (embedded, packaged: :mod:`dflashkit.target.packaged`),
and bf16 conversions of the target and of a drafter made once with llama.cpp's own converter (see
`dflashkit.interop.export`), cached under ``<cache>/gguf``.
"""

from __future__ import annotations

import hashlib
import pathlib
import sys

from dflashkit.errors import DFlashError
from dflashkit.target.loading import DEFAULT_TARGET, cache_dir, embedded_gguf_path
from dflashkit.target.packaged import AssetError, assemble_gguf, packaged


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


def draft_model_gguf(target: str | None) -> tuple[pathlib.Path | None, str]:
    """The GGUF of the packaged smaller model of `target`'s family (its classic draft model), or (None, why not)."""
    model = packaged(target) if target else None
    draft = packaged(model.draft) if model is not None and model.draft else None
    if draft is None:
        return None, f"no packaged draft model known for target {target or DEFAULT_TARGET!r}"
    try:
        return assemble_gguf(draft), ""
    except AssetError as e:
        return None, str(e)


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
