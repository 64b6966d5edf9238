"""`dflashkit generate` (one prompt, streamed, with its statistics) and `dflashkit chat` (a multi-turn conversation
in the terminal)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from dflashkit.cli.common import (
    DRAFTER_HELP,
    DTYPES,
    TARGET_HELP,
    add_block_size_option,
    add_draft_window_option,
    add_dtype_device_options,
    add_eager_option,
    add_grammar_options,
    add_lookup_option,
    add_proposal_options,
    add_quantize_option,
    add_sampler_option,
    add_threads_option,
    add_tree_option,
    drafter_arg,
    grammar_from_args,
    int_at_least,
    load_generator,
    note_tree_without_drafter,
    temperature_arg,
    tools_from_args,
    top_p_arg,
)
from dflashkit.cpuload import apply_threads
from dflashkit.errors import DFlashError

if TYPE_CHECKING:
    import torch

    from dflashkit.decoding.stats import DecodeStats
    from dflashkit.generator import GenerationResult

# an adaptive run that decoded at least this share of its steps plainly (block 1) says so in one line
MOSTLY_PLAIN, MOSTLY_PLAIN_MIN_STEPS = 0.8, 8


def add_sampling_options(parser: argparse.ArgumentParser, max_new_tokens: int, per: str) -> None:
    """--block-size, --max-new-tokens and the sampling options, as generate and chat take them."""
    add_block_size_option(parser)
    parser.add_argument(
        "--max-new-tokens",
        type=int_at_least(1),
        default=max_new_tokens,
        metavar="N",
        help=f"the most tokens to generate{per}; the text may end sooner",
    )
    parser.add_argument(
        "--temperature",
        type=temperature_arg,
        default=0.0,
        metavar="T",
        help="sampling temperature; 0: greedy (the target's likeliest token every time)",
    )
    parser.add_argument(
        "--top-k",
        type=int_at_least(0, " (0: off)"),
        default=0,
        metavar="K",
        help="when sampling, draw from the K likeliest tokens only (0: off)",
    )
    parser.add_argument(
        "--top-p",
        type=top_p_arg,
        default=1.0,
        metavar="P",
        help="when sampling, draw from the likeliest tokens that together hold probability P (1: off)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="N",
        help="random seed of sampling: the same seed gives the same output (default: a new one each run; with a "
        "seed the coupled sampler is the default)",
    )


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add the `generate` and `chat` subcommands."""
    g = subparsers.add_parser(
        "generate",
        help="generate text for a prompt (streams; prints τ and tok/s)",
        description="Stream the target's answer to a prompt, decoded speculatively with the drafter, then one line "
        "of statistics on standard error: tokens, time, tokens/s and τ (tokens per target pass). --compare-ar also "
        "decodes plainly and says whether the outputs are identical; --json prints one JSON object instead.",
    )
    g.add_argument(
        "prompt", help="prompt text (sent through the chat template unless --no-chat); - reads it from standard input"
    )
    g.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="a system message before the prompt (chat template; default: none)",
    )
    g.add_argument("--target", default=None, help=TARGET_HELP)
    g.add_argument("--drafter", type=drafter_arg, default=None, help=DRAFTER_HELP)
    add_sampling_options(g, 128, "")
    add_proposal_options(g)
    add_sampler_option(g)
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
    add_lookup_option(g)
    add_tree_option(g)
    add_draft_window_option(g)
    add_grammar_options(g)
    t = g.add_argument_group(
        "tool calling",
        "offer functions to a target whose chat template writes <tool_call> "
        "blocks (Qwen2.5, Qwen3, Hermes); the calls are printed after the text",
    )
    t.add_argument(
        "--tools",
        metavar="TOOLS",
        help="OpenAI function tools: a JSON file, or the JSON text of the list (default: none)",
    )
    t.add_argument(
        "--tool-choice",
        default=None,
        metavar="CHOICE",
        help="auto (default), none, required, or a tool's name (required and a name force a call)",
    )
    g.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable; default: none)"
    )
    g.add_argument("--no-chat", action="store_true", help="send the prompt as raw text, without the chat template")
    add_dtype_device_options(g)
    add_quantize_option(g)
    add_eager_option(g)
    add_threads_option(g)
    g.add_argument(
        "--compare-ar", action="store_true", help="also decode plainly; print speedup and whether outputs match"
    )
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also print the detailed stats line: block size, time per phase (prefill, draft, verify, other), "
        "prompt lookup, token trees, sampler",
    )
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="also print each token's log-probability under the target and its K likeliest "
        "alternatives (0-20; in --json: a 'logprobs' list; default: none)",
    )
    g.set_defaults(func=cmd_generate)

    c = subparsers.add_parser(
        "chat",
        help="chat in the terminal: multi-turn, streamed, each turn prefilling only what is new",
        description="A conversation through the target's chat template: type a message, read the answer as it "
        "streams, with its stats. Each turn restores what the previous one computed (a prefix cache), so it costs "
        "its new message and its answer, not the history. /reset starts over, /exit (or end of input) leaves; "
        "Ctrl-C stops an answer. Reads one message per line from standard input when it is not a terminal.",
    )
    c.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="a system message at the start of the conversation (default: none)",
    )
    c.add_argument("--target", default=None, help=TARGET_HELP)
    c.add_argument("--drafter", type=drafter_arg, default=None, help=DRAFTER_HELP)
    add_sampling_options(c, 512, " per answer")
    add_sampler_option(c)
    add_lookup_option(c)
    add_draft_window_option(c)
    c.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=256.0,
        help="MiB of earlier turns kept for reuse (default: %(default)s; 0: every turn prefills it all)",
    )
    c.add_argument("--no-stats", dest="stats", action="store_false", help="no stats line after each answer")
    add_dtype_device_options(c)
    add_quantize_option(c)
    add_eager_option(c)
    add_threads_option(c)
    c.set_defaults(func=cmd_chat)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = _prompt_from_args(args)  # an empty prompt is refused at once, before torch is imported

    from dflashkit.decoding.options import check_draft_window
    from dflashkit.decoding.penalties import Penalties
    from dflashkit.drafter.config import check_proposal_temperature
    from dflashkit.target.logprobs import check_top_logprobs
    from dflashkit.tool_calls import parse_tool_calls

    check_draft_window(args.draft_window)  # before the (slow) model load
    if args.proposal_temperature is not None:
        check_proposal_temperature(args.proposal_temperature)
    check_top_logprobs(args.logprobs)
    Penalties(args.presence_penalty, args.frequency_penalty, args.repetition_penalty)  # refuses bad values early
    grammar = grammar_from_args(args)
    tools = tools_from_args(args, grammar is not None)
    apply_threads(args.threads, args.device)
    gen = load_generator(args, args.json)
    drafter = gen.drafter
    if tools is not None and tools.active:  # the template shows the tools; a forced call is a grammar
        prompt = gen.encode_prompt(prompt, tools=tools.template_tools())
        grammar = gen.tool_call_grammar(tools) or grammar

    # Without --block-size / --lookup, the library's defaults (default_block_size / generator.uses_lookup): the
    # adaptive block size (the drafter's own size with --tree) and prompt lookup, with the drafter, or alone where no
    # drafter ships for the target (not with --drafter none).
    note_tree_without_drafter(args, drafter is not None)
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
        out = _as_json(result, args, DTYPES[args.dtype], drafter is not None)
        if logprobs is not None:
            out["logprobs"] = logprobs
        if tools is not None:
            out["tool_calls"] = [call.as_openai() for call in calls]
        print(json.dumps(out, indent=2))
    else:
        print()
        for call in calls:
            print(f"tool call: {call.name}({call.arguments})")
        for line in summary_lines(result, drafter is not None, args.max_new_tokens, gen.target.max_positions):
            print(line, file=sys.stderr)
        if args.verbose:
            print(_detail_line(result, drafter is not None), file=sys.stderr)
        if logprobs is not None:
            _print_logprobs(logprobs)
    return 0


def _prompt_from_args(args: argparse.Namespace) -> str | list[dict[str, str]]:
    """The prompt text (- : standard input), as chat messages behind --system when one is given."""
    from dflashkit.errors import InvalidInputError

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text.strip():
        where = " (nothing on standard input)" if args.prompt == "-" else ""
        raise InvalidInputError(f"the prompt is empty{where}: give the text to answer")
    if args.system is None:
        return text
    if args.no_chat:
        raise InvalidInputError("--system needs the chat template: it cannot be combined with --no-chat")
    return [{"role": "system", "content": args.system}, {"role": "user", "content": text}]


def _note_context_limit(result, context: int, max_new_tokens: int) -> None:
    """Say so when the target's context ended the generation before --max-new-tokens."""
    room = context - result.prompt_tokens
    if result.finish_reason == "length" and len(result.token_ids) == room < max_new_tokens:
        print(
            f"note: the target's context ({context} tokens) leaves room for {room} new tokens after the "
            f"{result.prompt_tokens}-token prompt, fewer than --max-new-tokens {max_new_tokens}.",
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


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.1f}"


def stats_line(stats: DecodeStats, speculative: bool) -> str:
    """The figures a generate run and a chat turn report, as "N tokens in T s, R tok/s · τ X tokens per target pass"
    (plain decoding says so instead of τ)."""
    s = stats
    line = f"{s.new_tokens} tokens in {s.prefill_s + s.decode_s:.2f} s, {_rate(s.tokens_per_s)} tok/s"
    if speculative or s.lookup:
        return line + f" · τ {s.tau:.2f} tokens per target pass"
    return line + " · plain decoding (no drafter)"


def ending(result: GenerationResult, max_new_tokens: int, context: int) -> str:
    """Why the output ended, in words: its end of text, a stop string, --max-new-tokens or the target's context."""
    if result.finish_reason == "length":
        if len(result.token_ids) < max_new_tokens and result.prompt_tokens + len(result.token_ids) >= context:
            return f"stopped at the target's context ({context} tokens)"
        return f"stopped at --max-new-tokens {max_new_tokens}"
    if result.finish_reason == "stop":
        return f"stopped at {result.stop_string!r}" if result.stop_string else "ended at end of text"
    return ""


def mostly_plain_note(stats: DecodeStats, speculative: bool) -> str | None:
    """One line when the adaptive block size decoded (nearly) every step plainly: drafting did not pay here."""
    if not (speculative and stats.adaptive and stats.steps >= MOSTLY_PLAIN_MIN_STEPS):
        return None
    plain = sum(1 for drafted in stats.drafted_lengths if drafted == 0)
    if plain < MOSTLY_PLAIN * stats.steps:
        return None
    return (
        f"note: {plain} of {stats.steps} steps were decoded plainly: the adaptive block size found that drafting "
        "did not pay on this machine (on a busy or slow CPU a draft can cost more than it saves; --block-size N "
        "drafts every step)"
    )


def summary_lines(result: GenerationResult, speculative: bool, max_new_tokens: int, context: int) -> list[str]:
    """The lines generate prints on standard error after the text: the stats line and why the text ended, the
    comparison with plain decoding (--compare-ar), and notes (a quantized target, drafting that did not pay)."""
    from dflashkit.kernels.quantize import is_quantized

    s = result.stats
    lines = [" · ".join(part for part in (stats_line(s, speculative), ending(result, max_new_tokens, context)) if part)]
    if result.ar is not None:
        lines.append(_comparison(result, speculative or bool(s.lookup)))
    if is_quantized(s.target_weights):
        lines.append(f"note: target weights {s.target_weights}: exact w.r.t. the quantized target, not the --dtype one")
    note = mostly_plain_note(s, speculative)
    if note:
        lines.append(note)
    return lines


def _comparison(result: GenerationResult, speculative: bool = True) -> str:
    """The --compare-ar line, "plain decoding R tok/s vs speculative S tok/s after the prompt → Nx faster, identical
    output": both rates leave the prompt's prefill out, so that their ratio is the speedup shown. Without a drafter
    or prompt lookup both runs decode plainly, and the line says so instead of calling their spread a speedup."""
    spec, plain, speedup = result.stats.decode_tokens_per_s, result.ar.stats.decode_tokens_per_s, result.speedup
    if not speculative and spec is not None and plain is not None:
        line = f"both runs decode plainly (no drafter, no prompt lookup): {_rate(plain)} and {_rate(spec)} tok/s"
    elif spec is None or plain is None or speedup is None:
        line = f"plain decoding {_rate(result.ar.stats.tokens_per_s)} tok/s"
    else:
        faster = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
        line = f"plain decoding {_rate(plain)} tok/s vs speculative {_rate(spec)} tok/s after the prompt → {faster}"
    if result.identical:
        return line + ", identical output"
    if result.divergence is not None:
        d = result.divergence
        kind = "a numerical tie (allowed in bf16)" if d.tie else "NOT a tie: this is a bug, please report it"
        return (
            line + f"; outputs differ from token {d.index}: speculative {d.spec_token} vs plain {d.ar_token}, "
            f"margin {d.margin} at max |logit| {d.max_abs_logit}: {kind}"
        )
    return (
        line + "; outputs not compared: rejection sampling draws its own random numbers per step (give --seed, "
        "the coupled sampler, to compare sampled outputs token for token)"
    )


def _detail_line(result: GenerationResult, speculative: bool) -> str:
    """The detailed stats line of --verbose: block size, time per phase, prompt lookup, trees, weights, sampler."""
    from dflashkit.kernels.quantize import is_quantized

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
    return line


def cmd_chat(args: argparse.Namespace) -> int:
    from dflashkit.chat import ChatSession
    from dflashkit.decoding.options import check_draft_window
    from dflashkit.decoding.prefix_cache import PrefixCache
    from dflashkit.decoding.sampling import SamplingParams

    check_draft_window(args.draft_window)  # bad values fail before the (slow) model load
    SamplingParams(args.temperature, args.top_k, args.top_p)
    cache = PrefixCache.of_mib(args.prefix_cache_mb)
    apply_threads(args.threads, args.device)
    gen = load_generator(args, False)
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
            _print_turn_stats(session.last, gen.drafter is not None, args.max_new_tokens, gen.target.max_positions)
    return 0


def _print_turn_stats(result: GenerationResult, speculative: bool, max_new_tokens: int, context: int) -> None:
    """A chat turn's stats, in generate's words, with how much of the prompt a previous turn had computed."""
    s = result.stats
    restored = f", {s.cached_prompt_tokens} restored from earlier turns" if s.cached_prompt_tokens else ""
    parts = [stats_line(s, speculative), f"prompt {s.prompt_tokens} tokens{restored}"]
    if result.finish_reason == "length":
        parts.append(ending(result, max_new_tokens, context))
    print("[" + " · ".join(parts) + "]", file=sys.stderr)
