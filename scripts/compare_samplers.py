"""The two exact samplers, one process, interleaved per prompt: rejection sampling (speculative sampling) against
coupled sampling (Gumbel-max with noise fixed by the seed), both speculative with the defaults of `dflashkit
generate` (adaptive block size, prompt lookup), and plain sampling with each.

    .venv/bin/python scripts/compare_samplers.py [--limit 8] [--temperature 1.0] [--seeds 2] [--threads 2]
    .venv/bin/python scripts/compare_samplers.py --block-size 4 --no-lookup    # a fixed block, the drafter alone
    .venv/bin/python scripts/compare_samplers.py --tree 5 --no-lookup          # token trees of 5 nodes

Prints, per evaluation set, each variant's mean τ and median tokens/s, the median per-prompt speedup over plain
rejection sampling (the cheapest plain sampler), and how many coupled speculative outputs equal plain coupled
sampling of the same seed (all of them, up to bf16 ties: the coupled sampler's contract).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflashkit import SpeculativeGenerator
from dflashkit.training.evalsets import load_set

VARIANTS = {  # name: (use the drafter, sampler)
    "plain-rejection": (False, "rejection"),
    "plain-coupled": (False, "coupled"),
    "spec-rejection": (True, "rejection"),
    "spec-coupled": (True, "coupled"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=2, help="sampling seeds per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None, help="speculative variants: a fixed block (default: auto)")
    ap.add_argument("--tree", type=int, default=None, help="speculative variants: token trees of this many nodes")
    ap.add_argument("--no-lookup", action="store_true", help="speculative variants: no prompt lookup")
    args = ap.parse_args()
    spec_options = {"block_size": args.block_size, "tree": args.tree, "lookup": False if args.no_lookup else None}
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load()
    gen.warmup()
    for name in args.sets.split(","):
        prompts = load_set(name, limit=args.limit, seed=0)
        tps: dict[str, list[float]] = {v: [] for v in VARIANTS}
        taus: dict[str, list[float]] = {v: [] for v in VARIANTS}
        speedups: dict[str, list[float]] = {v: [] for v in VARIANTS}
        same = runs = 0
        gen.generate(prompts[0], max_new_tokens=16, temperature=args.temperature, seed=0)  # warm-up
        for prompt in prompts:
            for seed in range(args.seeds):
                results = {}
                for variant, (use_drafter, sampler) in VARIANTS.items():
                    results[variant] = gen.generate(
                        prompt,
                        max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature,
                        seed=seed,
                        sampler=sampler,
                        use_drafter=use_drafter,
                        **(spec_options if use_drafter else {}),
                    )
                base = results["plain-rejection"].stats
                base_tpot = base.decode_s / max(1, base.new_tokens - 1)
                for variant, r in results.items():
                    s = r.stats
                    tps[variant].append(s.tokens_per_s)
                    taus[variant].append(s.tau)
                    speedups[variant].append(base_tpot / (s.decode_s / max(1, s.new_tokens - 1)))
                same += results["spec-coupled"].token_ids == results["plain-coupled"].token_ids
                runs += 1
        print(
            f"{name} (T={args.temperature}, {len(prompts)} prompts x {args.seeds} seeds, "
            f"{args.max_new_tokens} new tokens, speculative options {spec_options}):"
        )
        for variant in VARIANTS:
            print(
                f"  {variant:16s} τ {statistics.mean(taus[variant]):.2f}  "
                f"{statistics.median(tps[variant]):6.1f} tok/s  "
                f"speedup over plain-rejection (median per prompt) {statistics.median(speedups[variant]):.2f}x"
            )
        print(f"  spec-coupled output == plain-coupled output of the seed: {same}/{runs}")


if __name__ == "__main__":
    main()
