"""`dflashkit export`: a drafter written for vLLM / SGLang (published HF layout) or llama.cpp (GGUF)."""

from __future__ import annotations

import argparse
import sys

from dflashkit.cli.common import TARGET_HELP, check_drafter_arg, drafter_folder_arg, status


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add the `export` subcommand."""
    e = subparsers.add_parser(
        "export",
        help="export a drafter for vLLM / SGLang (published HF layout) or llama.cpp (GGUF); prints how to serve it",
        description="Export a drafter after checking that it belongs to the target. --format hf writes the "
        "published DFlash layout that vLLM and SGLang load; --format gguf runs llama.cpp's own converter "
        "(convert_hf_to_gguf.py --target-model-dir) from a llama.cpp checkout (scripts/get_llama_cpp.sh).",
    )
    e.add_argument(
        "drafter",
        type=drafter_folder_arg,
        help="drafter folder (published DFlash layout, e.g. made by `dflashkit train`), or a shipped drafter's name "
        "(`dflashkit drafters` lists them)",
    )
    e.add_argument(
        "--format",
        choices=["hf", "gguf"],
        required=True,
        help="hf: the published DFlash layout (safetensors + config.json) that vLLM and SGLang load; gguf: a GGUF "
        "for llama.cpp's DFlash (needs a llama.cpp checkout)",
    )
    e.add_argument("--target", default=None, help=TARGET_HELP)
    e.add_argument(
        "--out",
        default=None,
        help="output folder (default: DRAFTER-hf or DRAFTER-gguf beside the drafter folder; for a shipped drafter, "
        "in the current folder)",
    )
    e.add_argument(
        "--llama-cpp", default=None, help="llama.cpp checkout for --format gguf (default: $DFLASHKIT_LLAMA_CPP)"
    )
    e.add_argument(
        "--target-gguf", action="store_true", help="with --format gguf: also write the target as a bf16 GGUF"
    )
    e.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    import pathlib

    check_drafter_arg(args.drafter, keywords=())  # before torch and the target load

    import torch

    from dflashkit.drafter.registry import DRAFTERS_DIR
    from dflashkit.errors import InvalidInputError
    from dflashkit.interop import export

    torch.set_num_threads(1)  # export is I/O and small matmuls
    drafter = pathlib.Path(args.drafter).expanduser()
    if args.target_gguf and args.format != "gguf":
        raise InvalidInputError("--target-gguf goes with --format gguf")
    folder = drafter.resolve()
    if args.out:
        out = pathlib.Path(args.out).expanduser()
    elif folder.parent == DRAFTERS_DIR.resolve():  # a shipped drafter: not into the installed package
        out = pathlib.Path.cwd() / f"{folder.name}-{args.format}"
    else:
        out = folder.with_name(f"{folder.name}-{args.format}")
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
