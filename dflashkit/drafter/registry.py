"""Drafters that ship inside the package: found by target name or by their own short name (the folder's name, e.g.
``smollm2-135m-instruct``), and described from their config.json alone, without torch, for ``dflashkit drafters``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DRAFTERS_DIR = Path(__file__).parents[1] / "drafters"
KEYWORDS = ("none", "untrained", "auto")  # drafter arguments that are not folders


@dataclass(frozen=True)
class ShippedDrafter:
    """What a shipped drafter's folder says about it (None where its config.json does not say)."""

    name: str  # the folder's name: what --drafter NAME accepts
    path: Path
    target: str | None  # the target it was trained for (its config's dflashkit.target.name_or_path)
    layers: int | None
    block_size: int | None
    size_bytes: int  # every file in the folder (weights, n-gram store, model card)


def shipped_drafters() -> list[ShippedDrafter]:
    """Every drafter folder under :data:`DRAFTERS_DIR` (one with a config.json), by name."""
    if not DRAFTERS_DIR.is_dir():
        return []
    out = []
    for folder in sorted(DRAFTERS_DIR.iterdir()):
        config = folder / "config.json"
        if not config.is_file():
            continue
        try:
            raw = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raw = {}
        raw = raw if isinstance(raw, dict) else {}
        ours = raw.get("dflashkit") if isinstance(raw.get("dflashkit"), dict) else {}
        target = ours.get("target") if isinstance(ours.get("target"), dict) else {}
        flash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
        out.append(
            ShippedDrafter(
                name=folder.name,
                path=folder,
                target=target.get("name_or_path"),
                layers=raw.get("num_hidden_layers"),
                block_size=raw.get("block_size", flash.get("block_size")),
                size_bytes=sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()),
            )
        )
    return out


def shipped_names() -> list[str]:
    """The short names ``--drafter NAME`` accepts for the shipped drafters."""
    return [d.name for d in shipped_drafters()]


def shipped_drafter(target: str | None) -> Path | None:
    """Folder of the drafter shipped for `target` (None = the embedded default target), if there is one."""
    from dflashkit.target.loading import DEFAULT_TARGET

    name = DEFAULT_TARGET if target in (None, DEFAULT_TARGET) else Path(str(target)).name.lower()
    folder = DRAFTERS_DIR / name
    return folder if (folder / "config.json").is_file() else None


def named_drafter(choice: str | os.PathLike) -> Path | None:
    """The shipped drafter that `choice` names, unless `choice` is an existing path (a path wins); None otherwise."""
    text = os.fspath(choice)
    if not text or text in KEYWORDS or Path(text).expanduser().exists() or os.sep in text or "/" in text:
        return None
    folder = DRAFTERS_DIR / text.lower()
    return folder if (folder / "config.json").is_file() else None


def check_drafter(choice: str, keywords: tuple[str, ...] = KEYWORDS) -> str:
    """A drafter given on the command line, checked before any model loads: one of `keywords` as given, an existing
    path as given (a path wins), a shipped drafter's short name as its folder. Anything else raises
    InvalidInputError naming the shipped drafters."""
    from dflashkit.errors import InvalidInputError

    resolved = drafter_name_or_path(choice, keywords)
    if resolved in keywords or Path(resolved).expanduser().exists():
        return resolved
    names = ", ".join(shipped_names()) or "none"
    words = f", nor one of {', '.join(repr(k) for k in keywords)}" if keywords else ""
    raise InvalidInputError(
        f"no drafter folder {choice!r}, and no shipped drafter of that name (shipped: {names}; `dflashkit drafters` "
        f"lists them){words}"
    )


def drafter_name_or_path(choice: str, keywords: tuple[str, ...] = KEYWORDS) -> str:
    """A drafter argument with a shipped drafter's short name replaced by its folder (unless a path of that name
    exists: a path wins); keywords and everything else as given. Used while the command line is parsed, so it never
    refuses: a missing folder is reported by :func:`check_drafter` before the model loads."""
    if choice in keywords:
        return choice
    named = named_drafter(choice)
    return str(named) if named is not None else choice


def drafter_folder(drafter: str | os.PathLike | None, target: str | None) -> str | None:
    """A drafter argument as a folder: "auto" is the one shipped for `target` (None where none ships), a shipped
    drafter's short name (when no such path exists) its folder, anything else as given (None: no drafter)."""
    if drafter == "auto":
        found = shipped_drafter(target)
        return str(found) if found is not None else None
    if drafter is None:
        return None
    named = named_drafter(drafter)
    return str(named) if named is not None else str(drafter)
