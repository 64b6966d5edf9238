"""The package's form: every module imports on its own, and no import circle exists anywhere, lazy imports included."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflashkit"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every dflashkit module that ``name`` imports, at any depth of its code (function bodies, TYPE_CHECKING)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from package import module` imports that module; `from module import name`, that module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in MODULES and t != name}
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _graph() -> dict[str, set[str]]:
    # a package's __init__ that only re-exports counts as its folder: an import of `dflashkit.x` is one of x's face
    return {name: _imports(name, path) for name, path in MODULES.items()}


def test_no_module_imports_one_that_imports_it_back():
    assert _circles(_graph()) == []


def test_the_circle_check_finds_a_planted_circle():
    graph = _graph()
    graph["dflashkit.kernels.row_kernels"] = graph["dflashkit.kernels.row_kernels"] | {"dflashkit.decoding.loop"}
    circles = _circles(graph)
    assert circles and any("dflashkit.kernels.row_kernels" in c and "dflashkit.decoding.loop" in c for c in circles)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not n.endswith("__main__")))
def test_every_module_imports_on_its_own(name):
    """Imported first, from a fresh dflashkit, each module loads: no order of imports hides a circle."""
    saved = {k: v for k, v in sys.modules.items() if k == "dflashkit" or k.startswith("dflashkit.")}
    for k in saved:
        del sys.modules[k]
    try:
        importlib.import_module(name)
    finally:
        for k in [k for k in sys.modules if k == "dflashkit" or k.startswith("dflashkit.")]:
            del sys.modules[k]
        sys.modules.update(saved)
