"""What several commands share: the help formatter, the dtype names, the argument types that refuse bad values while
the command line is parsed, the options that more than one subcommand takes, the grammar and tool flags read before a
model loads, the loading spinner, and the target and drafter loading of generate, chat and serve.

Nothing here imports torch at module level, so that the parsers built with it need no torch (a fast ``--help``)."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dflashkit.decoding.grammar import Grammar
    from dflashkit.generator import SpeculativeGenerator
    from dflashkit.tool_calls import ToolRequest

DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
# dflashkit.kernels.quantize.METHODS, named here so that parsers need no torch (a test checks)
QUANTIZE_METHODS = ("int8", "int4")


class _TorchDtypes(Mapping[str, "torch.dtype"]):
    """--dtype name -> torch dtype. Its keys are plain strings; torch is imported on the first lookup only, so a
    parser that lists the names (``choices=sorted(DTYPES)``) stays light."""

    def __getitem__(self, name: str) -> torch.dtype:
        import torch

        return getattr(torch, DTYPE_NAMES[name])

    def __iter__(self) -> Iterator[str]:
        return iter(DTYPE_NAMES)

    def __len__(self) -> int:
        return len(DTYPE_NAMES)


DTYPES: Mapping[str, torch.dtype] = _TorchDtypes()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every option's default: appended as "(default: X)" unless the help text already speaks of its
    default; never "(default: None)" (an option whose default is None says in its help what happens without it), and
    nothing for a plain on/off flag (off unless given); an ``--x/--no-x`` pair shows "on" or "off"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text.lower()
            or default is None
            or default is argparse.SUPPRESS
            or (isinstance(default, (str, list, tuple)) and not default)
        ):
            return text
        if action.nargs == 0:  # flags: only an --x/--no-x pair has a default worth saying
            if isinstance(action, argparse.BooleanOptionalAction) and isinstance(default, bool):
                return f"{text} (default: {'on' if default else 'off'})"
            return text
        return f"{text} (default: %(default)s)"


class TopHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """The top-level ``dflashkit --help``: its description and examples keep their line breaks."""


class CommandParser(argparse.ArgumentParser):
    """The parser of ``dflashkit`` and of each subcommand (``add_subparsers`` makes its subparsers of this class):
    :class:`HelpFormatter` unless another formatter is given."""

    def __init__(
        self, *args: Any, formatter_class: type[argparse.HelpFormatter] = HelpFormatter, **kwargs: Any
    ) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


# ---- argument types: a bad value is refused by argparse (exit 2, usage and one line) before anything loads ----


def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_at_least(low: int, note: str = "") -> Callable[[str], int]:
    """An argparse type: an integer >= `low` (`note`: what the bound means, added to the message)."""

    def parse(text: str) -> int:
        value = _number(text, int)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}{note}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def temperature_arg(text: str) -> float:
    """A sampling temperature: a finite number >= 0 (0: greedy)."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: greedy), got {value:g}")
    return value


def top_p_arg(text: str) -> float:
    """A nucleus (top-p) mass: in (0, 1], 1 keeping every token."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1: no nucleus filter), got {value:g}")
    return value


def block_size_arg(text: str) -> int | str:
    """A verify block size: 'auto' or an integer >= 2 (the anchor token and at least one draft)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2 or 'auto', got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be at least 2 (the anchor token and one draft) or 'auto', got {value}; --drafter none decodes "
            "plainly"
        )
    return value


def port_arg(text: str) -> int:
    """A TCP port: 0..65535."""
    value = _number(text, int)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def drafter_arg(text: str) -> str:
    """A --drafter value: a shipped drafter's short name becomes its folder (unless a path of that name exists: a
    path wins); none, untrained, auto and paths stay as given (a missing folder is refused before the model loads,
    by :func:`check_drafter_arg`)."""
    from dflashkit.drafter.registry import drafter_name_or_path

    return drafter_name_or_path(text)


def drafter_folder_arg(text: str) -> str:
    """A drafter folder or a shipped drafter's short name, as export takes it (no keywords)."""
    from dflashkit.drafter.registry import drafter_name_or_path

    return drafter_name_or_path(text, keywords=())


def check_drafter_arg(choice: str | None, keywords: tuple[str, ...] | None = None) -> None:
    """Refuse a --drafter that is no folder and no shipped drafter, naming the shipped ones (before any load)."""
    from dflashkit.drafter.registry import KEYWORDS, check_drafter

    if choice is not None:
        check_drafter(choice, KEYWORDS if keywords is None else keywords)


DRAFTER_HELP = (
    "the drafter: a shipped drafter's name (`dflashkit drafters` lists them) or a drafter folder (a path wins over a "
    "name); 'none': plain decoding (with --lookup: prompt lookup alone); 'untrained': a random drafter (exercises the "
    "speculative path, τ≈1); default (or 'auto'): the drafter shipped for the target, and where none ships, prompt "
    "lookup alone (--no-lookup: plain decoding)"
)
TARGET_HELP = (
    "HF model id, local folder, or qwen2.5-coder-1.5b / qwen2.5-coder-0.5b (assembled from their packages, converted "
    "to bf16 once) (default: the embedded SmolLM2-135M-Instruct)"
)


def add_dtype_device_options(parser: argparse.ArgumentParser) -> None:
    """--dtype and --device, as generate, chat and serve take them."""
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="number format of the target and the drafter: bfloat16 (bf16) or float32 (fp32: twice the memory; "
        "speculative and plain outputs then equal token for token, where bf16 may part at a numerical tie)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        metavar="DEVICE",
        help="where the models run: cpu, cuda, cuda:N, ... (checked before anything loads)",
    )


def add_block_size_option(parser: argparse.ArgumentParser) -> None:
    """--block-size, as generate, chat and serve take it."""
    parser.add_argument(
        "--block-size",
        type=block_size_arg,
        default=None,
        metavar="SIZE",
        help="verify block size (at least 2: the anchor token and its drafts), or 'auto': chosen per step for the "
        "most tokens/s (default: auto)",
    )


def add_quantize_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quantize",
        choices=["none", *QUANTIZE_METHODS],
        default="none",
        help="int8: weight-only int8 target weights, one scale per output channel (CPU, GPU). int4: 4-bit weights "
        "per block of 32 with int8 activations, as llama.cpp's Q4 GGUFs (CPU, bf16; the fastest on a CPU). A "
        "different target: the output is exact with respect to the quantized model, not the --dtype one "
        "(default: %(default)s)",
    )


def add_tree_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tree",
        type=int_at_least(0, " (0: chains)"),
        default=None,
        metavar="N",
        help="drafter steps verify a token tree of up to N nodes (the drafter's likeliest alternatives at each "
        "position, chosen best-first; when sampling with the rejection sampler, candidates drawn from the drafter and "
        "tried in turn) instead of a chain; greedy or seeded, a prompt-lookup copy and the drafter's candidates share "
        "one tree: more tokens per pass for a wider verify (lossless; fast forward only; "
        "without --block-size, over the drafter's block size; default: trees of 6 nodes for seeded sampling with the "
        "adaptive block size (coupled sampler), chains otherwise; 0: chains in any case)",
    )


def add_draft_window_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft-window",
        type=int_at_least(0, " (0: the whole context)"),
        default=None,
        metavar="N",
        help="drafting attends to the last N context tokens only; 0: the whole context (default: the drafter's own "
        "window, from its config.json; the shipped drafter's was chosen by measurement on long prompts). Changes "
        "which drafts are proposed, never the output",
    )


def add_grammar_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "structured output",
        "constrain the output to a grammar (llguidance); exact with respect to the target "
        "constrained to it, in speculative and plain decoding alike (token trees are not used). Without one of these "
        "flags the output is unconstrained",
    ).add_mutually_exclusive_group()
    group.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    group.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="the output is JSON valid under this schema: a file, or the schema's JSON text",
    )
    group.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression as a whole")
    group.add_argument(
        "--choice",
        metavar="TEXT",
        action="append",
        default=None,
        help="the output is exactly one of these texts (repeat the flag for each)",
    )
    group.add_argument(
        "--lark",
        metavar="FILE",
        help="the output is in the language of this Lark grammar file (llguidance's dialect; start rule `start`)",
    )


def add_proposal_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--proposal",
        choices=["argmax", "sample"],
        default="sample",
        help="how drafts are proposed when sampling: drawn from the drafter (default: more accepted "
        "at T=1) or its argmax; both exact",
    )
    parser.add_argument(
        "--proposal-temperature",
        type=float,
        default=None,
        metavar="RATIO",
        help="when sampling, drafts are drawn at RATIO times the temperature (any RATIO is exact; "
        "default: the drafter's own, its config's proposal_temperature)",
    )


def add_sampler_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sampler",
        choices=["rejection", "coupled"],
        default=None,
        help="how sampled drafts are verified, both exact: 'rejection' (speculative sampling: the most drafts "
        "accepted) or 'coupled' (Gumbel-max with noise fixed by the seed: the output is plain sampling's for "
        "that seed, whatever the drafter or block size); default: coupled with --seed, else rejection",
    )


def add_lookup_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ngram-store",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with prompt lookup: where the text has no repeat of its own, draft from the drafter's n-gram store of "
        "the target's past answers, if its folder has one (default: on)",
    )
    parser.add_argument(
        "--lookup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prompt lookup: where the text ends with a 2-4-gram seen before, draft the tokens that followed it "
        "instead of running the drafter (lossless; default: on, except with --drafter none; without a drafter: "
        "prompt lookup alone, its copies sized per step and declined for plain steps where they do not pay)",
    )


def add_eager_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--eager",
        "--no-compile",
        dest="eager",
        action="store_true",
        help="the eager path, for debugging and comparisons: plain nn.Linear layers instead of the fast path's "
        "weights prepacked for oneDNN (same bf16 results, slower)",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on a CUDA device, run the target's and the drafter's decode steps eagerly instead of replaying "
        "CUDA graphs",
    )


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="CPU threads for torch (default: torch's choice, with a note where other processes keep cores busy). "
        "On a busy machine, fewer threads than cores avoids OpenMP stalls that can slow work many times over",
    )


def grammar_from_args(args: argparse.Namespace) -> Grammar | None:
    """The Grammar the generate flags ask for (None: unconstrained); files are read and JSON parsed here, before
    the (slow) model load."""
    from dflashkit.decoding.grammar import Grammar

    if args.json_object:
        return Grammar.json_object()
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            text = _read_text_file(text, "--json-schema")
        return Grammar.json_schema(text)
    if args.regex is not None:
        return Grammar.regex(args.regex)
    if getattr(args, "choice", None):
        return Grammar.choice(args.choice)
    if args.lark is not None:
        return Grammar.lark(_read_text_file(args.lark, "--lark"))
    return None


def tools_from_args(args: argparse.Namespace, other_grammar: bool) -> ToolRequest | None:
    """The --tools / --tool-choice request, checked before the model loads (None without --tools)."""
    from dflashkit.errors import InvalidInputError
    from dflashkit.tool_calls import ToolRequest

    if args.tools is None:
        if args.tool_choice is not None:
            raise InvalidInputError("--tool-choice needs --tools")
        return None
    text = args.tools if args.tools.lstrip().startswith("[") else _read_text_file(args.tools, "--tools")
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"--tools is not valid JSON: {e}") from None
    choice = args.tool_choice
    if choice not in (None, "auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    request = ToolRequest.parse(tools, choice)
    if args.no_chat:
        raise InvalidInputError("--tools go through the chat template: they cannot be combined with --no-chat")
    if request is not None and request.forced and other_grammar:
        raise InvalidInputError(
            "--tool-choice required / a name makes the answer a tool call: it cannot also follow "
            "a structured-output flag"
        )
    return request


def _read_text_file(path: str, flag: str) -> str:
    from dflashkit.errors import InvalidInputError

    try:
        return pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{flag}: cannot read {path!r}: {exc}") from None


@contextmanager
def status(message: str, quiet: bool) -> Iterator[None]:
    """A spinner on stderr while something slow runs (model loading, conversion)."""
    if quiet or not sys.stderr.isatty():
        print(message, file=sys.stderr)
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield


def load_generator(args: argparse.Namespace, quiet: bool) -> SpeculativeGenerator:
    """The target and the drafter chosen by --target/--drafter/--dtype/--device (notes go to stderr)."""
    check_drafter_arg(args.drafter)  # a missing drafter folder fails before the (slow) target load
    from dflashkit.generator import SpeculativeGenerator

    with status("Loading target model...", quiet):
        gen = SpeculativeGenerator.load(
            args.target,
            None,
            dtype=DTYPES[args.dtype],
            device=args.device,
            quantize=args.quantize,
            fast=not args.eager,
            cuda_graphs=args.cuda_graphs,
        )
        drafter, drafter_note = _resolve_drafter(args.drafter, args.target, gen, getattr(args, "lookup", None))
        if drafter is not None:
            gen = SpeculativeGenerator(
                gen.model, gen.tokenizer, drafter, fast=not args.eager, cuda_graphs=args.cuda_graphs
            )
        else:  # as SpeculativeGenerator.load(drafter="auto"): where no drafter ships, prompt lookup alone by default
            gen.lookup_without_drafter = args.drafter in (None, "auto")
    if drafter_note:
        print(drafter_note, file=sys.stderr)
    return gen


def _resolve_drafter(choice: str | None, target: str | None, gen, lookup: bool | None) -> tuple[Any, str | None]:
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.drafter.identity import drafter_config_for
    from dflashkit.drafter.network import DFlashDrafter
    from dflashkit.drafter.registry import shipped_drafter

    if choice == "none":
        if lookup:
            return None, "Prompt lookup alone (--drafter none --lookup): copies where the text repeats itself."
        return None, "Plain autoregressive decoding (--drafter none)."
    if choice == "untrained":
        import torch

        torch.manual_seed(0)
        drafter = DFlashDrafter(drafter_config_for(gen.model, num_layers=3)).to(gen.model.dtype)
        return drafter, "Using an UNTRAINED random drafter: it exercises the speculative path; expect τ ≈ 1."
    if choice in (None, "auto"):
        path = shipped_drafter(target)
        if path is None:
            how = (
                "decoding autoregressively (--no-lookup)"
                if lookup is False
                else "prompt lookup alone (copies where the text repeats itself, plain steps elsewhere)"
            )
            return None, f"No trained drafter ships for this target yet: {how}. Pass --drafter PATH to draft."
        choice = str(path)
    return load_drafter(choice, dtype=gen.model.dtype, device=gen.model.device), None


def note_tree_without_drafter(args: argparse.Namespace, has_drafter: bool) -> None:
    if not args.tree:  # None (the default) or 0 (chains): no tree asked for
        pass
    elif not has_drafter:
        print(
            "--tree has no effect without a drafter (token trees are made of the drafter's alternatives).",
            file=sys.stderr,
        )
    elif getattr(args, "eager", False):
        print(
            "--tree has no effect with --eager (token trees need the fast forward): chains are verified.",
            file=sys.stderr,
        )
    elif _chains_only(args):
        print(
            f"--tree has no effect with {_chains_only(args)} (each verify row depends on the drafts before it): "
            "chains are verified.",
            file=sys.stderr,
        )
    if getattr(args, "draft_window", None) is not None and not has_drafter:
        print("--draft-window has no effect without a drafter.", file=sys.stderr)


def _chains_only(args: argparse.Namespace) -> str:
    """The generate options that rule out token trees, in words ("" if none)."""
    grammar = any(getattr(args, name, None) for name in ("json_object", "json_schema", "regex", "lark", "choice"))
    penalties = (
        getattr(args, "presence_penalty", 0.0)
        or getattr(args, "frequency_penalty", 0.0)
        or getattr(args, "repetition_penalty", 1.0) != 1.0
    )
    return " or ".join(what for what, on in (("a grammar", grammar), ("penalties", penalties)) if on)
