"""The folder-level import graph of dflashkit, as a Mermaid flowchart.

A node is a subpackage folder (``kernels/``) or a top-level module (``generator.py``); an edge ``A --> B`` says that
some module in A imports some module in B, at any depth of its code (function bodies and TYPE_CHECKING included).

    python scripts/layout_graph.py                                # print the diagram
    python scripts/layout_graph.py --check docs/architecture.md   # fail if the doc's diagram is stale
    python scripts/layout_graph.py --write docs/architecture.md   # rewrite the doc's diagram
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflashkit"
START, END = "<!-- layout-graph:start -->", "<!-- layout-graph:end -->"


def _node(path: Path, package: Path) -> str:
    """The graph node a file belongs to: its top folder under the package, or itself for a top-level module."""
    parts = path.relative_to(package).parts
    return f"{parts[0]}/" if len(parts) > 1 else parts[0]


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules that the file at ``path`` (module ``name``) imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: anchor at this module's package
                anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:  # `import dflashkit.a.b` counts as dflashkit.a.b, or its nearest known parent
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                out.add(target)
    return out


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package's ``__init__.py`` under the package's name)."""
    return {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def module_imports(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module-level import graph: each module -> the package's other modules it imports (any depth of its code)."""
    files = module_files(package)
    return {name: _imported(path, name, set(files)) - {name} for name, path in files.items()}


def graph(package: Path = PACKAGE) -> tuple[list[str], list[tuple[str, str]]]:
    """Sorted nodes and sorted edges (importer, imported) between different nodes."""
    node_of = {name: _node(path, package) for name, path in module_files(package).items()}
    edges = {
        (node_of[name], node_of[target])
        for name, targets in module_imports(package).items()
        for target in targets
        if node_of[target] != node_of[name]
    }
    return sorted(set(node_of.values())), sorted(edges)


def mermaid(package: Path = PACKAGE) -> str:
    nodes, edges = graph(package)
    ids = {n: n.removesuffix(".py").strip("_/") for n in nodes}
    lines = ["```mermaid", "flowchart TD"]
    lines += [f'    {ids[n]}["{n}"]' for n in nodes]
    for a in nodes:  # one line per importer: `a --> b & c`
        if targets := [ids[b] for x, b in edges if x == a]:
            lines.append(f"    {ids[a]} --> {' & '.join(targets)}")
    return "\n".join(lines + ["```"])


def _split(text: str, file: str) -> tuple[str, str, str]:
    """The text before the start marker (included), the block between the markers, and the rest."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise SystemExit(f"{file}: needs exactly one {START} ... {END} pair, in that order")
    head, rest = text.split(START)
    block, tail = rest.split(END)
    return head + START, block, END + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", metavar="FILE", help="exit 1 if FILE's diagram between the markers is stale")
    group.add_argument("--write", metavar="FILE", help="rewrite FILE's diagram between the markers")
    args = parser.parse_args(argv)
    diagram = mermaid()
    if args.check is None and args.write is None:
        print(diagram)
        return 0
    path = Path(args.check or args.write)
    head, block, tail = _split(path.read_text(), str(path))
    if args.write:
        path.write_text(f"{head}\n{diagram}\n{tail}")
        return 0
    if block.strip() != diagram:
        print(
            f"{path}: the import graph between the layout-graph markers is stale; "
            f"regenerate it with: python scripts/layout_graph.py --write {path}",
            file=sys.stderr,
        )
        return 1
    print(f"{path}: import graph up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
