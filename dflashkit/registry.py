"""Drafters that ship inside the package, found by target name."""

from __future__ import annotations

from pathlib import Path

from .models import DEFAULT_TARGET

DRAFTERS_DIR = Path(__file__).parent / "drafters"


def shipped_drafter(target: str | None) -> Path | None:
    """Folder of the drafter shipped for `target` (None = the embedded default target), if there is one."""
    name = DEFAULT_TARGET if target in (None, DEFAULT_TARGET) else Path(str(target)).name.lower()
    folder = DRAFTERS_DIR / name
    return folder if (folder / "config.json").is_file() else None
