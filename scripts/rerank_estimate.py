"""Greedy τ of ways to combine copies (prompt lookup, the n-gram store) and the drafter's drafts in one chain.

    .venv/bin/python scripts/rerank_estimate.py [--drafter DIR] [--limit 12] [--top-k 4] [--ratios 0,0.1,0.3]

The target decodes alone (greedy answers y); the drafter's top K per block offset is taken teacher-forced at every
response position (the training mask), and lookup's proposal (else the store's) for every prefix of y. Then y is
replayed as the decode loop would walk it (at block B, the drafter's), one rule at a time, each step accepting the
leading drafts equal to y's: ``copy`` (today's loop: copy wherever lookup or the store proposes, else draft),
``copyfirst`` (copy, the drafter's argmaxes where the copy ends), ``choose`` (run the drafter on copy steps too;
copy only where its top K hold the copy's first token with at least ``ratio`` x its argmax's probability),
``drafter-rerank`` (drafter steps take lookup's token for the text up to each offset where it is in the top K:
each offset of a DFlash block is blind to the drafts before it), and ``oracle`` (the better of copy and drafter
chain, known in advance: a bound). Prints τ and the share of steps that run the drafter; no timing.
"""

from __future__ import annotations

import argparse

import torch

from dflashkit.decoding.lookup import NgramLookup
from dflashkit.generator import SpeculativeGenerator
from dflashkit.training.evalsets import load_set
from dflashkit.training.losses import teacher_forced_scores


def top_choices(gen: SpeculativeGenerator, ids: list[int], start: int, k: int):
    """Per anchor a in [start, len-2]: the drafter's top-k token ids and probabilities at offsets 1..B-1."""
    vocab, out = gen.drafter.draft_vocab, []
    for anchors, scores in teacher_forced_scores(gen.drafter, gen.target, ids, start):
        probs, cols = scores.softmax(-1).topk(k, -1)  # [N, B-1, k]
        tokens = vocab[cols] if vocab is not None else cols
        out += [(int(a), tokens[n].tolist(), probs[n].tolist()) for n, a in enumerate(anchors)]
    return out


def proposals(gen: SpeculativeGenerator, ids: list[int], max_tokens: int) -> list[list[int]]:
    """props[p] for p = 0..len(ids): what prompt lookup (else the drafter's n-gram store) proposes for the text
    ids[:p], up to ``max_tokens`` tokens, as the decode loop's lookup would."""
    look = NgramLookup(store=gen.drafter.ngram_store)
    out: list[list[int]] = []
    for p in range(len(ids) + 1):
        out.append(look.propose(max_tokens))
        if p < len(ids):
            look.extend([ids[p]])
    return out


def chain(
    tokens: list[list[int]], probs: list[list[float]], guide: list[int | None], rule: str, ratio: float
) -> list[int]:
    """The drafts of one step from the drafter's top choices per offset and the guide's token per offset:
    ``drafter``: the argmaxes; ``copy``: the guide's tokens up to the first offset where it has none;
    ``copyfirst``: the guide's token where it has one, else the argmax; ``rerank``: the guide's token where it is
    among the drafter's top K with at least ``ratio`` times the argmax's probability, else the argmax."""
    out: list[int] = []
    for k, (top, p) in enumerate(zip(tokens, probs)):
        g = guide[k] if k < len(guide) else None
        if rule == "copy":
            if g is None:
                break
            out.append(g)
        elif rule == "copyfirst" and g is not None:
            out.append(g)
        elif rule == "rerank" and g is not None and g in top and p[top.index(g)] >= ratio * p[0]:
            out.append(g)
        else:
            out.append(top[0])
    return out


def walk(
    y: list[int], start: int, choices: dict, props: list[list[int]], rule: str, ratio: float, per_offset: bool
) -> tuple[int, int, int]:
    """Greedy decoding of y replayed from ``start``: (tokens emitted, steps, drafter steps). A step whose text has
    a lookup or store proposal drafts by ``rule`` (the loop today: ``copy``), any other the drafter's argmaxes.
    The guide at offset k is, with ``per_offset``, the proposal for the text up to that offset (a probe per offset;
    the earlier drafts are y's whenever offset k counts), else the chained proposal made at the anchor."""
    a, steps, drafter_steps = start - 1, 0, 0
    while a < len(y) - 1:
        tokens, probs = choices[a]
        room = len(y) - 1 - a
        has_copy = bool(props[a + 1])
        if per_offset and not (rule == "drafter-rerank" and has_copy):
            guide = [props[a + k][0] if props[a + k] else None for k in range(1, min(len(tokens), room) + 1)]
        else:
            guide = list(props[a + 1])

        def run(step_rule: str) -> int:
            drafts = chain(tokens, probs, guide, step_rule, ratio)[:room]
            n = 0
            while n < len(drafts) and drafts[n] == y[a + 1 + n]:
                n += 1
            return n

        if not has_copy:  # the loop's drafter step; "drafter-rerank" re-ranks it with the guide's later offsets
            n = run("rerank" if rule == "drafter-rerank" else "drafter")
            drafter_steps += 1
        elif rule in ("copy", "drafter-rerank"):
            n = run("copy")
        elif rule == "oracle":  # the better of the copy and the drafter's chain, known in advance: a bound
            n = max(run("copy"), run("drafter"))
            drafter_steps += 1
        elif rule == "choose":  # the copy where the drafter gives its first token >= ratio x its argmax's probability
            first = guide[0]
            ok = first in tokens[0] and probs[0][tokens[0].index(first)] >= ratio * probs[0][0]
            n = run("copyfirst" if ok else "drafter")
            drafter_steps += 1
        else:
            n = run(rule)
            drafter_steps += 1
        steps += 1
        a += n + 1
    return len(y) - start, steps, drafter_steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--ratios", default="0,0.1,0.3")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load(drafter=args.drafter)
    ratios = [float(r) for r in args.ratios.split(",")]
    variants = (
        [("copy", 0.0, False), ("copyfirst", 0.0, False), ("copyfirst", 0.0, True), ("oracle", 0.0, False)]
        + [("choose", r, False) for r in ratios]
        + [("drafter-rerank", r, True) for r in ratios]
    )
    B = gen.drafter.block_size
    for name in args.sets.split(","):
        totals: dict[str, list[int]] = {}
        for prompt in load_set(name, limit=args.limit, seed=0):
            ids = gen.encode_prompt(prompt)
            y = ids + gen.generate(ids, max_new_tokens=args.max_new_tokens, use_drafter=False).token_ids  # greedy
            choices = {a: (t, p) for a, t, p in top_choices(gen, y, len(ids) - 1, args.top_k)}
            props = proposals(gen, y, B - 1)
            for rule, ratio, per_offset in variants:
                key = (
                    rule
                    + (f" r{ratio:g}" if rule in ("choose", "drafter-rerank") else "")
                    + (" per-offset" if per_offset else "")
                )
                got = walk(y, len(ids), choices, props, rule, ratio, per_offset)
                acc = totals.setdefault(key, [0, 0, 0])
                for j in range(3):
                    acc[j] += got[j]
        for key, (tokens, steps, drafter_steps) in totals.items():
            print(
                f"{name:10s} {key:26s} tau {tokens / steps:.3f}  steps {steps:5d}  drafter passes "
                f"{drafter_steps / steps:.2f} of steps",
                flush=True,
            )


if __name__ == "__main__":
    main()
