"""The drafter's τ by context window, on the evaluation sets' own prompts and on long ones.

    .venv/bin/python scripts/draft_window.py [--drafter DIR] [--windows 0,256,512,768] [--limit 4] [--context-docs 15]
                                             [--sets humaneval,mt-bench,math500] [--long-only]

A long prompt is an evaluation prompt behind other prompts of its set given as "reference material"
(--context-docs of them: ~2.5-3.5K tokens for 15 HumanEval problems or 40 MT-Bench / MATH-500 questions at the
default, scaled per set). Every window decodes the same prompt in turn (block 8, no prompt lookup, greedy, 96
tokens), so the target's text is the same for all of them (checked) and only the drafts differ: τ measures the
drafter alone. Also prints the drafting time per step (milliseconds, median over prompts; machine noise applies).
Window 0 is the whole context.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflashkit.generator import SpeculativeGenerator
from dflashkit.training.evalsets import load_set

SETS = {"humaneval": 1.0, "mt-bench": 8 / 3, "math500": 8 / 3}  # context prompts per --context-docs (shorter prompts)


def long_prompt(prompts: list[str], i: int, docs: int) -> str:
    if not docs:
        return prompts[i]
    reference = "\n\n".join(prompts[(i + 1 + j) % len(prompts)] for j in range(docs))
    return "Here is some reference material:\n\n" + reference + "\n\nNow the actual task:\n\n" + prompts[i]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--windows", default="0,256,512,768")
    ap.add_argument("--limit", type=int, default=4, help="prompts per set and length")
    ap.add_argument("--context-docs", type=int, default=15, help="reference prompts in a long HumanEval prompt")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--long-only", action="store_true", help="only the long prompts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    windows = [int(w) for w in args.windows.split(",")]
    gen = SpeculativeGenerator.load(drafter=args.drafter)
    print(f"drafter's own window: {gen.drafter.config.context_window}; windows {windows} (0: all)")
    for name in args.sets.split(","):
        scale = SETS[name]
        prompts = load_set(name, limit=max(40, args.limit + int(args.context_docs * scale) + 1), seed=1)
        for docs in ((0,) if not args.long_only else ()) + (round(args.context_docs * scale),):
            taus: dict[int, list[float]] = {w: [] for w in windows}
            draft_ms: dict[int, list[float]] = {w: [] for w in windows}
            lengths = []
            for i in range(args.limit):
                prompt = long_prompt(prompts, i, docs)
                lengths.append(len(gen.encode_prompt(prompt, True)))
                texts = set()
                for w in windows:
                    r = gen.generate(
                        prompt, max_new_tokens=args.max_new_tokens, block_size=8, lookup=False, draft_window=w
                    )
                    texts.add(r.text)
                    taus[w].append(r.stats.tau)
                    draft_ms[w].append(1e3 * r.stats.draft_s / max(1, r.stats.steps))
                assert len(texts) == 1, "the output changed with the window: a bug"
            for w in windows:
                print(
                    f"{name:10s} prompts of ~{int(statistics.mean(lengths)):5d} tokens  window {w or 'all':>4}  "
                    f"τ {statistics.mean(taus[w]):.3f} {[round(t, 2) for t in taus[w]]}  "
                    f"draft {statistics.median(draft_ms[w]):.2f} ms/step",
                    flush=True,
                )


if __name__ == "__main__":
    main()
