"""`dflashkit export`: a drafter written for vLLM / SGLang (published HF layout) or llama.cpp (GGUF)."""

from __future__ import annotations

import argparse
import sys

from dflashkit.cli.common import status


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add the `export` subcommand."""
    e = subparsers.add_parser(
        "export",
        help="export a drafter for vLLM / SGLang (published HF layout) or llama.cpp (GGUF); prints how to serve it",
        description="Export a drafter after checking that it belongs to the target. --format hf writes the "
        "published DFlash layout that vLLM and SGLang load; --format gguf runs llama.cpp's own converter "
        "(convert_hf_to_gguf.py --target-model-dir) from a llama.cpp checkout (scripts/get_llama_cpp.sh).",
    )
    e.add_argument("drafter", help="drafter folder (published DFlash layout, e.g. made by `dflashkit train`)")
    e.add_argument("--format", choices=["hf", "gguf"], required=True)
    e.add_argument(
        "--target", default=None, help="HF model id or local folder (default: embedded SmolLM2-135M-Instruct)"
    )
    e.add_argument("--out", default=None, help="output folder (default: DRAFTER-hf or DRAFTER-gguf beside the drafter)")
    e.add_argument(
        "--llama-cpp", default=None, help="llama.cpp checkout for --format gguf (default: $DFLASHKIT_LLAMA_CPP)"
    )
    e.add_argument(
        "--target-gguf", action="store_true", help="with --format gguf: also write the target as a bf16 GGUF"
    )
    e.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    import pathlib

    import torch

    from dflashkit.errors import InvalidInputError
    from dflashkit.interop import export

    torch.set_num_threads(1)  # export is I/O and small matmuls
    drafter = pathlib.Path(args.drafter).expanduser()
    if args.target_gguf and args.format != "gguf":
        raise InvalidInputError("--target-gguf goes with --format gguf")
    out = (
        pathlib.Path(args.out).expanduser()
        if args.out
        else drafter.resolve().with_name(f"{drafter.resolve().name}-{args.format}")
    )
    with status(f"Exporting {drafter} ({args.format})...", False):
        if args.format == "hf":
            result = export.export_hf(drafter, out, target=args.target)
        else:
            result = export.export_gguf(
                drafter, out, target=args.target, llama_cpp=args.llama_cpp, target_gguf=args.target_gguf
            )
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"Exported to {result.path}" + (f" (target: {result.target_gguf})" if result.target_gguf else ""))
    for engine, command in result.commands.items():
        print(f"Serve with {engine}:\n  {command}")
    return 0
