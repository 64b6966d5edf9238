"""The `dflashkit` command line's top level: the parser, assembled from each command module's subcommands, and the
entry point that runs the chosen command.

A command's parser is meant to be built without model code (torch, transformers), so that ``--help`` answers at once
and a bad argument is refused before anything slow starts; each command imports what it needs when it runs
(tests/cli/test_main.py checks which parsers meet this)."""

from __future__ import annotations

import argparse
import sys

from dflashkit.cli import drafters, export, generate, serve
from dflashkit.cli.common import CommandParser, TopHelpFormatter
from dflashkit.errors import DFlashError

EXAMPLES = """first steps:
  dflashkit generate "Name three oceans." --compare-ar    answer a prompt; compare with plain decoding
  dflashkit chat                                          a conversation in the terminal
  dflashkit serve                                         an OpenAI-compatible server with a playground
  dflashkit drafters                                      the drafters that ship with dflashkit

`dflashkit COMMAND --help` lists a command's options with their defaults."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        if getattr(args, "device", None) not in (None, "cpu"):  # (checking the CPU would import torch for nothing)
            from dflashkit.target.loading import resolve_device

            resolve_device(args.device)  # a bad or absent device fails before any (slow) load
        return args.func(args)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; every subcommand's parser is a CommandParser, whose --help shows each default."""
    from dflashkit.bench.command import add_bench_parser
    from dflashkit.cli import train

    parser = CommandParser(
        prog="dflashkit",
        description="Lossless speculative decoding with DFlash drafters: the output is the target model's own,\n"
        "produced in fewer passes of the target.",
        epilog=EXAMPLES,
        formatter_class=TopHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    generate.add_parsers(sub)  # generate, chat
    serve.add_parsers(sub)
    train.add_parsers(sub)  # data, train, ngram-store
    add_bench_parser(sub)
    export.add_parsers(sub)
    drafters.add_parsers(sub)
    return parser


if __name__ == "__main__":
    sys.exit(main())
