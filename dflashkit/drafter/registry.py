"""Drafters that ship inside the package, found by target name."""

from __future__ import annotations

import os
from pathlib import Path

from dflashkit.target.loading import DEFAULT_TARGET

DRAFTERS_DIR = Path(__file__).parents[1] / "drafters"


def shipped_drafter(target: str | None) -> Path | None:
    """Folder of the drafter shipped for `target` (None = the embedded default target), if there is one."""
    name = DEFAULT_TARGET if target in (None, DEFAULT_TARGET) else Path(str(target)).name.lower()
    folder = DRAFTERS_DIR / name
    return folder if (folder / "config.json").is_file() else None


def drafter_folder(drafter: str | os.PathLike | None, target: str | None) -> str | None:
    """A drafter argument as a folder: "auto" is the one shipped for `target` (None where none ships), anything else
    as given (None: no drafter)."""
    if drafter == "auto":
        found = shipped_drafter(target)
        return str(found) if found is not None else None
    return None if drafter is None else str(drafter)
