"""Prompt lookup with and without the drafter's n-gram store, interleaved per prompt, against plain decoding.

    .venv/bin/dflashkit ngram-store --data D1,D2,... --out DRAFTER      # a drafter folder with a store
    .venv/bin/python scripts/compare_ngram_store.py --drafter DRAFTER [--temperatures 0,1] [--limit 4]

Prints, per evaluation set and temperature, each configuration's speedup (plain decode time per token / its
own, prefill excluded, means over the prompts) and τ, how many copied steps the store drafted, and (block 4 with
the store) the τ of the store's steps against the τ of the drafter's own steps.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflashkit.generator import SpeculativeGenerator
from dflashkit.training.evalsets import load_set

CONFIGS = {
    "plain": {"use_drafter": False},
    "lookup-auto": {"block_size": "auto", "lookup": True, "ngram_store": False},
    "lookup-auto+store": {"block_size": "auto", "lookup": True},
    "lookup-b4": {"block_size": 4, "lookup": True, "ngram_store": False},
    "lookup-b4+store": {"block_size": 4, "lookup": True},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True, help="drafter folder with an ngram_store.safetensors")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--limit", type=int, default=4, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load(drafter=args.drafter)
    if gen.drafter.ngram_store is None:
        raise SystemExit(f"{args.drafter} has no n-gram store: build one with `dflashkit ngram-store`")
    gen.warmup()
    names = list(CONFIGS)
    for dataset in ("mt-bench", "humaneval", "math500"):
        prompts = load_set(dataset, limit=args.limit, seed=0)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            tpot = {m: [] for m in names}
            tau = {m: [] for m in names}
            store_steps = copied_steps = 0
            kinds = {"store": [0, 0.0], "drafter": [0, 0.0]}  # block 4 + store: steps, tokens of each kind
            for i, prompt in enumerate(prompts):
                for seed in range(2 if temperature > 0 else 1):
                    turn = (i + seed) % len(names)
                    for name in names[turn:] + names[:turn]:  # a rotating order
                        r = gen.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=temperature,
                                         seed=seed, **CONFIGS[name])  # fmt: skip
                        tpot[name].append(r.stats.decode_s / max(1, r.stats.new_tokens - 1))
                        tau[name].append(r.stats.tau)
                        summary = r.stats.lookup_summary()
                        if name == "lookup-auto+store":
                            store_steps += summary["store_steps"]
                            copied_steps += summary["copied_steps"]
                        if name == "lookup-b4+store":
                            for kind, acc in kinds.items():
                                acc[0] += summary[f"{kind}_steps"]
                                acc[1] += summary[f"{kind}_steps"] * (summary[f"{kind}_tau"] or 0.0)
            plain = statistics.mean(tpot["plain"])
            cells = [f"{m} {plain / statistics.mean(tpot[m]):.2f}x τ {statistics.mean(tau[m]):.2f}" for m in names[1:]]
            taus = ", ".join(f"{kind} steps τ {tok / steps:.2f}" for kind, (steps, tok) in kinds.items() if steps)
            print(
                f"{dataset} T={temperature:g}: "
                + " | ".join(cells)
                + f" | store drafted {store_steps} of {copied_steps} copied steps | block 4: {taus}",
                flush=True,
            )


if __name__ == "__main__":
    main()
