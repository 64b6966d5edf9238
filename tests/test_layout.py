"""The package's form: every module imports on its own, and no import circle exists anywhere, lazy imports included."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("layout_graph", ROOT / "scripts" / "layout_graph.py")
layout_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout_graph)  # the import graph that docs/architecture.md draws, read the same way here
MODULES = layout_graph.module_files()


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
    return layout_graph.module_imports()


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
