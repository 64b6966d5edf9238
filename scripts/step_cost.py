"""Wall time of one target step by row count (a verify block of n tokens) and of token trees of n rows.

The target's fast forward (default: SmolLM2-135M) over a cache of --context positions; each shape runs once per round,
the rounds interleave the shapes, the first two rounds are dropped, and the median per shape is printed. A tree of n
rows is the best-first tree (dflashkit.decoding.tree.best_first) of n - 1 nodes over a fixed, made-up confidence
profile: its mask, not its tokens, sets the cost. These costs are what the adaptive block size weighs against
acceptance; `--quantize int8` / `int4` times a weight-only quantized target.

    python scripts/step_cost.py [--context 300] [--rows 1,2,4,8,16] [--trees 4,6,8,12] [--repeats 12] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def tree_shape(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position offsets, attention mask) of the best-first tree of rows - 1 nodes over a fixed, made-up confidence
    profile: what a target step over a token tree of that many rows takes (its mask, not its tokens, sets the cost)."""
    from dflashkit.decoding.tree import DraftTree, best_first

    parents, depths, _ = best_first([[0.5, 0.2, 0.1, 0.05]] * 8, rows - 1)
    tree = DraftTree(list(range(100, 99 + rows)), parents, depths)
    return tree.position_offsets(), tree.attention_mask()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16")
    ap.add_argument("--trees", default="4,6,8,12", help="rows of each tree (anchor + nodes); empty: none")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantize", default=None, help="int8 or int4: a weight-only quantized target")
    ap.add_argument("--target", default=None, help="as `dflashkit generate --target` takes it (default: SmolLM2)")
    args = ap.parse_args()
    from dflashkit import SpeculativeGenerator

    if args.threads:
        torch.set_num_threads(args.threads)
    target = SpeculativeGenerator.load(args.target, drafter=None, quantize=args.quantize).target
    cache = target.new_cache(capacity=args.context + 64)
    shapes: dict[str, tuple[int, tuple | None]] = {f"{n} rows": (n, None) for n in map(int, args.rows.split(","))}
    for n in (int(t) for t in args.trees.split(",") if t):
        shapes[f"tree of {n} rows"] = (n, tree_shape(n))
    times: dict[str, list[float]] = {name: [] for name in shapes}
    with torch.inference_mode():
        target.forward(torch.randint(0, 1000, (1, args.context)), 0, cache, logits_rows=1)
        for round_ in range(args.repeats + 2):
            for name, (n, tree) in shapes.items():
                ids = torch.randint(0, 1000, (1, n))
                t0 = time.perf_counter()
                target.forward(ids, args.context, cache, logits_rows=n, tree=tree)
                elapsed = time.perf_counter() - t0
                target.crop(cache, args.context)
                if round_ >= 2:
                    times[name].append(elapsed)
    weights = f", {args.quantize} weights" if args.quantize else ""
    print(
        f"target step at {args.context} cached positions{weights}, {torch.get_num_threads()} threads, "
        f"engine {target.engine}, median of {args.repeats}"
    )
    for name, ts in times.items():
        print(f"  {name:18s} {statistics.median(ts) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
