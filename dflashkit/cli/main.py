"""The `dflashkit` command line's top level: the parser, assembled from each command module's subcommands, and the
entry point that runs the chosen command."""

from __future__ import annotations

import argparse
import sys

from dflashkit.cli import export, generate, serve, train
from dflashkit.errors import DFlashError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        if getattr(args, "device", None) is not None:
            from dflashkit.target.loading import resolve_device

            resolve_device(args.device)  # a bad or absent device fails before any (slow) load
        return args.func(args)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflashkit", description="Lossless speculative decoding with DFlash drafters."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parsers(sub)  # generate, chat
    serve.add_parsers(sub)
    train.add_parsers(sub)  # data, train, ngram-store
    from dflashkit.bench.command import add_bench_parser

    add_bench_parser(sub)
    export.add_parsers(sub)
    return parser


if __name__ == "__main__":
    sys.exit(main())
