"""What log-probabilities and penalties cost, speculative and plain decoding interleaved in one process.

    .venv/bin/python scripts/options_speed.py [--rounds 2] [--max-new-tokens 96] [--threads 2]

For each prompt and round, with the shipped drafter and the CLI's defaults (adaptive block size, prompt lookup)
and with plain decoding, greedy: no options; `logprobs=5`; penalties (frequency 0.5, presence 0.3, repetition
1.1). Prints decoding tokens/s (after the prefill; medians), the speculative/plain ratio per case (median of the
per-prompt ratios), τ, and whether every speculative output equals the plain one under the same options.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflashkit import SpeculativeGenerator

PROMPTS = [
    "Write a short poem about rain.",
    "Explain what a prime number is.",
    "List three uses of copper.",
    "Write a Python function that reverses a string.",
]
CASES = {
    "no options": {},
    "logprobs=5": {"logprobs": 5},
    "penalties (f 0.5, p 0.3, r 1.1)": {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load()
    gen.warmup()
    rate: dict[tuple[str, bool], list[float]] = {(c, s): [] for c in CASES for s in (True, False)}
    taus: dict[str, list[float]] = {c: [] for c in CASES}
    same: dict[str, list[bool]] = {c: [] for c in CASES}
    for r in range(args.rounds):
        for prompt in PROMPTS:
            for case, options in CASES.items():
                outputs = {}
                for speculative in (True, False) if r % 2 == 0 else (False, True):
                    result = gen.generate(
                        prompt,
                        max_new_tokens=args.max_new_tokens,
                        use_drafter=speculative,
                        block_size="auto" if speculative else None,
                        lookup=speculative,
                        **options,
                    )
                    s = result.stats
                    rate[(case, speculative)].append((s.new_tokens - 1) / s.decode_s)
                    outputs[speculative] = result.token_ids
                    if speculative:
                        taus[case].append(s.tau)
                same[case].append(outputs[True] == outputs[False])
    print(
        f"{len(PROMPTS)} prompts x {args.rounds} rounds, {args.max_new_tokens} new tokens, greedy, "
        f"{args.threads} threads; decoding tok/s after the prefill (medians)"
    )
    print("| options | speculative tok/s | plain tok/s | speculative / plain | τ | identical |")
    print("|---|---:|---:|---:|---:|---|")
    for case in CASES:
        ratios = [a / b for a, b in zip(rate[(case, True)], rate[(case, False)])]
        print(
            f"| {case} | {statistics.median(rate[(case, True)]):.1f} | {statistics.median(rate[(case, False)]):.1f} | "
            f"{statistics.median(ratios):.2f}x | {statistics.mean(taus[case]):.2f} | "
            f"{sum(same[case])}/{len(same[case])} |"
        )


if __name__ == "__main__":
    main()
