"""Estimate lookup steps that also verify the drafter's chain (a two-branch tree: the copied chain and the drafter's),
against today's copy-only steps, from the target's greedy answers, without decoding speculatively.

    .venv/bin/python scripts/hybrid_lookup_estimate.py [--limit 12] [--threads 2]

For each evaluation set the target answers greedily alone (its tokens y); the drafter's chain match at every anchor
is computed teacher-forced as in tree_estimate.py (the rank-0 prefix of y's ranks); then each policy walks the
answer as the decode loop would, with prompt lookup and the shipped n-gram store: where lookup proposes, a copy-only
step accepts the copy's match and a hybrid step the longer of the copy's and the drafter's (at most its draft
length); elsewhere a drafter step of block b. Time is modelled per step: a target pass of that many rows (--costs,
interpolated; the default: this VM's `scripts/step_cost.py` medians, session 36) plus the drafter's pass
(--draft-ms) where it runs.
Prints per set the best copy-only setting and the best settings overall by modelled ms per token.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from tree_estimate import rank_paths

from dflashkit.decoding.lookup import NgramLookup
from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.generator import SpeculativeGenerator
from dflashkit.training.evalsets import load_set


def match(proposal: list[int], tokens: list[int], at: int) -> int:
    """Leading tokens of `proposal` equal to tokens[at:]."""
    n = 0
    while n < len(proposal) and at + n < len(tokens) and proposal[n] == tokens[at + n]:
        n += 1
    return n


def walk(
    answers: list, store, copy: int, draft: int, block: int, hybrid: bool, cost, draft_ms: float
) -> tuple[float, float]:
    """(tokens per step, modelled ms per token) over the answers: [(prompt ids, answer ids, drafter chain match per
    anchor)]."""
    steps = tokens = ms = 0.0
    for prompt, answer, chain in answers:
        full = prompt + answer
        pos = len(prompt)  # the anchor: the prefill emitted answer[0]
        lookup = NgramLookup(full[: pos + 1], store=store)
        while pos < len(full) - 1:
            drafted = chain[pos - len(prompt)]
            proposal = lookup.propose(copy)
            if proposal:
                copied = match(proposal, full, pos + 1)
                if hybrid:
                    accepted = max(copied, min(drafted, draft))
                    ms += cost(1 + len(proposal) + draft) + draft_ms
                else:
                    accepted = copied
                    ms += cost(1 + len(proposal))
            else:
                accepted = min(drafted, block - 1)
                ms += cost(block) + draft_ms
            emitted = full[pos + 1 : pos + 2 + accepted]
            lookup.extend(emitted)
            pos, steps, tokens = pos + len(emitted), steps + 1, tokens + len(emitted)
    return tokens / steps, ms / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--costs",
        default="1:10.55,4:10.69,8:13.11,12:14.96,16:18.26",
        help="rows:ms of a target pass (interpolated between)",
    )
    ap.add_argument("--draft-ms", type=float, default=1.7, help="the drafter's pass")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    points = sorted((int(r), float(t)) for r, t in (c.split(":") for c in args.costs.split(",")))
    cost = lambda rows: float(np.interp(rows, [p[0] for p in points], [p[1] for p in points]))  # noqa: E731
    gen = SpeculativeGenerator.load()
    store = gen.drafter.ngram_store
    for name in ("mt-bench", "humaneval", "math500"):
        answers = []
        for prompt in load_set(name, limit=args.limit, seed=0):
            ids = gen.encode_prompt(prompt)
            options = DecodeOptions(max_new_tokens=args.max_new_tokens, stop_token_ids=frozenset(gen.eos_token_ids))
            answer = [t for step in decode(gen.target, None, ids, options) for t in step.tokens]
            paths, _ = rank_paths(gen, ids + answer, len(ids))
            answers.append((ids, answer, [next((j for j, r in enumerate(p) if r != 0), len(p)) for p in paths]))
        rows = []
        for block in (4, 8, 12, 16):
            for copy in (3, 7, 11, 15):
                rows.append(
                    (*walk(answers, store, copy, 0, block, False, cost, args.draft_ms), f"copy {copy} b{block}")
                )
                for draft in (1, 2, 3, 4, 7, 15):
                    if 1 + copy + draft <= 16 or (copy, draft) == (15, 15):
                        rows.append(
                            (
                                *walk(answers, store, copy, draft, block, True, cost, args.draft_ms),
                                f"hybrid copy {copy} + draft {draft}, b{block}",
                            )
                        )
        best_copy = min((r for r in rows if r[2].startswith("copy")), key=lambda r: r[1])
        print(f"{name}: best copy-only {best_copy[2]}: τ {best_copy[0]:.3f}, {best_copy[1]:.2f} ms/token", flush=True)
        for tau, ms, label in sorted(rows, key=lambda r: r[1])[:4]:
            print(f"    {label:34s} τ {tau:.3f}  {ms:.2f} ms/token  ({best_copy[1] / ms:.3f}x)", flush=True)
        widest = next(r for r in rows if r[2] == "hybrid copy 15 + draft 15, b16")
        plain16 = next(r for r in rows if r[2] == "copy 15 b16")
        print(
            f"    at block 16: copy-only τ {plain16[0]:.3f}, hybrid 15 + 15 τ {widest[0]:.3f} "
            "(31-row passes: on this CPU they leave the row kernels, ~55 ms)",
            flush=True,
        )


if __name__ == "__main__":
    main()
