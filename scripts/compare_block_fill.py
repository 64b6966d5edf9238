"""Ways to fill a drafter block short of its trained size, one process, interleaved per prompt, with plain decoding.

    .venv/bin/python scripts/compare_block_fill.py [--limit 8] [--block-size auto] [--threads 2]
    .venv/bin/python scripts/compare_block_fill.py --block-size 4 --no-lookup    # the drafter alone, 3 drafts a step
    .venv/bin/python scripts/compare_block_fill.py --block-size 16 --tree 11     # token trees of 11 nodes
    .venv/bin/python scripts/compare_block_fill.py --temperature 1 --seeds 2     # sampling
    .venv/bin/python scripts/compare_block_fill.py --variants tail,tail-notext   # the text's own columns on / off

A drafter asked for k drafts, fewer than its trained block holds, runs (``DFlashDrafter.block_fill``) the whole block
and scores its first k ("whole"), k + 1 rows and the block's last row ("tail", the CPU default since session 42), or
k + 1 rows ("cut", before). A variant named FILL-notext fills as FILL with the drafter scoring its draft
vocabulary only, not the text's own tokens outside it (``DFlashDrafter.text_columns``). Each variant has
its own generator (so that the adaptive block-size policy learns each one's own acceptance and cost). Prints per
evaluation set each variant's τ (tokens per target pass, over all prompts), median decode tokens/s, the median
per-prompt speedup over plain decoding (decode time per token, TPOT) and, greedy, how many outputs equal plain
decoding's.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflashkit import SpeculativeGenerator
from dflashkit.training.evalsets import load_set

FILLS = ("tail", "whole", "cut")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", default="auto", help="an int, or auto (the adaptive policy)")
    ap.add_argument("--tree", type=int, default=None, help="token trees of this many nodes")
    ap.add_argument("--no-lookup", action="store_true", help="no prompt lookup / n-gram store: the drafter alone")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seeds", type=int, default=1, help="sampling seeds per prompt (temperature > 0)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    ap.add_argument(
        "--variants",
        default="tail,whole,cut",
        help="fills to compare (tail, whole, cut), each also as FILL-notext (no text columns)",
    )
    args = ap.parse_args()
    variants = ("plain", *args.variants.split(","))
    for v in variants[1:]:
        if v.removesuffix("-notext") not in FILLS:
            raise SystemExit(f"unknown variant {v!r}: a fill ({', '.join(FILLS)}), optionally with -notext")
    if args.threads:
        torch.set_num_threads(args.threads)
    block = args.block_size if args.block_size == "auto" else int(args.block_size)
    gens = {"plain": SpeculativeGenerator.load(device=args.device)}
    for i, v in enumerate(variants[1:]):  # the first variant shares the plain generator
        gens[v] = gens["plain"] if i == 0 else SpeculativeGenerator.load(device=args.device)
        gens[v].drafter.block_fill = v.removesuffix("-notext")
        gens[v].drafter.text_columns = not v.endswith("-notext")
    spec = {"block_size": block, "tree": args.tree, "lookup": False if args.no_lookup else None}
    greedy = args.temperature == 0
    seeds = [None] if greedy else list(range(args.seeds))
    print(
        f"block size {block}, tree {args.tree}, lookup {not args.no_lookup}, T={args.temperature:g}, "
        f"{args.limit} prompts per set x {len(seeds)} seed(s), {args.max_new_tokens} new tokens"
    )
    for name in args.sets.split(","):
        prompts = load_set(name, limit=args.limit, seed=0)
        for variant in variants[1:]:  # warm-up (kernels, policies' first measurements)
            gens[variant].generate(prompts[0], max_new_tokens=16, temperature=args.temperature, seed=0, **spec)
        tokens = {v: 0 for v in variants}
        steps = {v: 0 for v in variants}
        tps: dict[str, list[float]] = {v: [] for v in variants}
        speedups: dict[str, list[float]] = {v: [] for v in variants[1:]}
        same = {v: 0 for v in variants[1:]}
        runs = 0
        for i, prompt in enumerate(prompts):
            for seed in seeds:
                order = variants if i % 2 == 0 else variants[::-1]  # alternate who goes first
                results = {}
                for variant in order:
                    options = {} if variant == "plain" else spec
                    results[variant] = gens[variant].generate(
                        prompt,
                        max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature,
                        seed=seed,
                        use_drafter=variant != "plain",
                        **options,
                    )
                runs += 1
                tpot = {}
                for variant, r in results.items():
                    tokens[variant] += r.stats.new_tokens
                    steps[variant] += r.stats.steps
                    tpot[variant] = r.stats.decode_s / max(1, r.stats.new_tokens)
                    tps[variant].append(1.0 / tpot[variant])
                for variant in variants[1:]:
                    speedups[variant].append(tpot["plain"] / tpot[variant])
                    same[variant] += results[variant].token_ids == results["plain"].token_ids
        for variant in variants:
            line = (
                f"{name:10s} {variant:13s} tau {tokens[variant] / max(1, steps[variant]):5.2f}  "
                f"{statistics.median(tps[variant]):6.1f} tok/s"
            )
            if variant != "plain":
                line += f"  speedup {statistics.median(speedups[variant]):.2f}x"
                if greedy:
                    line += f"  identical to plain {same[variant]}/{runs}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
