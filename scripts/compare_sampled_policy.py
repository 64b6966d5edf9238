"""The adaptive block size's variants, one process, interleaved per prompt: the default policies (at T>0 the
sampled regime's: blocks <= 4, copies <= 3, copy lengths by their own policy), the greedy regime's sizes for
sampled requests (blocks <= 16), copies always as long as the largest block (no copy policy), a fixed block 4.

    .venv/bin/python scripts/compare_sampled_policy.py [--limit 8] [--temperature 1.0] [--threads 2]
    .venv/bin/python scripts/compare_sampled_policy.py --temperature 0     # greedy requests

Prints, per evaluation set, the median tokens/s and mean τ of each variant and the median per-prompt speedup
over plain sampling (prompt lookup on in every speculative variant, as `dflashkit generate` does by default).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflashkit import SpeculativeGenerator
from dflashkit.adaptive import BlockPolicies
from dflashkit.evalsets import load_set


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load()
    gen.warmup()
    block = gen.drafter.block_size
    longest_copies = BlockPolicies(block)
    for greedy in (True, False):
        longest_copies.get(greedy).copies = None
    policies = {"default": BlockPolicies(block), "longest-copies": longest_copies}
    if args.temperature > 0:
        policies["greedy-sizes"] = BlockPolicies(block, sampled_max_block=block)
    variants = (*policies, "block-4", "plain")
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for name in args.sets.split(","):
        for i, prompt in enumerate(load_set(name, limit=args.limit)):
            for v in variants[i % len(variants):] + variants[: i % len(variants)]:  # rotate the order per prompt
                if v in policies:
                    gen.block_policies = policies[v]  # each variant's estimates carry over between its prompts
                kw = {"use_drafter": False} if v == "plain" else {"lookup": True, "block_size": 4 if v == "block-4" else "auto"}
                stats = gen.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     seed=i, **kw).stats
                results.setdefault((name, v), []).append((stats.new_tokens / stats.decode_s, stats.tau))
    for name in args.sets.split(","):
        plain = results[(name, "plain")]
        cells = []
        for v in variants:
            rows = results[(name, v)]
            speedup = statistics.median(a[0] / b[0] for a, b in zip(rows, plain))
            cells.append(f"{v} {statistics.median(r[0] for r in rows):.1f} tok/s τ {statistics.mean(r[1] for r in rows):.2f}"
                         f" x{speedup:.2f}")
        print(f"{name}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
