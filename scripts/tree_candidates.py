"""Token trees at temperature > 0, by how their candidates are chosen: drawn from the drafter without replacement and
verified by recursive rejection sampling (the default of `--tree` when sampling), the drafter's top choices walked
with the target's own sample (`proposal="argmax"`), and coupled sampling's top choices under the target's noise;
a chain of sampled drafts beside them. One process, interleaved per prompt and seed, a fixed block size (no
adaptive policy to share), no prompt lookup.

    .venv/bin/python scripts/tree_candidates.py [--limit 4] [--seeds 1] [--block-size 2] [--tree 4] [--threads 2]
    .venv/bin/python scripts/tree_candidates.py --default --trees 4,6 --limit 10 --seeds 2
        # what the default would gain: adaptive block size and prompt lookup, chains against sampled-candidate
        # trees (rejection sampler), each variant with its own adaptive policy
    .venv/bin/python scripts/tree_candidates.py --default --sampler both --limit 10 --seeds 2
        # the two samplers' defaults against the same plain sampling: rejection chains, coupled trees
    .venv/bin/python scripts/tree_candidates.py --default --sampler coupled --trees 6 --limit 10 --seeds 2
        # seeded (coupled): chains, trees of 6 whose copied steps stay chains (the default), trees holding the copies

Prints per evaluation set and variant the share of steps whose first drafted position was accepted, τ and the
TPOT speedup over plain sampling (rejection sampler), pooled over the set.
"""

from __future__ import annotations

import argparse

import torch

from dflashkit import SpeculativeGenerator, generator
from dflashkit.decoding.adaptive import BlockPolicies
from dflashkit.training.evalsets import load_set


def variants(tree: int, default: bool = False, trees: str = "", sampler: str = "rejection") -> dict[str, dict]:
    if default and sampler == "both":  # each sampler as generate uses it by default, against plain rejection sampling
        return {
            "plain": {"use_drafter": False, "sampler": "rejection"},
            "plain, coupled": {"use_drafter": False, "sampler": "coupled"},
            "rejection (chains)": {"sampler": "rejection"},
            f"coupled (trees of {generator.COUPLED_TREE})": {"sampler": "coupled"},
        }
    if default:
        return {
            "plain": {"use_drafter": False, "sampler": sampler},
            "default (chains)": {"sampler": sampler, "chains": True},
            **{
                f"trees of {n}, copies as chains": {"sampler": sampler, "tree": int(n), "tree_copies": False}
                for n in trees.split(",")
                if n and sampler == "coupled"
            },
            **{f"default, trees of {n}": {"sampler": sampler, "tree": int(n)} for n in trees.split(",") if n},
        }
    return {
        "plain": {"use_drafter": False, "sampler": "rejection"},
        "chain, sampled": {"sampler": "rejection"},
        "tree, sampled candidates": {"sampler": "rejection", "tree": tree},
        "tree, top choices": {"sampler": "rejection", "tree": tree, "proposal": "argmax"},
        "tree, coupled": {"sampler": "coupled", "tree": tree},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=2, help="verify depth + 1 (2: the anchor's children only)")
    ap.add_argument("--tree", type=int, default=4, help="nodes per tree")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--default",
        action="store_true",
        help="the adaptive block size and prompt lookup (as `generate`), chains against --trees",
    )
    ap.add_argument("--trees", default="4", help="with --default: node budgets of the tree variants")
    ap.add_argument(
        "--sampler",
        choices=("rejection", "coupled", "both"),
        default="rejection",
        help="with --default: every variant's sampler (coupled: what a seeded request gets); both: the "
        "two samplers as generate runs them by default (rejection: chains, coupled: trees)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load()
    gen.warmup()
    runs = variants(args.tree, args.default, args.trees, args.sampler)
    policies = {v: BlockPolicies(gen.drafter.block_size) for v in runs}  # --default: no variant judged by another's
    for name in args.sets.split(","):
        prompts = load_set(name, limit=args.limit, seed=0)
        first = {v: [0, 0] for v in runs}  # steps with the first position accepted, steps that drafted
        tokens = {v: [0, 0, 0.0, 0.0, 0.0] for v in runs}  # new tokens, passes, decode, draft, verify seconds
        for i, prompt in enumerate(prompts):
            for seed in range(args.seeds):
                order = list(runs)[(i + seed) % len(runs) :] + list(runs)[: (i + seed) % len(runs)]
                for variant in order:
                    gen.block_policies = policies[variant]
                    options = (
                        {"block_size": "auto"} if args.default else {"lookup": False, "block_size": args.block_size}
                    ) | runs[variant]
                    # chains where a seeded (coupled) generation would verify trees by default: the generator has
                    # no per-call opt-out with the adaptive block size, so its default is set aside for this call
                    default_tree_nodes = generator.COUPLED_TREE
                    generator.COUPLED_TREE = None if options.pop("chains", False) else default_tree_nodes
                    try:
                        s = gen.generate(
                            prompt,
                            max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature,
                            seed=1000 * i + seed,
                            **options,
                        ).stats
                    finally:
                        generator.COUPLED_TREE = default_tree_nodes
                    drafted = [a for a, d in zip(s.accepted_lengths, s.drafted_lengths) if d > 0]
                    first[variant][0] += sum(a > 0 for a in drafted)
                    first[variant][1] += len(drafted)
                    tokens[variant][0] += s.new_tokens - 1
                    tokens[variant][1] += s.target_forwards - 1
                    tokens[variant][2] += s.decode_s
                    tokens[variant][3] += s.draft_s
                    tokens[variant][4] += s.verify_s
        plain_tpot = tokens["plain"][2] / max(1, tokens["plain"][0])
        setup = (
            f"adaptive block size, prompt lookup, {args.sampler} sampler"
            if args.default
            else f"block {args.block_size}, trees of {args.tree} nodes, no lookup"
        )
        print(f"{name} (T={args.temperature}, {len(prompts)} prompts x {args.seeds} seeds, {setup}):")
        for variant in runs:
            n, passes, seconds, draft, verify = tokens[variant]
            accepted, drafted = first[variant]
            share = f"{accepted / drafted:.3f}" if drafted else "  -  "
            print(
                f"  {variant:26s} first position accepted {share}  τ {n / max(1, passes):.2f}  "
                f"speedup (TPOT) {plain_tpot / (seconds / max(1, n)):.2f}x  step {1e3 * seconds / max(1, passes):.2f} ms "
                f"(draft {1e3 * draft / max(1, passes):.2f}, verify {1e3 * verify / max(1, passes):.2f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
