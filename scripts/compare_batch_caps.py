"""Batched generation's block caps, measured: generate_batch tok/s over plain batched decoding, per cap and batch size.

    .venv/bin/python scripts/compare_batch_caps.py [--batch 2,4,8] [--caps 16,8,4,2,rule] [--rounds 6]
        [--max-new-tokens 96] [--threads 2]

For each batch size C: C prompts (MT-Bench / HumanEval / MATH-500 first turns in turn, a different group each round)
generated together with `generate_batch`, plain (no drafter) and speculative with the CLI's defaults (drafter,
adaptive block size, prompt lookup) under each block cap for the batch's members: a number fixes the cap
(``BlockPolicies(batch_rows=cap * C)``), ``rule`` is the library's default
(:data:`dflashkit.decoding.adaptive.BATCH_ROWS`
rows per pass). The runs of a round go in a rotating order; each cap keeps its own policies across rounds, as a
server's would. Prints, per C and cap, the median tok/s (completion tokens over wall time, prefills included) and
the median per-round ratio to plain batched decoding.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from batch_throughput import prompts  # scripts/ is on the path when this runs as a script

from dflashkit import SpeculativeGenerator
from dflashkit.decoding.adaptive import BATCH_ROWS, BlockPolicies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="2,4,8")
    ap.add_argument("--caps", default="16,8,4,2,rule")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.batch.split(",")]
    caps = [c.strip() for c in args.caps.split(",")]
    gen = SpeculativeGenerator.load()
    pool = prompts(2 * max(sizes))
    gen.generate_batch(pool[:2], max_new_tokens=16)  # warm-up: kernels, caches
    print(
        f"{args.rounds} rounds, {args.max_new_tokens} new tokens per prompt, greedy, {args.threads} threads\n"
        "| batch | run | tok/s | over plain batched |\n|---:|---|---:|---:|"
    )
    for size in sizes:
        policies = {
            c: BlockPolicies(gen.drafter.block_size, batch_rows=BATCH_ROWS if c == "rule" else int(c) * size)
            for c in caps
        }
        runs = ["plain", *caps]
        speeds: dict[str, list[float]] = {r: [] for r in runs}
        for r in range(args.rounds):
            group = r % (len(pool) // size)
            batch = pool[group * size : (group + 1) * size]
            for run in runs[r % len(runs) :] + runs[: r % len(runs)]:
                if run != "plain":
                    gen.block_policies = policies[run]
                t = time.perf_counter()
                out = gen.generate_batch(batch, max_new_tokens=args.max_new_tokens, use_drafter=run != "plain")
                speeds[run].append(sum(len(o.token_ids) for o in out) / (time.perf_counter() - t))
        for run in runs:
            ratio = statistics.median(s / p for s, p in zip(speeds[run], speeds["plain"]))
            label = "plain batched" if run == "plain" else f"speculative, cap {run}"
            print(f"| {size} | {label} | {statistics.median(speeds[run]):.1f} | {ratio:.3f}x |")


if __name__ == "__main__":
    main()
