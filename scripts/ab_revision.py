"""Interleaved A/B of the decode loop against another git revision, in one process: the speed check of a refactor.

    python scripts/ab_revision.py --base HEAD~1                    # this working tree against the previous commit
    python scripts/ab_revision.py --base v0.1.0 --rounds 5 --modes greedy-b16,plain

The base revision's ``dflashkit/`` is exported (``git archive``) into a temporary folder as the package
``dflashkit_base`` (its absolute imports rewritten to that name), and both versions load the default target with its
shipped drafter. Each prompt then runs in every mode with both versions back to back, the order alternating, after a
warm-up; the table gives median decode tokens per second (prefill excluded), the median of the per-pair ratios with
its interquartile range, and how many outputs were token for token the same. Both versions share the compiled row
kernels when their sources are equal. Which version loads its models first can favour one by a few percent (a
revision against itself: 2-4% either way), so judge a change from runs with both ``--load-first`` orders.
Modes: greedy-b16 (a fixed block: the same work in both), greedy-auto and t1-seed-auto (the adaptive block size,
which follows measured step times), plain (no drafter).
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Write a haiku about the sea.",
    "Explain speculative decoding in two sentences.",
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give me three tips for learning to play the guitar.",
    "Solve: if 3x + 7 = 22, what is x? Show your steps.",
    "Write a short story about a robot who learns to paint.",
    "List the planets of the solar system in order from the sun.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Write a SQL query that returns the ten most recent orders.",
    "Summarize the causes of the French Revolution.",
    "What is the derivative of x^3 * sin(x)?",
]
MODES = {
    "greedy-b16": {"block_size": 16},
    "greedy-auto": {},
    "t1-seed-auto": {"temperature": 1.0, "seed": 7},
    "plain": None,  # no drafter
}


def export_base(revision: str, into: Path) -> None:
    """``git archive`` the revision's dflashkit/ into ``into``/dflashkit_base, imports renamed."""
    archive = subprocess.run(["git", "archive", revision, "dflashkit"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    (into / "dflashkit").rename(into / "dflashkit_base")
    pattern = re.compile(r"^(\s*)(from|import) dflashkit(?=[.\s])", re.M)
    for path in (into / "dflashkit_base").rglob("*.py"):
        text = path.read_text()
        path.write_text(pattern.sub(r"\1\2 dflashkit_base", text))


def run(generator, prompt: str, mode: str, max_new_tokens: int):
    kwargs = MODES[mode]
    if kwargs is None:
        drafter, generator.drafter = generator.drafter, None
        try:
            return generator.generate(prompt, max_new_tokens=max_new_tokens)
        finally:
            generator.drafter = drafter
    return generator.generate(prompt, max_new_tokens=max_new_tokens, **kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--base", default="HEAD", help="git revision to compare the working tree against")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many prompts (at most {len(PROMPTS)})")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--load-first",
        choices=("base", "tree"),
        default="base",
        help="which version loads its models first (the order can favour one by a few percent: run both)",
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not 1 <= args.prompts <= len(PROMPTS) or args.rounds < 1:
        parser.error(f"unknown modes {unknown}" if unknown else "--prompts and --rounds must be in range")

    import torch

    torch.set_num_threads(args.threads)
    folder = tempfile.TemporaryDirectory(prefix="dflashkit-ab-")
    export_base(args.base, Path(folder.name))
    sys.path.insert(0, folder.name)
    packages = {"base": "dflashkit_base", "tree": "dflashkit"}
    order = ("base", "tree") if args.load_first == "base" else ("tree", "base")
    gens = {name: importlib.import_module(packages[name]).SpeculativeGenerator.load() for name in order}
    prompts = PROMPTS[: args.prompts]
    for gen in gens.values():  # warm-up: kernels, caches, the adaptive policies' first estimates
        for mode in modes:
            run(gen, prompts[0], mode, 32)
    speed = {(v, m): [] for v in gens for m in modes}
    same = dict.fromkeys(modes, 0)
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for mode in modes:
                tokens = {}
                for v in ("base", "tree") if (r + i) % 2 == 0 else ("tree", "base"):
                    result = run(gens[v], prompt, mode, args.max_new_tokens)
                    speed[(v, mode)].append(result.stats.new_tokens / result.stats.decode_s)
                    tokens[v] = result.token_ids
                same[mode] += tokens["base"] == tokens["tree"]
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(
        f"base {args.base} vs the working tree, {len(prompts)} prompts x {args.rounds} rounds, "
        f"{args.load_first} loaded first, {time.ctime()}"
    )
    print("| mode | base tok/s | tree tok/s | tree/base (IQR) | identical |")
    print("|---|---:|---:|---:|---:|")
    for mode in modes:
        base, tree = speed[("base", mode)], speed[("tree", mode)]
        ratios = [b / a for a, b in zip(base, tree)]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        print(
            f"| {mode} | {statistics.median(base):.1f} | {statistics.median(tree):.1f} | "
            f"{statistics.median(ratios):.3f} ({q1:.3f}-{q3:.3f}) | {same[mode]}/{len(ratios)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
