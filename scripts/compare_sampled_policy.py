"""The adaptive block size's variants, one process, interleaved per prompt: the default policies (at T>0 the
sampled regime's: blocks <= 4, copies <= 3, copy lengths by their own policy), the greedy regime's sizes for
sampled requests (blocks <= 16), copies always as long as the largest block (no copy policy), a fixed block 4.

    .venv/bin/python scripts/compare_sampled_policy.py [--limit 8] [--temperature 1.0] [--threads 2]
    .venv/bin/python scripts/compare_sampled_policy.py --temperature 0     # greedy requests
    .venv/bin/python scripts/compare_sampled_policy.py --temperature 0 --fresh --baseline-ref 4d5fe1b~1
        # one-shot runs (a fresh policy per prompt, as `dflashkit generate` has), against the policy of a git revision

Prints, per evaluation set, the median tokens/s and mean τ of each variant and the median per-prompt speedup
over plain sampling (prompt lookup on in every speculative variant, as `dflashkit generate` does by default).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from dflashkit import SpeculativeGenerator
from dflashkit.decoding.adaptive import BlockPolicies
from dflashkit.training.evalsets import load_set


def policies_at(ref: str, scratch: Path) -> type[BlockPolicies]:
    """BlockPolicies as dflashkit/adaptive.py defined it at git revision ``ref`` (to measure a change against); the
    file is written to ``scratch`` and imported from there."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.check_output(["git", "show", f"{ref}:dflashkit/adaptive.py"], cwd=root, text=True)
    path = scratch / "adaptive_at_ref.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("adaptive_at_ref", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BlockPolicies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="a fresh policy for every prompt (a one-shot CLI run), instead of one carried across prompts",
    )
    ap.add_argument(
        "--baseline-ref",
        default=None,
        help="also run the default policy as defined at this git revision (variant 'at-REF')",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load()
    gen.warmup()
    block = gen.drafter.block_size

    def longest_copies() -> BlockPolicies:
        policies = BlockPolicies(block)
        for greedy in (True, False):
            policies.get(greedy).copies = None
        return policies

    factories = {"default": lambda: BlockPolicies(block), "longest-copies": longest_copies}
    if args.temperature > 0:
        factories["greedy-sizes"] = lambda: BlockPolicies(block, sampled_max_block=block)
    if args.baseline_ref:
        with tempfile.TemporaryDirectory() as scratch:
            baseline = policies_at(args.baseline_ref, Path(scratch))
        factories[f"at-{args.baseline_ref}"] = lambda: baseline(block)
    policies = {name: make() for name, make in factories.items()}
    variants = (*policies, "block-4", "plain")
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for name in args.sets.split(","):
        for i, prompt in enumerate(load_set(name, limit=args.limit)):
            for v in variants[i % len(variants) :] + variants[: i % len(variants)]:  # rotate the order per prompt
                if v in policies:
                    if args.fresh:
                        policies[v] = factories[v]()
                    gen.block_policies = policies[v]  # each variant's estimates carry over between its prompts
                kw = (
                    {"use_drafter": False}
                    if v == "plain"
                    else {"lookup": True, "block_size": 4 if v == "block-4" else "auto"}
                )
                stats = gen.generate(
                    prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=i, **kw
                ).stats
                results.setdefault((name, v), []).append((stats.new_tokens / stats.decode_s, stats.tau))
    for name in args.sets.split(","):
        plain = results[(name, "plain")]
        cells = []
        for v in variants:
            rows = results[(name, v)]
            speedup = statistics.median(a[0] / b[0] for a, b in zip(rows, plain))
            cells.append(
                f"{v} {statistics.median(r[0] for r in rows):.1f} tok/s τ {statistics.mean(r[1] for r in rows):.2f}"
                f" x{speedup:.2f}"
            )
        print(f"{name}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
