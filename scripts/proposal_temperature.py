"""τ of sampled decoding at several proposal temperatures: what to write into a drafter's `proposal_temperature`.

Decodes the evaluation prompts with the default settings (adaptive block size, prompt lookup) at --temperature, the
same prompts and seeds for every ratio and drafter, each drafter proposing at `ratio` x the request's temperature
(`--sampler coupled`: as a seeded request runs). Any proposal is exact, so only τ (tokens after the prefill over
target passes after it) moves; a drafter flatter than the target is accepted more often sharpened (ratio < 1).
scripts/draft_temperature.py gives the teacher-forced acceptance per offset, this script what decoding makes of it;
a sampled run's τ moves by a few percent with its seeds, so compare means over sets and over seed ranges.

    python scripts/proposal_temperature.py [--drafters auto] [--ratios 1,0.85,0.7] [--limit 12] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dflashkit.generator import SpeculativeGenerator


def tau(gen: SpeculativeGenerator, prompts: list, seeds: int, ratio: float, args: argparse.Namespace) -> float:
    tokens = passes = 0
    block = args.block_size if args.block_size == "auto" else int(args.block_size)
    for prompt in prompts:
        for seed in range(args.first_seed, args.first_seed + seeds):
            stats = gen.generate(
                prompt,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                block_size=block,
                lookup=not args.no_lookup,
                seed=seed,
                sampler=args.sampler,
                proposal_temperature=ratio,
            ).stats
            tokens, passes = tokens + stats.new_tokens - 1, passes + stats.target_forwards - 1  # after the prefill
    return tokens / max(passes, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", default="auto", help="comma-separated drafter folders (default: the shipped one)")
    ap.add_argument("--ratios", default="1,0.85,0.7")
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--sampler", choices=["rejection", "coupled"], default="rejection")
    ap.add_argument("--block-size", default="auto")
    ap.add_argument("--no-lookup", action="store_true")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    from dflashkit.generator import SpeculativeGenerator
    from dflashkit.training.evalsets import load_set

    if args.threads:
        torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.ratios.split(",")]
    sets = {name: load_set(name, limit=args.limit, seed=0) for name in args.sets.split(",")}
    for path in args.drafters.split(","):
        gen = SpeculativeGenerator.load(drafter=path)
        gen.warmup()
        print(
            f"drafter {path} (its own proposal temperature {gen.drafter.config.proposal_temperature}); "
            f"T={args.temperature}, {args.sampler} sampler, block {args.block_size}, lookup {not args.no_lookup}, "
            f"{args.limit} prompts x {args.seeds} seeds a set",
            flush=True,
        )
        for ratio in ratios:
            taus = {name: tau(gen, prompts, args.seeds, ratio, args) for name, prompts in sets.items()}
            print(
                f"  ratio {ratio:4.2f}  "
                + "  ".join(f"{n} {t:.3f}" for n, t in taus.items())
                + f"  mean {statistics.fmean(taus.values()):.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
