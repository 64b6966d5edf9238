"""Estimate what token-tree verification would accept, from the drafter's ranks of the target's own tokens.

    .venv/bin/python scripts/tree_estimate.py [--drafter DIR] [--limit 12] [--temperatures 0,1]

For each evaluation set and temperature: the target decodes alone (its tokens y), then the drafter drafts from
every response position a (teacher-forced, the training mask: context strictly before a) and we record the rank
of y[a+d] in the drafter's scores at offset d = 1..15. A tree whose children at depth d are the drafter's
top-ranked tokens accepts, at anchor a, the longest path of y's ranks that is a node of the tree (the target's
token, sampled or argmax, walks down the tree: the verification that keeps the output exact). Prints the mean
accepted drafts per step for chains and for the best trees of N nodes (built on the other sets: no peeking).
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.sampling import SamplingParams
from dflashkit.decoding.tree import best_first
from dflashkit.generator import SpeculativeGenerator
from dflashkit.training.evalsets import load_set
from dflashkit.training.losses import teacher_forced_scores

MAX_RANK = 8


def rank_paths(gen: SpeculativeGenerator, ids: list[int], start: int) -> tuple[list, list]:
    """Per anchor a in [start, len-2]: ranks (capped at MAX_RANK) of ids[a+1..a+B-1] in the drafter's scores,
    and the drafter's top-MAX_RANK probabilities at every offset [B-1, MAX_RANK]."""
    d, target = gen.drafter, gen.target
    B, L = d.block_size, len(ids)
    vocab = d.draft_vocab
    column = torch.full((target.vocab_size,), -1, dtype=torch.long)
    column[vocab] = torch.arange(len(vocab))
    out, tops = [], []
    for anchors, scores in teacher_forced_scores(d, target, ids, start):  # [N], [N, B-1, V']
        top = scores.softmax(-1).topk(MAX_RANK, -1).values  # [N, B-1, MAX_RANK]
        for n in range(len(anchors)):
            a = int(anchors[n])
            ranks = []
            for k in range(1, B):
                if a + k >= L:
                    break
                c = int(column[ids[a + k]])
                r = MAX_RANK if c < 0 else int((scores[n, k - 1] > scores[n, k - 1, c]).sum())
                ranks.append(min(r, MAX_RANK))
            out.append(tuple(ranks))
            tops.append(top[n])
    return out, tops


def node_values(paths: list[tuple[int, ...]], depth: int) -> Counter:
    """P(the target's path passes through node (r1..rd)) for every node with ranks < MAX_RANK."""
    counts: Counter = Counter()
    for p in paths:
        for d in range(1, min(depth, len(p)) + 1):
            if p[d - 1] >= MAX_RANK:
                break
            counts[p[:d]] += 1
    return Counter({k: v / len(paths) for k, v in counts.items()})


def dynamic_tree(top: torch.Tensor, budget: int) -> set:
    """The nodes (rank paths) dflashkit.decoding.tree.best_first keeps for one anchor's top probabilities [depth,
    ranks]."""
    parents, _, ranks = best_first(top.tolist(), budget)
    paths: list[tuple[int, ...]] = []
    for parent, rank in zip(parents, ranks):
        paths.append((paths[parent - 1] if parent else ()) + (rank,))
    return set(paths)


def path_length(path: tuple[int, ...], tree: set) -> int:
    """Drafts the tree accepts at an anchor: the longest prefix of the target's rank path that is a node."""
    d = 0
    while d < len(path) and path[: d + 1] in tree:
        d += 1
    return d


def accepted_dynamic(paths: list, tops: list, budget: int) -> float:
    return sum(path_length(p, dynamic_tree(top[: len(p)], budget)) for p, top in zip(paths, tops) if p) / len(paths)


def accepted(paths: list[tuple[int, ...]], tree: set) -> float:
    return sum(path_length(p, tree) for p in paths) / len(paths)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--budgets", default="3,7,15,23,31,47,63")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load(drafter=args.drafter)
    budgets = [int(b) for b in args.budgets.split(",")]
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        per_set, per_set_tops = {}, {}
        for name in args.sets.split(","):
            paths, tops = [], []
            for i, prompt in enumerate(load_set(name, limit=args.limit, seed=0)):
                ids = gen.encode_prompt(prompt)
                options = DecodeOptions(
                    max_new_tokens=args.max_new_tokens,
                    seed=i,
                    sampling=SamplingParams(temperature=temperature),
                    stop_token_ids=frozenset(gen.eos_token_ids),
                )
                out = [t for step in decode(gen.target, None, ids, options) for t in step.tokens]
                got = rank_paths(gen, ids + out, len(ids))
                paths += got[0]
                tops += got[1]
            per_set[name] = paths
            per_set_tops[name] = tops
        for name, paths in per_set.items():
            others = [p for n, ps in per_set.items() if n != name for p in ps]
            values = node_values(others, 15)
            chain = {tuple([0] * d) for d in range(1, 16)}
            row = [
                f"chain15 {accepted(paths, chain):.3f}",
                f"chain3 {accepted(paths, {tuple([0] * d) for d in range(1, 4)}):.3f}",
            ]
            for n in budgets:
                tree = {k for k, _ in values.most_common(n)}
                row.append(
                    f"tree{n} {accepted(paths, tree):.3f}/dyn {accepted_dynamic(paths, per_set_tops[name], n):.3f}"
                )
            print(f"T={temperature:g} {name:10s} anchors {len(paths):5d}  " + "  ".join(row), flush=True)
        first = Counter(p[0] for ps in per_set.values() for p in ps if p)
        total = sum(first.values())
        print(
            f"T={temperature:g} rank of the target's next token (depth 1): "
            + " ".join(f"{r}:{first[r] / total:.3f}" for r in range(MAX_RANK + 1)),
            flush=True,
        )


if __name__ == "__main__":
    main()
