"""What a deeper drafter costs on this CPU before it has learnt anything: the τ it must gain to pay for itself.

    .venv/bin/python scripts/depth_cost.py [--layers 4,5] [--limit 6] [--threads 2] [--block-size 8] [--no-lookup]

The shipped drafter is deepened as `dflashkit train --layers N --init` deepens it (train.deepened: copies of its
layers with their output projections zeroed), so every deepened drafter drafts exactly the same tokens and only its
drafting step is slower. One process, one generator per depth (each with its own adaptive block-size policy),
interleaved per prompt with plain decoding, greedy, after a warm-up. Prints per set each depth's mean τ, median
tok/s and median per-prompt speedup over plain decoding, and the ratio to the shipped depth: a deeper drafter trained
on the same data must raise τ by at least that ratio's shortfall to decode as fast.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from dflashkit import SpeculativeGenerator, save_drafter
from dflashkit.drafter.checkpoint import load_drafter
from dflashkit.drafter.ngram_store import FILENAME as NGRAM_STORE
from dflashkit.training.evalsets import load_set
from dflashkit.training.warm_start import deepened

SHIPPED = Path(__file__).resolve().parents[1] / "dflashkit" / "drafters" / "smollm2-135m-instruct"


def deepened_copy(source: Path, layers: int, out: Path) -> Path:
    """`source` deepened to `layers` layers, saved with its config's extras and its n-gram store."""
    drafter = load_drafter(source)
    save_drafter(deepened(drafter, layers), out)
    if (source / NGRAM_STORE).exists():
        shutil.copy(source / NGRAM_STORE, out / NGRAM_STORE)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", type=Path, default=SHIPPED)
    ap.add_argument("--layers", default="4,5", help="depths to compare with the drafter's own")
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None, help="a fixed block (default: auto, as `generate`)")
    ap.add_argument("--no-lookup", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {"block_size": args.block_size, "lookup": False if args.no_lookup else None}
    own = load_drafter(args.drafter).config.num_hidden_layers
    with tempfile.TemporaryDirectory() as tmp:
        folders = {own: args.drafter}
        for n in (int(x) for x in args.layers.split(",")):
            folders[n] = deepened_copy(args.drafter, n, Path(tmp) / f"layers-{n}")
        gens = {n: SpeculativeGenerator.load(drafter=str(folder)) for n, folder in folders.items()}
        for gen in gens.values():
            gen.warmup()
        plain = gens[own]
        for name in args.sets.split(","):
            prompts = load_set(name, limit=args.limit, seed=0)
            for n, gen in gens.items():  # warm-up: each policy's first measurements
                gen.generate(prompts[0], max_new_tokens=32, **options)
            tps = {n: [] for n in gens}
            taus = {n: [] for n in gens}
            speedups = {n: [] for n in gens}
            plain_tps, differ = [], 0
            for prompt in prompts:
                base = plain.generate(prompt, max_new_tokens=args.max_new_tokens, use_drafter=False)
                plain_tps.append(base.stats.tokens_per_s)
                base_tpot = base.stats.decode_s / max(1, base.stats.new_tokens - 1)
                for n, gen in gens.items():
                    r = gen.generate(prompt, max_new_tokens=args.max_new_tokens, **options)
                    differ += r.token_ids != base.token_ids
                    tps[n].append(r.stats.tokens_per_s)
                    taus[n].append(r.stats.tau)
                    speedups[n].append(base_tpot / (r.stats.decode_s / max(1, r.stats.new_tokens - 1)))
            print(
                f"{name} ({len(prompts)} prompts, greedy, {args.max_new_tokens} new tokens, options {options}; "
                f"plain {statistics.median(plain_tps):.1f} tok/s; outputs differing from plain: {differ}):"
            )
            for n in gens:
                ratio = statistics.median(a / b for a, b in zip(tps[n], tps[own]))
                print(
                    f"  {n} layers  τ {statistics.mean(taus[n]):.2f}  {statistics.median(tps[n]):6.1f} tok/s  "
                    f"speedup over plain (median per prompt) {statistics.median(speedups[n]):.2f}x  "
                    f"tok/s against {own} layers (median per prompt) {ratio:.3f}"
                )


if __name__ == "__main__":
    main()
