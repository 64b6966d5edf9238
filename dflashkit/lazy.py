"""A package's public names imported on first use (PEP 562), so that importing the package loads none of the
heavy modules behind them (torch, transformers): ``dflashkit --help`` answers at once, while ``from dflashkit
import SpeculativeGenerator`` works as for any package."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of `package`, whose public names are the keys of `exports`
    (name -> the module that defines it). A name is imported when first asked for and kept in the package's
    namespace, so later lookups are plain attribute reads."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
