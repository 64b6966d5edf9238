"""Compare drafters on the same prompts by acceptance alone (no timing, so the figures do not depend on the machine).

For each drafter and evaluation set, with the drafter's own drafts only (no prompt lookup), prints greedy τ (tokens
per target pass) at block 16 and at block 4, T=1 τ at block 4 over --seeds seeds, and the mean probability that its
first draft is accepted at T=1 (sum_x min(p(x), q(x)), p the target's and q the drafter's distribution). Use it to
decide whether a newly trained drafter beats the shipped one; --sets also takes any bench data set (jsonl:PATH...).

    python scripts/compare_drafters.py auto NEW_DRAFTER [--limit 12] [--seeds 3] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dflashkit.generator import SpeculativeGenerator


def first_draft_acceptance(gen: SpeculativeGenerator, prompts: list, seeds: int, max_new: int) -> tuple[float, float]:
    """(T=1 τ at block 4, mean sum min(p, q) of the first draft position) over prompts x seeds."""
    from dflashkit.decoding.sampling import SamplingParams, warp

    t1 = SamplingParams(temperature=1.0)
    drafter = gen.drafter
    inner = drafter.draft_scores
    pending: list = []  # [scores [k, V'], columns] of the step whose verify pass comes next
    overlaps: list[float] = []

    def recording_draft_scores(*args, **kwargs):
        scores, columns = inner(*args, **kwargs)
        pending[:] = [scores.float(), columns]
        return scores, columns

    def observer(logits, emitted) -> None:  # after every target pass
        if pending and logits.shape[0] == pending[0].shape[0] + 1:
            scores, columns = pending
            p = warp(logits[0:1].float(), t1)[0]  # the target at the first draft position
            q = warp(scores[0:1], t1)[0]
            overlaps.append(float(torch.minimum(p[columns] if columns is not None else p, q).sum()))
        pending.clear()

    drafter.draft_scores = recording_draft_scores
    tokens = passes = 0
    try:
        for prompt in prompts:
            for seed in range(seeds):
                stats = gen.generate(
                    prompt,
                    max_new_tokens=max_new,
                    temperature=1.0,
                    seed=seed,
                    block_size=4,
                    lookup=False,
                    observer=observer,
                ).stats
                tokens, passes = tokens + stats.new_tokens - 1, passes + stats.target_forwards - 1
    finally:
        del drafter.draft_scores
    return tokens / max(passes, 1), sum(overlaps) / max(len(overlaps), 1)


def greedy_tau(gen: SpeculativeGenerator, prompts: list, block: int, max_new: int) -> float:
    tokens = passes = 0
    for prompt in prompts:
        stats = gen.generate(prompt, max_new_tokens=max_new, temperature=0, block_size=block, lookup=False).stats
        tokens, passes = tokens + stats.new_tokens - 1, passes + stats.target_forwards - 1  # after the prefill
    return tokens / max(passes, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="+", help="drafter folders (auto: the shipped one)")
    ap.add_argument(
        "--sets",
        default="mt-bench,humaneval,math500",
        help="comma-separated: the packaged sets, or any bench data set (jsonl:PATH, hf:NAME...)",
    )
    ap.add_argument("--limit", type=int, default=12, help="prompts per set (seeded subset, as the bench)")
    ap.add_argument("--seeds", type=int, default=3, help="sampling seeds per prompt at T=1")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    from dflashkit.bench.datasets import PACKAGED, load_questions
    from dflashkit.generator import SpeculativeGenerator
    from dflashkit.training.evalsets import load_set

    if args.threads:
        torch.set_num_threads(args.threads)
    sets = {}
    for spec in args.sets.split(","):  # the packaged sets; any other bench data set by its questions' first turns
        if spec in PACKAGED:
            sets[spec] = load_set(spec, limit=args.limit, seed=0)
        else:
            name, questions = load_questions(spec, limit=args.limit, seed=0)
            sets[name] = [q.turns[0] for q in questions]
    results: dict = {}
    for path in args.drafters:
        gen = SpeculativeGenerator.load(drafter=path)
        gen.warmup()
        for name, prompts in sets.items():
            t1_tau, overlap = first_draft_acceptance(gen, prompts, args.seeds, args.max_new_tokens)
            row = {"greedy_tau_b16": greedy_tau(gen, prompts, 16, args.max_new_tokens),
                   "greedy_tau_b4": greedy_tau(gen, prompts, 4, args.max_new_tokens),
                   "t1_tau_b4": t1_tau, "t1_first_draft_acceptance": overlap}  # fmt: skip
            results.setdefault(path, {})[name] = row
            print(f"{path}  {name:10s}  " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
