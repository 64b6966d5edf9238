"""Command line: `dflashkit generate PROMPT` streams a speculative generation and prints its statistics."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from typing import Any

import torch

from .errors import DFlashError

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflashkit", description="Lossless speculative decoding with DFlash drafters.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for a prompt (streams; prints τ and tok/s)")
    g.add_argument("prompt", help="prompt text (sent through the chat template unless --no-chat)")
    g.add_argument("--target", default=None, help="HF model id or local folder (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument(
        "--drafter",
        default=None,
        help="drafter folder; 'none' for plain decoding; 'untrained' for a random drafter (exercises the "
        "speculative path, τ≈1); default: the drafter shipped for the target, if any",
    )
    g.add_argument("--block-size", type=int, default=None, help="verify block size (default: the drafter's)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--proposal", choices=["argmax", "sample"], default="argmax", help="how drafts are proposed (both exact)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-chat", action="store_true", help="send the prompt as raw text, without the chat template")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    g.add_argument("--device", default="cpu")
    g.add_argument("--compare-ar", action="store_true", help="also decode plainly; print speedup and whether outputs match")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)
    return parser


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


def cmd_generate(args: argparse.Namespace) -> int:
    from .generator import SpeculativeGenerator

    dtype = DTYPES[args.dtype]
    with _status("Loading target model...", args.json):
        gen = SpeculativeGenerator.load(args.target, None, dtype=dtype, device=args.device)
        drafter, drafter_note = _resolve_drafter(args.drafter, args.target, gen)
        if drafter is not None:
            gen = SpeculativeGenerator(gen.model, gen.tokenizer, drafter)
    if drafter_note:
        print(drafter_note, file=sys.stderr)

    kwargs: dict[str, Any] = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, block_size=args.block_size, proposal=args.proposal, stop=args.stop, chat=not args.no_chat,
    )  # fmt: skip
    gen.warmup()
    stream = gen.stream(args.prompt, **kwargs)
    for delta in stream:
        if not args.json:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    result = stream.result
    if args.compare_ar:
        result = gen.compare_ar(result, args.prompt, **kwargs)
    if args.json:
        print(json.dumps(_as_json(result, args, dtype, drafter is not None), indent=2))
    else:
        print()
        _print_summary(result, drafter is not None)
    return 0


def _resolve_drafter(choice: str | None, target: str | None, gen) -> tuple[Any, str | None]:
    from .checkpoint import load_drafter
    from .drafter import DFlashDrafter
    from .identity import drafter_config_for
    from .registry import shipped_drafter

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
    s = result.stats
    t = _phase_times(s)
    line = (
        f"[{s.new_tokens} tokens | {s.tokens_per_s:.1f} tok/s | τ {s.tau:.2f} | block {s.block_size} | "
        f"prefill {t['prefill']:.2f}s draft {t['draft']:.2f}s verify {t['verify']:.2f}s other {t['other']:.2f}s]"
    )
    if not speculative:
        line += " (autoregressive)"
    print(line, file=sys.stderr)
    if result.ar is not None:
        ar = result.ar.stats
        print(f"[plain decoding: {ar.tokens_per_s:.1f} tok/s | speedup {result.speedup:.2f}x (decode time per token)]", file=sys.stderr)
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
            print("[outputs differ (sampling: compare distributions, not tokens)]", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
