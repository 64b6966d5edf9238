"""Question files (FastChat format) of training-kind prompts, for `compare_drafters.py --sets jsonl:...`: how a
drafter does on the kinds of prompts it trains on, against the evaluation sets.

    .venv/bin/python scripts/domain_sets.py --prompts STAGED.jsonl --out DIR [--n 64] [--seed 777]
    .venv/bin/python scripts/compare_drafters.py DRAFTER --sets mt-bench,humaneval,math500,jsonl:DIR/magpie.jsonl,\
jsonl:DIR/staged_code.jsonl,jsonl:DIR/staged_other.jsonl --limit 16 --seeds 1

Writes DIR/magpie.jsonl (``--n`` requests of the ``magpie`` source: written by the target itself, seeded) and, from
the single-turn prompts among the last 3,000 lines of ``--prompts`` (a staged list, e.g. the part of
``scripts/device_kit.sh stage``'s list no drafter has trained on), DIR/staged_code.jsonl (code-completion requests)
and DIR/staged_other.jsonl (the rest: school math, ShareGPT turns), ``--n`` each.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from dflashkit.target.loading import load_target
from dflashkit.training import sources as data


def write_questions(path: pathlib.Path, prompts: list[str], category: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i, prompt in enumerate(prompts):
            f.write(json.dumps({"question_id": i, "category": category, "turns": [prompt]}, ensure_ascii=False) + "\n")
    print(f"{path}: {len(prompts)} questions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, help="a JSONL prompt list ({'prompt'} or {'messages'} per line)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=777, help="the magpie requests' seed")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model, tokenizer = load_target()
    answerer = data.Answerer.for_target(model, tokenizer, engine="auto", batch_size=32)
    magpie = data.collect_prompts(
        "magpie",
        args.n,
        seed=args.seed,
        magpie=lambda seed, budget, system: data.magpie_prompts(
            answerer, tokenizer, seed=seed, budget=budget, system=system, progress=True
        ),
    )
    write_questions(out / "magpie.jsonl", magpie.prompts, "magpie")

    lines = pathlib.Path(args.prompts).read_text(encoding="utf-8").splitlines()[-3000:]
    single = [r["prompt"] for r in map(json.loads, lines) if "prompt" in r]  # one user turn, no chat before it
    code = [p for p in single if p.startswith("```") or "Finish this function" in p or "def " in p]
    code_set = set(code)
    other = [p for p in single if p not in code_set]
    write_questions(out / "staged_code.jsonl", code[: args.n], "staged_code")
    write_questions(out / "staged_other.jsonl", other[: args.n], "staged_other")


if __name__ == "__main__":
    main()
