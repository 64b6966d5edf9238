"""Greedy τ of one verify tree that holds both the copy (prompt lookup, the n-gram store) and the drafter's drafts.

    .venv/bin/python scripts/hybrid_tree_estimate.py [--drafter DIR] [--limit 12] [--budgets 15] [--copy-values 0.9]

Replays the target's greedy answers as rerank_estimate.py does (the drafter's top 4 per offset teacher-forced at
every anchor; lookup's, else the store's, proposal for every prefix), one rule at a time, each step accepting the
longest path of its tree that the answer follows (greedy tree verification: exact). Rules, with N nodes (N + 1
verify rows; N = 15 is a block-16 verify):

* ``copy-chain`` (today's loop): the copy where there is one, else the drafter's chain of N;
* ``copy-or-tree``: the copy where there is one, else the drafter's best-first tree of N nodes;
* ``hybrid c``: every step one best-first tree of N nodes over both sources: a copied token at depth d is worth
  c^d, a drafter candidate its parent's worth times the drafter's probability; the drafter's candidates also
  hang under copied nodes; equal tokens under one parent are one node.

``--min-worths``: hybrid trees stop adding nodes worth less than this (fewer verify rows). Prints τ and the mean
verify rows a step (anchor included). No timing: a hybrid step runs the drafter on every step (~2-3.5 ms of a
~10-20 ms step here).
"""

from __future__ import annotations

import argparse

import torch
from rerank_estimate import proposals, top_choices  # noqa: E402 (scripts/ is on the path when run as a script)

from dflashkit.decoding.tree import DraftTree, hybrid_tree
from dflashkit.generator import SpeculativeGenerator
from dflashkit.training.evalsets import load_set


def accepted(tree: DraftTree, y: list[int], a: int) -> int:
    """Drafts kept at anchor a: the walk down the tree with the answer's own tokens (greedy verification)."""
    row, n = 0, 0
    while a + 1 + n < len(y) and (child := tree.child(row, y[a + 1 + n])) is not None:
        row, n = child, n + 1
    return n


def walk(
    y: list[int],
    start: int,
    choices: dict,
    props: list[list[int]],
    rule: str,
    budget: int,
    copy_value: float,
    min_worth: float = 0.0,
) -> tuple[int, int, int, int]:
    a, steps, drafter_steps, rows = start - 1, 0, 0, 0
    while a < len(y) - 1:
        tokens, probs = choices[a]
        room = len(y) - 1 - a
        tokens, probs = tokens[: min(budget, room)], probs[: min(budget, room)]
        copy = list(props[a + 1])[: min(budget, room)]
        if copy and rule != "hybrid":
            n, rows = 0, rows + len(copy) + 1
            while n < len(copy) and copy[n] == y[a + 1 + n]:
                n += 1
        elif rule == "copy-chain":
            chain = DraftTree([t[0] for t in tokens], list(range(len(tokens))), list(range(1, len(tokens) + 1)))
            n, drafter_steps, rows = accepted(chain, y, a), drafter_steps + 1, rows + len(chain) + 1
        else:  # the decode loop's own construction (dflashkit.decoding.tree.hybrid_tree; no copy: the drafter's tree)
            tree = hybrid_tree(probs, tokens, copy if rule == "hybrid" else [], budget, copy_value, min_worth)
            n, drafter_steps, rows = accepted(tree, y, a), drafter_steps + 1, rows + len(tree) + 1
        steps += 1
        a += n + 1
    return len(y) - start, steps, drafter_steps, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", default="15", help="comma-separated node budgets (N + 1 verify rows)")
    ap.add_argument("--copy-values", default="0.7,0.9,0.97", help="comma-separated worth c of a copied token")
    ap.add_argument("--min-worths", default="0", help="comma-separated: hybrid trees drop nodes worth less")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load(drafter=args.drafter)
    B = gen.drafter.block_size
    budgets = [int(b) for b in args.budgets.split(",")]
    variants = [(rule, b, 0.0, 0.0) for b in budgets for rule in ("copy-chain", "copy-or-tree")] + [
        ("hybrid", b, float(c), float(m))
        for b in budgets
        for c in args.copy_values.split(",")
        for m in args.min_worths.split(",")
    ]
    means = {}
    for name in args.sets.split(","):
        totals: dict[str, list[int]] = {}
        for prompt in load_set(name, limit=args.limit, seed=0):
            ids = gen.encode_prompt(prompt)
            y = ids + gen.generate(ids, max_new_tokens=args.max_new_tokens, use_drafter=False).token_ids  # greedy
            choices = {a: (t, p) for a, t, p in top_choices(gen, y, len(ids) - 1, 4)}
            props = proposals(gen, y, B - 1)
            for rule, budget, c, m in variants:
                key = f"{rule} N={budget}" + (f" c={c:g}" + (f" min={m:g}" if m else "") if rule == "hybrid" else "")
                got = walk(y, len(ids), choices, props, rule, budget, c, m)
                acc = totals.setdefault(key, [0, 0, 0, 0])
                for j in range(4):
                    acc[j] += got[j]
        for key, (tokens, steps, drafter_steps, rows) in totals.items():
            means.setdefault(key, []).append((tokens / steps, rows / steps))
            print(
                f"{name:10s} {key:30s} tau {tokens / steps:.3f}  steps {steps:5d}  drafter passes "
                f"{drafter_steps / steps:.2f} of steps  verify rows {rows / steps:.1f} a step",
                flush=True,
            )
    for key, pairs in means.items():
        print(
            f"mean       {key:30s} tau {sum(t for t, _ in pairs) / len(pairs):.3f}  verify rows "
            f"{sum(r for _, r in pairs) / len(pairs):.1f}"
        )


if __name__ == "__main__":
    main()
