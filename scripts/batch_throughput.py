"""Throughput of batched generation (generate_batch) against one generation at a time, in one process, interleaved.

    .venv/bin/python scripts/batch_throughput.py [--batch 1,2,4] [--rounds 2] [--max-new-tokens 96] [--threads 2]

For each batch size C and round: C prompts (MT-Bench / HumanEval / MATH-500 first turns, in turn) generated
one after another with `generate`, then together with `generate_batch`, both plain and speculative (the shipped
drafter with the CLI's defaults: adaptive block size, prompt lookup), greedy; the order of the four runs rotates per
round. Prints, per C and mode, completion tokens per second of wall time over the whole set (prefills
included; medians over rounds), the batched / one-at-a-time ratio, and whether every batched output equals the
one-at-a-time output of its prompt.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from dflashkit import SpeculativeGenerator
from dflashkit.training.evalsets import load_set

SETS = ("mt-bench", "humaneval", "math500")


def prompts(count: int) -> list[str]:
    pools = [load_set(name, limit=-(-count // len(SETS))) for name in SETS]
    return [prompt for group in zip(*pools) for prompt in group][:count]  # one of each set in turn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,2,4", help="batch sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.batch.split(",")]
    gen = SpeculativeGenerator.load()
    gen.warmup()
    pool = prompts(max(sizes) * args.rounds)
    modes = {"plain": {"use_drafter": False}, "speculative": {"block_size": "auto", "lookup": True}}
    rate: dict[tuple[int, str, bool], list[float]] = {}
    same: dict[tuple[int, str], list[bool]] = {}
    for c in sizes:
        for r in range(args.rounds):
            batch = pool[r * c : (r + 1) * c] if len(pool) >= (r + 1) * c else pool[:c]
            runs = list(itertools.product(modes, (False, True)))
            runs = runs[r % len(runs) :] + runs[: r % len(runs)]
            outputs: dict[tuple[str, bool], list[list[int]]] = {}
            for mode, batched in runs:
                kwargs = dict(max_new_tokens=args.max_new_tokens, **modes[mode])
                t0 = time.perf_counter()
                if batched:
                    results = gen.generate_batch(batch, **kwargs)
                else:
                    results = [gen.generate(p, **kwargs) for p in batch]
                wall = time.perf_counter() - t0
                rate.setdefault((c, mode, batched), []).append(sum(len(x.token_ids) for x in results) / wall)
                outputs[(mode, batched)] = [x.token_ids for x in results]
            for mode in modes:
                same.setdefault((c, mode), []).extend(
                    a == b for a, b in zip(outputs[(mode, True)], outputs[(mode, False)])
                )
            print(
                f"batch {c} round {r}: "
                + ", ".join(f"{m}{' batched' if b else ''} {rate[(c, m, b)][-1]:.1f}" for m, b in runs),
                flush=True,
            )
    print(
        f"\n{args.rounds} rounds per batch size, {args.max_new_tokens} new tokens per prompt, greedy, "
        f"{args.threads} threads; completion tokens / wall time over the set, prefills included (medians)"
    )
    print("| batch | mode | one at a time tok/s | batched tok/s | batched / one at a time | identical |")
    print("|---:|---|---:|---:|---:|---|")
    for c in sizes:
        for mode in modes:
            one, many = statistics.median(rate[(c, mode, False)]), statistics.median(rate[(c, mode, True)])
            print(
                f"| {c} | {mode} | {one:.1f} | {many:.1f} | {many / one:.2f}x | "
                f"{sum(same[(c, mode)])}/{len(same[(c, mode)])} |"
            )


if __name__ == "__main__":
    main()
