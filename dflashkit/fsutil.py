"""Files: atomic writes (a file or a folder appears complete or not at all, so a killed job loses nothing), files
inside installed packages, JSON-lines records, the cache folder."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from dflashkit.errors import InvalidInputError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], binary: bool = False) -> None:
    """Write `path` through write(file) into a temporary file beside it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside `dest`; when the block succeeds it replaces `dest` (an old `dest` is
    removed after the swap), with the permissions a plain mkdir would have given."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        mask = _umask()
        for p in (tmp, *tmp.rglob("*")):  # mkdtemp makes the folder private
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def package_file(package: str, relpath: str) -> pathlib.Path | None:
    """A file inside an installed package, located without importing the package (None when absent)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / relpath
    return path if path.is_file() else None


def jsonl_records(path: str | os.PathLike, what: str = "file") -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of each non-blank line of a local JSONL file; clear errors for bad lines."""
    path = pathlib.Path(path).expanduser()
    if not path.is_file():
        raise InvalidInputError(f"{what} {path} does not exist")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidInputError(f"{path}, line {lineno}: invalid JSON ({e.msg})") from None


def cache_dir() -> pathlib.Path:
    """Cache root: ``$DFLASHKIT_CACHE``, else ``$XDG_CACHE_HOME/dflashkit``, else ``~/.cache/dflashkit``."""
    if os.environ.get("DFLASHKIT_CACHE"):
        return pathlib.Path(os.environ["DFLASHKIT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache") / "dflashkit"
