"""`dflashkit drafters`: the drafters that ship with the package, listed from their config.json (no model loads)."""

from __future__ import annotations

import argparse
import json


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add the `drafters` subcommand."""
    d = subparsers.add_parser(
        "drafters",
        help="list the drafters shipped with dflashkit (name, target, layers, block size, size, folder)",
        description="List the drafters that ship inside the package, read from their config.json (nothing loads). "
        "Pass a name to --drafter of generate, chat, serve and bench, or to export; without --drafter, generate "
        "uses the drafter shipped for its target.",
    )
    d.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    d.set_defaults(func=cmd_drafters)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_drafters(args: argparse.Namespace) -> int:
    from dflashkit.drafter.registry import shipped_drafters

    found = shipped_drafters()
    if args.json:
        rows = [
            {
                "name": d.name,
                "target": d.target,
                "layers": d.layers,
                "block_size": d.block_size,
                "size_bytes": d.size_bytes,
                "path": str(d.path),
            }
            for d in found
        ]
        print(json.dumps(rows, indent=2))
        return 0
    if not found:
        print("No drafters ship with this installation: pass --drafter FOLDER (see `dflashkit train`).")
        return 0
    header = ("NAME", "TARGET", "LAYERS", "BLOCK", "SIZE", "FOLDER")
    rows = [
        (d.name, d.target or "?", str(d.layers or "?"), str(d.block_size or "?"), _size(d.size_bytes), str(d.path))
        for d in found
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    print(f'\nUse one with --drafter NAME, e.g. dflashkit generate "Hello" --drafter {found[0].name}')
    return 0
