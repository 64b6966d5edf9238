"""Prompt lookup's τ on regenerated greedy answers, without running any model.

For each answer of a `dflashkit data` folder, walk it as the decode loop would: at each step propose the
continuation of the latest earlier occurrence of the longest suffix n-gram (prompt + answer so far), accept
the longest prefix that equals the answer, then take one more token (the target's own). Greedy answers are
the target's greedy decoding, so this is the τ that prompt lookup alone reaches on them (steps without a
match count as plain steps).

    python scripts/lookup_tau.py ~/.cache/dflashkit/data/smollm2-10k --answers 300
"""

from __future__ import annotations

import argparse
import json
import pathlib

from dflashkit.decoding.lookup import NgramLookup


def walk(prompt: list[int], answer: list[int], max_tokens: int, min_n: int, max_n: int) -> tuple[int, int, int, int]:
    """(steps, tokens, steps with a proposal, tokens of those steps) over one answer."""
    index = NgramLookup(prompt, min_n, max_n)
    steps = tokens = copied_steps = copied_tokens = pos = 0
    while pos < len(answer):
        proposal = index.propose(max_tokens)
        accepted = 0
        while (
            accepted < len(proposal) and pos + accepted < len(answer) and proposal[accepted] == answer[pos + accepted]
        ):
            accepted += 1
        taken = min(accepted + 1, len(answer) - pos)
        index.extend(answer[pos : pos + taken])
        steps, tokens, pos = steps + 1, tokens + taken, pos + taken
        if proposal:
            copied_steps, copied_tokens = copied_steps + 1, copied_tokens + taken
    return steps, tokens, copied_steps, copied_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="a `dflashkit data` folder (greedy answers)")
    ap.add_argument("--answers", type=int, default=300)
    args = ap.parse_args()
    records = []
    for shard in sorted(pathlib.Path(args.data).glob("shard-*.jsonl")):
        records += [json.loads(line) for line in shard.open(encoding="utf-8")]
        if len(records) >= args.answers:
            break
    records = records[: args.answers]
    print(f"{len(records)} answers from {args.data}")
    for min_n, max_n in [(1, 3), (2, 4)]:
        for k in (3, 7, 15):
            totals = [0, 0, 0, 0]
            for r in records:
                for i, v in enumerate(walk(r["prompt_ids"], r["response_ids"], k, min_n, max_n)):
                    totals[i] += v
            steps, tokens, cs, ct = totals
            print(
                f"n-grams {min_n}-{max_n}, up to {k:2d} tokens: τ {tokens / steps:.2f}; steps with a match "
                f"{cs / steps:.0%}, τ on those {ct / max(cs, 1):.2f}"
            )


if __name__ == "__main__":
    main()
