"""Greedy chain τ of k drafts when the drafter runs a block of L rows (L >= k + 1), teacher-forced.

    .venv/bin/python scripts/block_length_tau.py [--drafter DIR] [--limit 6] [--ks 1,2,3,5,7] [--lengths 2,4,8,12,16]

The target answers each prompt greedily; at every anchor of the answer the drafter (context: the answer's verified
features up to the anchor) runs one block of L rows (the anchor and L - 1 masks), and the first k drafts are
compared with the answer: τ = 1 + the mean count of leading drafts that match; and k drafts from k + 1 rows plus the
trained block's last row (``block_fill = "tail"``). A DFlash block's rows attend to each other, and drafters train on
whole blocks, so a block cut short is a shape the drafter never saw; this measures what that costs
(``DFlashDrafter.block_fill``). No timing.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import torch

from dflashkit.generator import SpeculativeGenerator
from dflashkit.training.evalsets import load_set


def answers(gen: SpeculativeGenerator, name: str, limit: int, max_new_tokens: int):
    """Per prompt of an evaluation set: its token ids, prompt + the target's greedy answer, and that sequence's
    target features [1, len, F] (the drafter's context when teacher-forced)."""
    target = gen.target
    for prompt in load_set(name, limit=limit, seed=0):
        ids = gen.encode_prompt(prompt)
        y = ids + gen.generate(ids, max_new_tokens=max_new_tokens, use_drafter=False).token_ids
        _, features = target.forward(torch.tensor([y]), 0, target.new_cache(capacity=len(y) + 1), logits_rows=1)
        yield ids, y, features


def leading_matches(drafts: list[int], y: list[int], anchor: int, k: int) -> int:
    """How many of the first k drafts after `anchor` match the answer y, in a row."""
    m = 0
    while m < k and anchor + 1 + m < len(y) and drafts[m] == y[anchor + 1 + m]:
        m += 1
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--ks", default="1,2,3,5,7", help="drafts scored (chain lengths)")
    ap.add_argument("--lengths", default="2,3,4,6,8,12,16", help="block rows L the drafter runs (anchor included)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load(drafter=args.drafter)
    drafter, target = gen.drafter, gen.target
    target.set_feature_layers(drafter.config.target_layer_ids)
    ks = [int(k) for k in args.ks.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    for name in args.sets.split(","):
        matched: dict[tuple[int, int], float] = defaultdict(float)
        counted: Counter = Counter()
        for ids, y, features in answers(gen, name, args.limit, args.max_new_tokens):  # features [1, len(y), F]
            context = drafter.new_context(capacity=len(y) + max(lengths))
            have = 0  # context rows taken so far: positions < have
            for a in range(len(ids) - 1, len(y) - 1):  # anchor y[a] at position a, context = positions < a
                new = features[:, have:a] if a > have else None
                runs = [(length, length - 1, "cut") for length in lengths] + [("tail", k, "tail") for k in ks]
                for i, (column, drafts_asked, fill) in enumerate(runs):
                    drafter.block_fill = fill
                    scores, columns = drafter.draft_scores(
                        context,
                        new if i == 0 else None,
                        have,
                        y[a],
                        a,
                        drafts_asked,
                        target.embed_tokens,
                        target.lm_head,
                    )
                    best = scores.argmax(-1)
                    drafts = (columns[best] if columns is not None else best).tolist()
                    for k in ks if fill == "cut" else [drafts_asked]:
                        if k > drafts_asked:
                            continue
                        matched[k, column] += leading_matches(drafts, y, a, k)
                        counted[k, column] += 1
                have = max(have, a)
        print(name)
        for k in ks:
            cells = [f"L{n}: {1 + matched[k, n] / counted[k, n]:.3f}" for n in lengths if counted[k, n]]
            cells.append(f"k+1 rows and the last: {1 + matched[k, 'tail'] / counted[k, 'tail']:.3f}")
            print(f"  k={k}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
