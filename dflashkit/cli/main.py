"""Command line: `dflashkit generate PROMPT` streams a speculative generation and prints its statistics; `data`,
`train` and `export` make, train and export drafters."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import threading
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from dflashkit.cpuload import apply_threads
from dflashkit.drafter import ngram_store
from dflashkit.errors import DFlashError

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


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
    g = sub.add_parser("generate", help="generate text for a prompt (streams; prints τ and tok/s)")
    g.add_argument(
        "prompt", help="prompt text (sent through the chat template unless --no-chat); - reads it from standard input"
    )
    g.add_argument("--system", default=None, metavar="TEXT", help="a system message before the prompt (chat template)")
    g.add_argument(
        "--target", default=None, help="HF model id or local folder (default: embedded SmolLM2-135M-Instruct)"
    )
    g.add_argument(
        "--drafter",
        default=None,
        help="drafter folder; 'none' for plain decoding; 'untrained' for a random drafter (exercises the "
        "speculative path, τ≈1); default: the drafter shipped for the target, if any",
    )
    g.add_argument(
        "--block-size",
        type=_block_size_arg,
        default=None,
        help="verify block size, or 'auto': chosen per step for the most tokens/s (default: auto)",
    )
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    _add_proposal_options(g)
    _add_sampler_option(g)
    g.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="OpenAI's presence penalty, -2..2: subtracted once from tokens already in the output",
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="OpenAI's frequency penalty, -2..2: subtracted per occurrence in the output",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="transformers' repetition penalty (> 0; 1: off) over the prompt's and the output's tokens",
    )
    _add_lookup_option(g)
    _add_tree_option(g)
    _add_draft_window_option(g)
    _add_grammar_options(g)
    t = g.add_argument_group(
        "tool calling",
        "offer functions to a target whose chat template writes <tool_call> "
        "blocks (Qwen2.5, Qwen3, Hermes); the calls are printed after the text",
    )
    t.add_argument("--tools", metavar="TOOLS", help="OpenAI function tools: a JSON file, or the JSON text of the list")
    t.add_argument(
        "--tool-choice",
        default=None,
        metavar="CHOICE",
        help="auto (default), none, required, or a tool's name (required and a name force a call)",
    )
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-chat", action="store_true", help="send the prompt as raw text, without the chat template")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    _add_quantize_option(g)
    _add_eager_option(g)
    g.add_argument("--device", default="cpu")
    _add_threads_option(g)
    g.add_argument(
        "--compare-ar", action="store_true", help="also decode plainly; print speedup and whether outputs match"
    )
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="also print each token's log-probability under the target and its K likeliest "
        "alternatives (0-20; in --json: a 'logprobs' list)",
    )
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser(
        "chat",
        help="chat in the terminal: multi-turn, streamed, each turn prefilling only what is new",
        description="A conversation through the target's chat template: type a message, read the answer as it "
        "streams, with its stats. Each turn restores what the previous one computed (a prefix cache), so it costs "
        "its new message and its answer, not the history. /reset starts over, /exit (or end of input) leaves; "
        "Ctrl-C stops an answer. Reads one message per line from standard input when it is not a terminal.",
    )
    c.add_argument("--system", default=None, metavar="TEXT", help="a system message at the start of the conversation")
    c.add_argument(
        "--target", default=None, help="HF model id or local folder (default: embedded SmolLM2-135M-Instruct)"
    )
    c.add_argument("--drafter", default=None, help="drafter folder, 'none' or 'untrained' (as for generate)")
    c.add_argument(
        "--block-size",
        type=_block_size_arg,
        default=None,
        help="verify block size, or 'auto': chosen per step for the most tokens/s (default: auto)",
    )
    c.add_argument("--max-new-tokens", type=int, default=512, help="per answer (default: %(default)s)")
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=None)
    _add_sampler_option(c)
    _add_lookup_option(c)
    _add_draft_window_option(c)
    c.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=256.0,
        help="MiB of earlier turns kept for reuse (default: %(default)s; 0: every turn prefills it all)",
    )
    c.add_argument("--no-stats", dest="stats", action="store_false", help="no stats line after each answer")
    c.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    _add_quantize_option(c)
    _add_eager_option(c)
    c.add_argument("--device", default="cpu")
    _add_threads_option(c)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (streaming, speculative stats, /metrics) with a live playground",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics and a playground "
        "at /. Up to --max-batch generations run at once, their target passes batched (first come, first "
        "served); up to --max-queue requests wait, more are answered 429 with Retry-After.",
    )
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: %(default)s; 0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--target", default=None, help="HF model id or local folder (default: embedded SmolLM2-135M-Instruct)"
    )
    s.add_argument("--drafter", default=None, help="drafter folder, 'none' or 'untrained' (as for generate)")
    s.add_argument("--model-name", default=None, help="model id clients send (default: the target's name)")
    s.add_argument(
        "--block-size",
        type=_block_size_arg,
        default=None,
        help="verify block size, or 'auto': chosen per step for the most tokens/s (default: auto)",
    )
    _add_proposal_options(s)
    _add_sampler_option(s)
    _add_lookup_option(s)
    _add_tree_option(s)
    _add_draft_window_option(s)
    s.add_argument("--max-queue", type=int, default=16, help="requests that may wait while --max-batch run")
    s.add_argument(
        "--max-batch",
        type=int,
        default=4,
        help="generations that run at once, their target passes batched into one (1-16; default: "
        "%(default)s; 1: one at a time); each generation's output is unchanged",
    )
    s.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=256.0,
        help="MiB of finished generations kept so that a prompt that begins the same way (a chat's next "
        'turn) prefills only its new tokens (default: %(default)s; 0: off; a request\'s "cache_prompt": '
        "false opts out)",
    )
    s.add_argument(
        "--stored-responses",
        type=int,
        default=256,
        help="/v1/responses answers kept in memory, for previous_response_id and GET /v1/responses/{id} "
        "(default: %(default)s; 0: none)",
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("DFLASHKIT_API_KEY"),
        help="require this key on /v1/* ('Authorization: Bearer KEY' or 'x-api-key: KEY'; default: "
        "$DFLASHKIT_API_KEY, else none); /health, /metrics and the playground page stay open",
    )
    s.add_argument(
        "--clamp-max-tokens",
        action="store_true",
        help="lower a max_tokens that goes past the context to what fits (the answer then ends there, "
        "finish_reason length) instead of refusing the request; for clients that always send a large "
        "max_tokens, e.g. coding agents (llama-server's behaviour)",
    )
    s.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated browser origins allowed to call the API from other pages (CORS), e.g. "
        "http://localhost:3000, or '*' for any (default: none)",
    )
    s.add_argument("--timeout", type=float, default=600.0, help="seconds from arrival to the last token (0: no limit)")
    s.add_argument("--default-max-tokens", type=int, default=256, help="when a request gives no max_tokens")
    s.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    _add_quantize_option(s)
    _add_eager_option(s)
    s.add_argument("--device", default="cpu")
    _add_threads_option(s)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser(
        "data",
        help="build drafter training data: prompts from packaged sources, responses regenerated by the target",
        description="Collect prompts (deduplicated; evaluation prompts excluded), let the target answer them, and "
        "write resumable shards. Run the same command again to resume an interrupted run.",
    )
    d.add_argument("--out", default=None, help="output folder (default: <cache>/data/<target name>)")
    d.add_argument(
        "--target", default=None, help="HF model id or local folder (default: embedded SmolLM2-135M-Instruct)"
    )
    d.add_argument(
        "--sources",
        default="sharegpt:0.8,math:0.2",
        help="comma-separated prompt sources with relative weights: sharegpt[:W] (first turns), "
        "sharegpt-turns[:W] (later turns with the exchange before them), math[:W], code[:W] (complete documented "
        "functions and methods of the installed Python source), magpie[:W] (requests written by the target itself, "
        "given its chat template up to a user's text), magpie-code[:W] (the same under a system prompt that says its "
        "users ask for Python functions), jsonl:PATH[:W], "
        "hf:NAME[:SPLIT[:FIELD]][:W] (default: %(default)s)",
    )
    d.add_argument("--num-prompts", type=int, default=1024)
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="prompts answered together (decoding at once, a "
        "finished one's slot taking the next prompt; with --server: requests in flight); default 64, on a "
        "GPU 1024",
    )
    d.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="answer through an OpenAI-compatible server that serves --target (vLLM, SGLang, llama-server, "
        "dflashkit serve), e.g. http://localhost:8000/v1; the target's weights are then not loaded here",
    )
    d.add_argument(
        "--server-model",
        default=None,
        metavar="NAME",
        help="with --server: the model name to request (default: the first the server lists)",
    )
    d.add_argument("--api-key", default=None, help="with --server: its API key (default: $OPENAI_API_KEY)")
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts")
    d.add_argument("--min-chars", type=int, default=10, help="skip prompts shorter than this (characters)")
    d.add_argument("--max-chars", type=int, default=2000, help="skip prompts longer than this (characters)")
    d.add_argument("--shard-size", type=int, default=256, help="prompts per shard (the unit lost if killed)")
    d.add_argument(
        "--engine",
        choices=["auto", "continuous", "static", "batches"],
        default="auto",
        help="how a local target answers: continuous (the fast forward's batched passes, a CPU's default), "
        "static (one fixed-shape batch of slots, its step a CUDA graph: a GPU's default), batches "
        "(transformers' decoder in static batches: any model); default: %(default)s",
    )
    d.add_argument("--no-eval-exclusion", action="store_true", help="keep prompts that match evaluation sets")
    d.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    d.add_argument("--device", default="cpu")
    _add_threads_option(d)
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=cmd_data)

    t = sub.add_parser(
        "train",
        help="train a DFlash drafter on data made by `dflashkit data` (resumes a killed run)",
        description="Train a drafter: random anchors in the target's regenerated responses, the DFlash block "
        "mask and the position-decayed loss; target embedding and LM head frozen. Checkpoints every "
        "--checkpoint-every steps; running the same command again resumes.",
    )
    t.add_argument(
        "--data", default=None, help="data folder, or several separated by commas (default: <cache>/data/<target name>)"
    )
    t.add_argument(
        "--out", default=None, help="run folder (default: <cache>/runs/<target name>); drafter in OUT/drafter"
    )
    t.add_argument(
        "--target", default=None, help="HF model id or local folder (default: embedded SmolLM2-135M-Instruct)"
    )
    t.add_argument("--layers", type=int, default=None, help="drafter depth (default: the --init drafter's, else 3)")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--gamma", type=float, default=7.0, help="loss decay: weight exp(-(k-1)/gamma) at block offset k")
    t.add_argument(
        "--loss-weighting",
        choices=("decay", "dpace"),
        default="decay",
        help="per-offset loss weights: the paper's decay (--gamma), or D-PACE's, from the drafter's own "
        "chance of being accepted through each offset (--dpace-alpha)",
    )
    t.add_argument("--dpace-alpha", type=float, default=0.5, help="with --loss-weighting dpace: s_k = (1-a) q_k + a")
    t.add_argument(
        "--target-layers", default=None, help="comma-separated target layer ids (default: the reference rule)"
    )
    t.add_argument("--mask-token-id", type=int, default=None, help="mask id (default: a learned mask embedding)")
    t.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per sequence")
    t.add_argument("--seqs-per-step", type=int, default=8)
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of the steps")
    t.add_argument("--max-seq-len", type=int, default=768)
    t.add_argument("--draft-vocab", type=int, default=8192, help="loss vocabulary: most frequent N tokens (0 = all)")
    t.add_argument(
        "--distill-topk",
        type=int,
        default=0,
        metavar="K",
        help="also learn the target's own next-token distribution (its top K per position, computed with "
        "the features and cached beside them); 0 = the regenerated tokens only (default)",
    )
    t.add_argument(
        "--distill-weight",
        type=float,
        default=0.5,
        help="with --distill-topk: loss = (1 - w) * token cross-entropy + w * distribution cross-entropy",
    )
    t.add_argument("--random-init", action="store_true", help="do not initialise from the target's last layers")
    t.add_argument(
        "--init",
        default=None,
        metavar="DRAFTER",
        help="start from this drafter's weights (e.g. to continue on more data; same shape, or fewer "
        "layers than --layers: new layers are appended as identities; --target-layers may add "
        "feature layers to its own: their fusion columns start at zero)",
    )
    t.add_argument(
        "--eval-every", type=int, default=250, help="steps between τ estimates on held-out prompts (0 = never)"
    )
    t.add_argument(
        "--eval-sets",
        default=None,
        metavar="SETS",
        help="at each evaluation also τ on these evaluation sets' prompts, e.g. mt-bench,humaneval,math500 "
        "(logged as tau_sets; they never enter training data)",
    )
    t.add_argument(
        "--eval-set-prompts", type=int, default=4, metavar="N", help="prompts per evaluation set (default: 4)"
    )
    t.add_argument("--checkpoint-every", type=int, default=100)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu")
    t.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default="bf16",
        help="the drafter's forward: bf16 autocast over fp32 master weights (default), or fp32 throughout "
        "(GPUs without bf16; exact comparisons)",
    )
    t.add_argument(
        "--compile",
        action="store_true",
        help="run the drafter's training forward through torch.compile (inductor; needs a C++ compiler on "
        "a CPU): ~1.4x faster steps on the 2-core AMX VM after 2-3 min of compiling; falls back to eager "
        "where compiling fails",
    )
    t.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="train for about SECONDS (from the first step, loading not counted): the step rate measured "
        "over the first steps sizes the schedule to end in time; --steps is then the most it runs",
    )
    t.add_argument(
        "--feature-cache",
        choices=("auto", "on", "off"),
        default="auto",
        help="keep the target's features (and soft labels) on disk, one target pass per sequence per run; "
        "auto = on for the CPU (a target pass costs more than reading them back), off on a GPU",
    )
    _add_threads_option(t)
    t.add_argument("--no-resume", action="store_true", help="start over even if OUT has a checkpoint")
    t.set_defaults(func=cmd_train)

    n = sub.add_parser(
        "ngram-store",
        help="build a drafter's n-gram store from `dflashkit data` folders (drafts from the target's past answers)",
        description="Count, in the target's regenerated answers, the most frequent next token after every n-gram "
        "and write it into the drafter folder as ngram_store.safetensors. With prompt lookup on, generate/serve "
        "draft from it where the text has no repeat of its own (lossless; --no-ngram-store turns it off).",
    )
    n.add_argument("--data", required=True, help="data folder, or several separated by commas")
    n.add_argument("--out", required=True, help="drafter folder to write ngram_store.safetensors into")
    n.add_argument(
        "--n", type=int, default=ngram_store.DEFAULT_N, help="context length in tokens (default: %(default)s)"
    )
    n.add_argument(
        "--min-count",
        type=int,
        default=ngram_store.DEFAULT_MIN_COUNT,
        help="keep n-grams seen at least this often (default: %(default)s)",
    )
    n.add_argument(
        "--max-draft",
        type=int,
        default=ngram_store.DEFAULT_MAX_DRAFT,
        help="longest draft it proposes (default: %(default)s)",
    )
    n.add_argument(
        "--merge",
        action="append",
        default=[],
        metavar="STORE",
        help="merge an existing store into the new one (an ngram_store.safetensors or a drafter folder "
        "holding one; repeatable): the store grows with each batch of answers without their data",
    )
    n.add_argument(
        "--max-entries",
        type=int,
        default=None,
        metavar="N",
        help="keep the N n-grams counted most often (a size cap: ~10 bytes an n-gram of 3; default: all)",
    )
    n.set_defaults(func=cmd_ngram_store)

    from dflashkit.bench.command import add_bench_parser

    add_bench_parser(sub)
    e = sub.add_parser(
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
    return parser


def _block_size_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def _add_quantize_option(parser: argparse.ArgumentParser) -> None:
    from dflashkit.kernels.int8 import METHODS

    parser.add_argument(
        "--quantize",
        choices=["none", *METHODS],
        default="none",
        help="int8: weight-only int8 target weights, one scale per output channel (CPU). A different target: "
        "the output is exact with respect to the quantized model, not the --dtype one (default: %(default)s)",
    )


def _add_tree_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tree",
        type=int,
        default=None,
        metavar="N",
        help="drafter steps verify a token tree of up to N nodes (the drafter's likeliest alternatives at each "
        "position, chosen best-first; when sampling with the rejection sampler, candidates drawn from the drafter and "
        "tried in turn) instead of a chain; greedy or seeded, a prompt-lookup copy and the drafter's candidates share "
        "one tree: more tokens per pass for a wider verify (lossless; fast forward only; "
        "without --block-size, over the drafter's block size; default: trees of 6 nodes for seeded sampling with the "
        "adaptive block size (coupled sampler), chains otherwise; 0: chains in any case)",
    )


def _add_draft_window_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft-window",
        type=int,
        default=None,
        metavar="N",
        help="drafting attends to the last N context tokens only; 0: the whole context (default: the drafter's own "
        "window, from its config.json; the shipped drafter's was chosen by measurement on long prompts). Changes "
        "which drafts are proposed, never the output",
    )


def _add_grammar_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "structured output",
        "constrain the output to a grammar (llguidance); exact with respect to the target "
        "constrained to it, in speculative and plain decoding alike (token trees are not used)",
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


def _grammar_from_args(args: argparse.Namespace):
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


def _tools_from_args(args: argparse.Namespace, other_grammar: bool):
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


def _add_proposal_options(parser: argparse.ArgumentParser) -> None:
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


def _add_sampler_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sampler",
        choices=["rejection", "coupled"],
        default=None,
        help="how sampled drafts are verified, both exact: 'rejection' (speculative sampling: the most drafts "
        "accepted) or 'coupled' (Gumbel-max with noise fixed by the seed: the output is plain sampling's for "
        "that seed, whatever the drafter or block size); default: coupled with --seed, else rejection",
    )


def _add_lookup_option(parser: argparse.ArgumentParser) -> None:
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
        "instead of running the drafter (lossless; default: on when there is a drafter; --lookup without a "
        "drafter: prompt lookup alone)",
    )


def cmd_ngram_store(args: argparse.Namespace) -> int:
    import pathlib

    from dflashkit.drafter.ngram_store import FILENAME, NgramStore, find_store
    from dflashkit.errors import InvalidInputError
    from dflashkit.training.dataset import load_sequences

    if min(args.n, args.min_count, args.max_draft, 1 if args.max_entries is None else args.max_entries) < 1:
        raise InvalidInputError("--n, --min-count, --max-draft and --max-entries must be at least 1")
    out = pathlib.Path(args.out).expanduser()
    if not (out / "config.json").is_file():
        raise InvalidInputError(f"{out}: not a drafter folder (no config.json)")
    with _status(f"Reading answers from {args.data}...", False):  # distinct answers, as training counts them
        sequences = [s.input_ids[max(0, s.num_prompt - args.n) :] for s in load_sequences(args.data, sys.maxsize)]
    merges = []
    for path in args.merge:  # read first: a wrong path fails before the counting
        path = pathlib.Path(path).expanduser()
        found = find_store(path) if path.is_dir() else (path if path.is_file() else None)
        if found is None:
            raise InvalidInputError(f"--merge {path}: no n-gram store there")
        merges.append(NgramStore.load(found))
        if merges[-1].n != args.n:
            raise InvalidInputError(f"--merge {path}: a store of {merges[-1].n}-grams, not {args.n}-grams (--n)")
    with _status(f"Counting {args.n}-grams of {len(sequences)} answers...", False):
        store = NgramStore.build(sequences, n=args.n, min_count=args.min_count, max_draft=args.max_draft)
    for other in merges:
        store = store.merged(other)
    counted = len(store)
    if args.max_entries is not None:
        store = store.pruned(args.max_entries)
    vocab = json.loads((out / "config.json").read_text()).get("vocab_size")
    if isinstance(vocab, int):
        store.check_vocab(vocab)  # answers of another target: refused here, not when generate loads the store
    store.save(out / FILENAME)
    merged = f", merged with {len(merges)} store(s)" if merges else ""
    capped = f", the {len(store)} counted most often kept of {counted}" if len(store) < counted else ""
    print(
        f"{counted} {args.n}-grams (seen >= {args.min_count} times) from {len(sequences)} answers{merged}{capped} -> "
        f"{out / FILENAME}",
        file=sys.stderr,
    )
    return 0


def _add_eager_option(parser: argparse.ArgumentParser) -> None:
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


def _add_threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice, with a note where other processes keep cores busy). "
        "On a busy machine, fewer threads than cores avoids OpenMP stalls that can slow work many times over",
    )


def _target_slug(target: str | None) -> str:
    import re

    from dflashkit.target.loading import DEFAULT_TARGET

    name = DEFAULT_TARGET if target is None else str(target)
    return re.sub(r"[^A-Za-z0-9._-]+", "--", name.strip("/").replace("/", "--")) or "target"


def cmd_train(args: argparse.Namespace) -> int:
    import pathlib

    from dflashkit.errors import InvalidInputError
    from dflashkit.target.loading import cache_dir, load_target
    from dflashkit.training.dataset import data_folders
    from dflashkit.training.distributed import from_environment
    from dflashkit.training.trainer import TrainConfig, Trainer

    apply_threads(args.threads, args.device)
    data_dir = args.data if args.data else str(cache_dir() / "data" / _target_slug(args.target))
    out = pathlib.Path(args.out).expanduser() if args.out else cache_dir() / "runs" / _target_slug(args.target)
    for folder in data_folders(
        data_dir
    ):  # training reads meta.json and the shards (a packed copy may lack prompts.jsonl)
        if not (folder / "meta.json").is_file():
            raise InvalidInputError(f"{folder}: no training data; make it with `dflashkit data --out {folder}`")
    for name in ("layers", "steps", "anchors", "seqs_per_step", "grad_accum"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise InvalidInputError(f"--{name.replace('_', '-')} must be at least 1")
    try:
        layer_ids = [int(x) for x in args.target_layers.split(",")] if args.target_layers else None
    except ValueError:
        raise InvalidInputError(
            f"--target-layers takes layer indices separated by commas, e.g. 1,14,27; got {args.target_layers!r}"
        ) from None
    parallel, device = from_environment(args.device)  # under torchrun: this process's rank and device
    cfg = TrainConfig(
        data_dir=str(data_dir),
        out_dir=str(out),
        target=args.target,
        num_layers=args.layers,
        block_size=args.block_size,
        gamma=args.gamma,
        loss_weighting=args.loss_weighting,
        dpace_alpha=args.dpace_alpha,
        target_layer_ids=layer_ids,
        mask_token_id=args.mask_token_id,
        init_from_target=not args.random_init,
        init_drafter=args.init,
        anchors_per_seq=args.anchors,
        seqs_per_step=args.seqs_per_step,
        grad_accum=args.grad_accum,
        steps=args.steps,
        lr=args.lr,
        warmup_ratio=args.warmup,
        max_seq_len=args.max_seq_len,
        draft_vocab_size=args.draft_vocab or None,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        device=device,
        distill_topk=args.distill_topk,
        distill_weight=args.distill_weight,
        precision=args.precision,
        compile=args.compile,
        time_budget_s=args.time_budget,
        eval_sets=[x.strip() for x in args.eval_sets.split(",") if x.strip()] if args.eval_sets else None,
        eval_set_prompts=args.eval_set_prompts,
        cache_features=args.feature_cache == "on"
        or (args.feature_cache == "auto" and torch.device(device).type == "cpu"),
    )
    with _status("Loading target model...", False) if parallel.is_main else nullcontext(), parallel.main_first():
        model, tokenizer = load_target(args.target, dtype=torch.bfloat16, device=device)
    from tqdm import tqdm

    # messages go above the progress bar, not onto its line
    trainer = Trainer(cfg, model, tokenizer, log=lambda msg: tqdm.write(msg, file=sys.stderr), parallel=parallel)
    if parallel.is_main:
        each = f" ({parallel.world_size} processes, each its share of a step's sequences)" if parallel.enabled else ""
        depth = trainer.drafter.config.num_hidden_layers
        print(
            f"Training a {depth}-layer drafter (block {args.block_size}) on {len(trainer.train_seqs)} sequences "
            f"from {data_dir}{each}; held-out τ prompts: {len(trainer.eval_seqs)}; run folder {out}",
            file=sys.stderr,
        )
    drafter_dir = trainer.run(resume=not args.no_resume)
    parallel.close()
    if parallel.is_main:
        print(str(drafter_dir))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import pathlib

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
    with _status(f"Exporting {drafter} ({args.format})...", False):
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


@contextmanager
def _status(message: str, quiet: bool):
    """A spinner on stderr while something slow runs (model loading, conversion)."""
    if quiet or not sys.stderr.isatty():
        print(message, file=sys.stderr)
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield


def _load_generator(args: argparse.Namespace, quiet: bool):
    """The target and the drafter chosen by --target/--drafter/--dtype/--device (notes go to stderr)."""
    from dflashkit.generator import SpeculativeGenerator

    with _status("Loading target model...", quiet):
        gen = SpeculativeGenerator.load(
            args.target,
            None,
            dtype=DTYPES[args.dtype],
            device=args.device,
            quantize=args.quantize,
            fast=not args.eager,
            cuda_graphs=args.cuda_graphs,
        )
        drafter, drafter_note = _resolve_drafter(args.drafter, args.target, gen)
        if drafter is not None:
            gen = SpeculativeGenerator(
                gen.model, gen.tokenizer, drafter, fast=not args.eager, cuda_graphs=args.cuda_graphs
            )
    if drafter_note:
        print(drafter_note, file=sys.stderr)
    return gen


def cmd_generate(args: argparse.Namespace) -> int:
    from dflashkit.decoding.loop import check_draft_window
    from dflashkit.decoding.penalties import Penalties
    from dflashkit.drafter.config import check_proposal_temperature
    from dflashkit.target.logprobs import check_top_logprobs
    from dflashkit.tool_calls import parse_tool_calls

    dtype = DTYPES[args.dtype]
    check_draft_window(args.draft_window)  # before the (slow) model load
    if args.proposal_temperature is not None:
        check_proposal_temperature(args.proposal_temperature)
    check_top_logprobs(args.logprobs)
    Penalties(args.presence_penalty, args.frequency_penalty, args.repetition_penalty)  # refuses bad values early
    grammar = _grammar_from_args(args)
    prompt = _prompt_from_args(args)
    tools = _tools_from_args(args, grammar is not None)
    apply_threads(args.threads, args.device)
    gen = _load_generator(args, args.json)
    drafter = gen.drafter
    if tools is not None and tools.active:  # the template shows the tools; a forced call is a grammar
        prompt = gen.encode_prompt(prompt, tools=tools.template_tools())
        grammar = gen.tool_call_grammar(tools) or grammar

    # Without --block-size / --lookup, the library's defaults (generator.default_block_size / default_lookup):
    # the adaptive block size (the drafter's own size with --tree) and prompt lookup when there is a drafter.
    _note_tree_without_drafter(args, drafter is not None)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        block_size=args.block_size,
        proposal=args.proposal,
        proposal_temperature=args.proposal_temperature,
        sampler=args.sampler,
        stop=args.stop,
        chat=not args.no_chat,
        lookup=args.lookup,
        ngram_store=args.ngram_store,
        tree=args.tree,
        draft_window=args.draft_window,
        grammar=grammar,
        logprobs=args.logprobs,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )
    gen.warmup()
    stream = gen.stream(prompt, **kwargs)
    for delta in stream:
        if not args.json:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    result = stream.result
    _note_context_limit(result, gen.target.max_positions, args.max_new_tokens)
    if args.compare_ar:
        result = gen.compare_ar(result, prompt, **kwargs)
    logprobs = _logprobs_json(gen, result.logprobs) if result.logprobs is not None else None
    calls = parse_tool_calls(result.text, tools.names)[1] if tools is not None and tools.active else []
    if args.json:
        out = _as_json(result, args, dtype, drafter is not None)
        if logprobs is not None:
            out["logprobs"] = logprobs
        if tools is not None:
            out["tool_calls"] = [call.as_openai() for call in calls]
        print(json.dumps(out, indent=2))
    else:
        print()
        for call in calls:
            print(f"tool call: {call.name}({call.arguments})")
        _print_summary(result, drafter is not None)
        if logprobs is not None:
            _print_logprobs(logprobs)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from dflashkit.chat import ChatSession
    from dflashkit.decoding.loop import check_draft_window
    from dflashkit.decoding.prefix_cache import PrefixCache
    from dflashkit.decoding.sampling import SamplingParams

    check_draft_window(args.draft_window)  # bad values fail before the (slow) model load
    SamplingParams(args.temperature, args.top_k, args.top_p)
    cache = PrefixCache.of_mib(args.prefix_cache_mb)
    apply_threads(args.threads, args.device)
    gen = _load_generator(args, False)
    session = ChatSession(
        gen,
        args.system,
        cache if cache is not None else False,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        sampler=args.sampler,
        block_size=args.block_size,
        lookup=args.lookup,
        ngram_store=args.ngram_store,
        draft_window=args.draft_window,
    )
    gen.warmup()
    interactive = sys.stdin.isatty()
    if interactive:
        print(
            "Chat with the target (/reset: new conversation, /exit or Ctrl-D: leave, Ctrl-C: stop an answer).",
            file=sys.stderr,
        )
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            break
        if not interactive and not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            session.reset()
            print("[new conversation]", file=sys.stderr)
            continue
        try:
            for piece in session.send(text):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            print("\n[answer stopped]", file=sys.stderr)
            continue
        except DFlashError as e:
            print(f"error: {e} (/reset starts a new conversation)", file=sys.stderr)
            continue
        print()
        if args.stats and session.last is not None:
            _print_turn_stats(session.last)
    return 0


def _print_turn_stats(result) -> None:
    s = result.stats
    cached = f", {s.cached_prompt_tokens} restored" if s.cached_prompt_tokens else ""
    print(
        f"[{s.new_tokens} tokens | {s.tokens_per_s:.1f} tok/s | τ {s.tau:.2f} | prompt {s.prompt_tokens} tokens"
        f"{cached}, prefill {s.prefill_s:.2f}s]",
        file=sys.stderr,
    )


def _logprobs_json(gen, logprobs) -> list[dict[str, Any]]:
    """Each token's text and log-probability, with its alternatives (OpenAI's chat format, without bytes)."""

    def text(token_id: int) -> str:
        return gen.token_bytes(token_id).decode("utf-8", "replace")

    return [
        {
            "token": text(lp.token_id),
            "logprob": lp.logprob,
            "top_logprobs": [{"token": text(t), "logprob": v} for t, v in lp.top],
        }
        for lp in logprobs
    ]


def _print_logprobs(logprobs: list[dict[str, Any]]) -> None:
    print("log-probabilities under the target (token, logprob, alternatives):")
    for entry in logprobs:
        alternatives = ", ".join(f"{t['token']!r} {t['logprob']:.3f}" for t in entry["top_logprobs"])
        print(f"  {entry['token']!r:>16} {entry['logprob']:8.3f}" + (f"   {alternatives}" if alternatives else ""))


def cmd_serve(args: argparse.Namespace) -> int:
    from dflashkit.errors import InvalidInputError
    from dflashkit.target.loading import DEFAULT_TARGET

    try:
        import uvicorn

        from dflashkit.decoding.batching import ComputeThread
        from dflashkit.server import ServerSettings, create_app
    except ImportError as e:
        raise InvalidInputError(f"serving needs the 'serve' extra: pip install 'dflashkit[serve]' ({e})") from e
    if not 0 <= args.port <= 65535:
        raise InvalidInputError(f"--port must be in 0..65535, got {args.port}")
    settings = ServerSettings(  # checked before the (slow) model load
        model_id=args.model_name or (args.target or DEFAULT_TARGET),
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        timeout=args.timeout or None,
        default_max_tokens=args.default_max_tokens,
        block_size=args.block_size,
        lookup=args.lookup,
        proposal=args.proposal,
        proposal_temperature=args.proposal_temperature,
        sampler=args.sampler,
        tree=args.tree,
        draft_window=args.draft_window,
        prefix_cache_mb=args.prefix_cache_mb,
        stored_responses=args.stored_responses,
        api_key=args.api_key,
        clamp_max_tokens=args.clamp_max_tokens,
        allowed_origins=[o.strip() for o in args.allowed_origins.split(",") if o.strip()],
    )
    apply_threads(args.threads, args.device)
    gen = _load_generator(args, False)
    _note_tree_without_drafter(args, gen.drafter is not None)
    compute = ComputeThread()  # this thread, which loaded the model: every pass runs here (dflashkit.decoding.batching)
    app = create_app(gen, settings, compute=compute)
    gen.warmup()
    print(
        f"Serving {settings.model_id!r} at http://{args.host}:{args.port} (playground: /, API: /v1, "
        f"metrics: /metrics); up to {settings.max_batch} generations at once, {settings.max_queue} waiting"
        + ("; /v1 needs the API key" if settings.api_key is not None else ""),
        file=sys.stderr,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))

    def run_server() -> None:  # the HTTP side in a thread of its own; the main thread computes
        try:
            server.run()
        finally:
            compute.wake()

    thread = threading.Thread(target=run_server, name="dflashkit-http", daemon=True)
    thread.start()
    try:
        compute.serve(until=lambda: not thread.is_alive())
    except KeyboardInterrupt:
        print("Shutting down", file=sys.stderr)
    finally:
        server.should_exit = True
        thread.join(30)
    return 0


def _note_tree_without_drafter(args: argparse.Namespace, has_drafter: bool) -> None:
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


def _prompt_from_args(args: argparse.Namespace) -> str | list[dict[str, str]]:
    """The prompt text (- : standard input), as chat messages behind --system when one is given."""
    from dflashkit.errors import InvalidInputError

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text:
        raise InvalidInputError("the prompt is empty" + (" (nothing on standard input)" if args.prompt == "-" else ""))
    if args.system is None:
        return text
    if args.no_chat:
        raise InvalidInputError("--system needs the chat template: it cannot be combined with --no-chat")
    return [{"role": "system", "content": args.system}, {"role": "user", "content": text}]


def _chains_only(args: argparse.Namespace) -> str:
    """The generate options that rule out token trees, in words ("" if none)."""
    grammar = any(getattr(args, name, None) for name in ("json_object", "json_schema", "regex", "lark", "choice"))
    penalties = (
        getattr(args, "presence_penalty", 0.0)
        or getattr(args, "frequency_penalty", 0.0)
        or getattr(args, "repetition_penalty", 1.0) != 1.0
    )
    return " or ".join(what for what, on in (("a grammar", grammar), ("penalties", penalties)) if on)


def _note_context_limit(result, context: int, max_new_tokens: int) -> None:
    """Say so when the target's context ended the generation before --max-new-tokens."""
    room = context - result.prompt_tokens
    if result.finish_reason == "length" and len(result.token_ids) == room < max_new_tokens:
        print(
            f"note: the target's context ({context} tokens) leaves room for {room} new tokens after the "
            f"{result.prompt_tokens}-token prompt, fewer than --max-new-tokens {max_new_tokens}.",
            file=sys.stderr,
        )


def _resolve_drafter(choice: str | None, target: str | None, gen) -> tuple[Any, str | None]:
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.drafter.identity import drafter_config_for
    from dflashkit.drafter.network import DFlashDrafter
    from dflashkit.drafter.registry import shipped_drafter

    if choice == "none":
        return None, "Plain autoregressive decoding (--drafter none)."
    if choice == "untrained":
        torch.manual_seed(0)
        drafter = DFlashDrafter(drafter_config_for(gen.model, num_layers=3)).to(gen.model.dtype)
        return drafter, "Using an UNTRAINED random drafter: it exercises the speculative path; expect τ ≈ 1."
    if choice is None:
        path = shipped_drafter(target)
        if path is None:
            return None, (
                "No trained drafter ships for this target yet: decoding autoregressively (τ = 1). "
                "Pass --drafter PATH, or --drafter untrained to exercise the speculative path."
            )
        choice = str(path)
    return load_drafter(choice, dtype=gen.model.dtype, device=gen.model.device), None


def _phase_times(stats) -> dict[str, float]:
    return {"prefill": stats.prefill_s, "draft": stats.draft_s, "verify": stats.verify_s, "other": stats.other_s}


def _as_json(result, args, dtype: torch.dtype, speculative: bool) -> dict[str, Any]:
    s = result.stats
    out: dict[str, Any] = {
        "text": result.text,
        "new_tokens": s.new_tokens,
        "tau": s.tau,
        "tokens_per_s": s.tokens_per_s,
        "dtype": str(dtype).removeprefix("torch."),
        "target_weights": s.target_weights,
        "engine": result.stats.engine,
        "block_size": s.block_size,
        "speculative": speculative,
        "finish_reason": result.finish_reason,
        "time_s": _phase_times(s),
        "stats": s.as_dict(),
    }
    if result.ar is not None:
        out.update(
            ar_text=result.ar.text,
            ar_tokens_per_s=result.ar.stats.tokens_per_s,
            identical=result.identical,
            speedup=result.speedup,
            divergence=result.divergence.as_dict() if result.divergence else None,
        )
    return out


def _print_summary(result, speculative: bool) -> None:
    from dflashkit.kernels.int8 import is_quantized

    s = result.stats
    t = _phase_times(s)
    line = (
        f"[{s.new_tokens} tokens | {s.tokens_per_s:.1f} tok/s | τ {s.tau:.2f} | "
        f"block {'≤' if s.adaptive else ''}{s.block_size} | "
        f"prefill {t['prefill']:.2f}s draft {t['draft']:.2f}s verify {t['verify']:.2f}s other {t['other']:.2f}s]"
    )
    if s.lookup:
        lk = s.lookup_summary()
        line += (
            f" (prompt lookup: {lk['copied_steps']} of {s.steps} steps copied"
            + (f", τ {lk['copied_tau']:.2f} on those" if lk["copied_steps"] else "")
            + (f"; {lk['store_steps']} of them from the n-gram store" if lk["store_steps"] else "")
            + ")"
        )
    elif not speculative:
        line += " (autoregressive)"
    if s.tree:
        tr = s.tree_summary()
        line += (
            f" (token trees of up to {tr['budget']} nodes: {tr['tree_steps']} steps"
            + (f", {tr['mean_nodes']:.1f} nodes and τ {tr['tree_tau']:.2f} on those" if tr["tree_steps"] else "")
            + ")"
        )
    if is_quantized(s.target_weights):
        line += f" (target: {s.target_weights}; exact w.r.t. the quantized target)"
    if s.grammar:
        line += f" (structured output: {s.grammar.replace('_', ' ')})"
    if s.sampler:
        line += f" ({s.sampler} sampling)"
    print(line, file=sys.stderr)
    if result.ar is not None:
        ar = result.ar.stats
        print(
            f"[plain decoding: {ar.tokens_per_s:.1f} tok/s | speedup {result.speedup:.2f}x (decode time per token)]",
            file=sys.stderr,
        )
        if result.identical:
            print("[outputs identical to plain decoding]", file=sys.stderr)
        elif result.divergence is not None:
            d = result.divergence
            kind = "a numerical tie (allowed in bf16)" if d.tie else "NOT a tie: this is a bug, please report it"
            print(
                f"[outputs differ from token {d.index}: speculative {d.spec_token} vs plain {d.ar_token}, "
                f"margin {d.margin} at max |logit| {d.max_abs_logit}: {kind}]",
                file=sys.stderr,
            )
        else:
            print(
                "[outputs differ: rejection sampling draws its own random numbers per step; give --seed (coupled "
                "sampling) to compare sampled outputs token for token]",
                file=sys.stderr,
            )


def cmd_data(args: argparse.Namespace) -> int:
    from dflashkit.target import loading as models
    from dflashkit.training import sources as data
    from dflashkit.training.distributed import from_environment

    if args.num_prompts < 1:
        raise data.InvalidInputError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    sources = data.parse_sources(args.sources)  # fail early on a bad --sources
    apply_threads(args.threads, args.device)
    parallel, device = from_environment(args.device)  # under torchrun: each process generates its share of shards
    if args.server and args.engine != "auto":
        raise data.InvalidInputError("--engine chooses how a local target answers: drop it with --server")
    if args.batch_size is None:  # a GPU's step costs about the same for 64 rows as for 1,024 (generate_static)
        args.batch_size = 1024 if torch.device(device).type == "cuda" and not args.server else 64
    quiet = args.no_progress or not parallel.is_main
    name = models.DEFAULT_TARGET if args.target is None else str(args.target)
    if args.out is None:
        out = models.cache_dir() / "data" / _target_slug(args.target)
    else:
        out = pathlib.Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise data.InvalidInputError(f"the output {out} is a file, not a folder: choose another --out")
    collection_args = {
        "sources": args.sources,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        "min_chars": args.min_chars,
        "max_chars": args.max_chars,
        "exclude_eval": not args.no_eval_exclusion,
    }
    meta_file = out / "meta.json"
    report = None
    # the first process collects (or checks) the prompt list; the others' regenerate() reads it from the folder
    resuming = (out / "prompts.jsonl").is_file() and meta_file.is_file()
    if parallel.is_main and resuming:
        # Resume with the stored prompt list (collection is deterministic, but a Hugging Face source or an
        # edited JSONL file could change under us).
        stored = json.loads(meta_file.read_text(encoding="utf-8")).get("extra", {}).get("collection", {})
        changed = {k: (stored.get(k), v) for k, v in collection_args.items() if stored.get(k) != v}
        if changed:
            detail = "; ".join(
                f"--{k.replace('_', '-')} {new!r} (data made with {old!r})" for k, (old, new) in changed.items()
            )
            raise data.DataError(f"cannot resume {out}: {detail}. Use another --out, or the same options.")
        print(f"Resuming {out} with its stored prompt list.", file=sys.stderr)
    collect = parallel.is_main and not resuming
    magpie = any(source.kind in data.MAGPIE_SYSTEMS for source in sources)
    if collect and not magpie:  # before loading the target: a bad source fails fast
        report = _collect_data_prompts(args)
    model, tokenizer, server = _data_target(args, parallel, device)
    answerer = None
    if collect and magpie:  # the target writes some of the prompts
        answerer = data.Answerer.for_target(
            model, tokenizer, engine=args.engine, batch_size=args.batch_size, server=server
        )
        report = _collect_data_prompts(
            args,
            lambda seed, budget, system: data.magpie_prompts(
                answerer,
                tokenizer,
                seed=seed,
                budget=budget,
                system=system,
                progress=not quiet,
                rounds_file=out / "magpie-requests" / f"seed-{seed}.jsonl",
            ),
        )  # a killed collection resumes
    prompts = report.prompts if report is not None else None
    extra = {"target_name": name, "collection": collection_args}
    if report is not None:
        extra["collection_report"] = report.as_dict()
    summary = data.regenerate(
        model,
        tokenizer,
        prompts,
        out,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        shard_size=args.shard_size,
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
        progress=not quiet,
        extra_meta=extra,
        parallel=parallel,
        server=server,
        engine=args.engine,
        answerer=answerer,
    )
    parallel.close()
    if not parallel.is_main:
        return 0
    if report is None:
        stored = json.loads(meta_file.read_text(encoding="utf-8")).get("extra", {}).get("collection_report")
        excluded = sum((stored or {}).get("excluded_as_eval", {}).values())
        checked = ", ".join((stored or {}).get("eval_sets_checked", {})) or "none"
    else:
        excluded, checked = sum(report.excluded.values()), ", ".join(report.eval_sets) or "none"
    s = summary
    print(
        f"[{s['written']} of {s['num_prompts']} prompts answered ({s['skipped_too_long']} longer than "
        f"{args.max_prompt_tokens} tokens skipped) | {s['response_tokens']} response tokens | "
        f"{100 * s['finished_fraction']:.0f}% ended with eos | this run: {s['shards_generated']} shard(s), "
        f"{s['run_response_tokens']} tokens in {s['run_seconds']:.1f}s, {s['run_tokens_per_s']:.1f} tok/s"
        + (f" over {s['processes']} processes" if s["processes"] > 1 else "")
        + " | "
        f"evaluation prompts excluded: {excluded} (checked: {checked})"
        + (
            ""
            if server is None or server.token_ids is not False
            else " | the server gave no token ids: answers re-encoded from their text"
        )
        + "]",
        file=sys.stderr,
    )
    print(str(out))
    return 0


def _collect_data_prompts(args: argparse.Namespace, magpie=None):
    """`dflashkit data`'s prompt list, reported on stderr (``magpie``: the target's own requests, with a progress
    bar of their own)."""
    from dflashkit.training import sources as data

    with _status(f"Collecting {args.num_prompts} prompts from {args.sources}...", args.no_progress or bool(magpie)):
        report = data.collect_prompts(
            args.sources,
            args.num_prompts,
            args.seed,
            min_chars=args.min_chars,
            max_chars=args.max_chars,
            exclude_eval=not args.no_eval_exclusion,
            magpie=magpie,
        )
    _print_collection(report)
    if not report.prompts:
        raise data.DataError(f"no prompts collected from {args.sources!r}")
    return report


def _data_target(args: argparse.Namespace, parallel, device):
    """(model, tokenizer, server) of `dflashkit data`: the local target, or a server that serves it."""
    from dflashkit.target import loading as models

    if args.server:
        from dflashkit.training.data_server import ServerTarget

        with parallel.main_first():
            config, tokenizer, eos_ids = models.load_target_config(args.target)
        server = ServerTarget.connect(
            args.server,
            tokenizer,
            config,
            eos_ids,
            model=args.server_model,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
            concurrency=args.batch_size,
        )
        if parallel.is_main:
            print(f"Answers from {server.model} at {args.server}.", file=sys.stderr)
        return None, tokenizer, server
    with (
        _status("Loading target model...", args.no_progress) if parallel.is_main else nullcontext(),
        parallel.main_first(),
    ):
        model, tokenizer = models.load_target(args.target, dtype=DTYPES[args.dtype], device=device)
    return model, tokenizer, None


def _print_collection(report) -> None:
    sources = ", ".join(f"{k} {v}" for k, v in report.per_source.items())
    checked = ", ".join(f"{k} ({v})" for k, v in report.eval_sets.items()) or "none installed"
    dropped = ", ".join(f"{k} {v}" for k, v in report.excluded.items() if v) or "none"
    print(
        f"Collected {len(report)} prompts ({sources}); {report.duplicates} duplicates dropped; evaluation sets "
        f"checked: {checked}; dropped as evaluation prompts: {dropped}.",
        file=sys.stderr,
    )
    if len(report) < report.requested:
        print(
            f"warning: only {len(report)} of {report.requested} prompts available from these sources.", file=sys.stderr
        )


if __name__ == "__main__":
    sys.exit(main())
