"""Training-data regeneration on this machine: continuous batching (the fast forward) against transformers' decoder
in static batches, on the same prompts, in one process, the order alternating per round.

    .venv/bin/python scripts/data_speed.py [--prompts 128] [--rounds 2] [--continuous-batch 64] [--batches-batch 32]

Each run is `dflashkit.training.sources.regenerate` into a fresh temporary folder (the embedded target, bf16, greedy,
at most 192
new tokens, prompts of at most 512 tokens from `sharegpt:0.8,math:0.2`). Prints each run's response tokens per
second (the prefills included), their medians and ratio, and how many answers the two engines share token for token
(in bf16 the two decoders round differently, so long greedy answers can part at near-ties; the prefix they share is
printed too).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from dflashkit.target.loading import load_target
from dflashkit.training import sources as data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--continuous-batch", type=int, default=64, help="prompts decoding at once (continuous)")
    ap.add_argument("--batches-batch", type=int, default=32, help="prompts per static batch (batches)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_target()
    prompts = data.collect_prompts("sharegpt:0.8,math:0.2", n=args.prompts, seed=21).prompts
    batch = {"continuous": args.continuous_batch, "batches": args.batches_batch}
    rates: dict[str, list[float]] = {engine: [] for engine in batch}
    answers: dict[str, dict[int, list[int]]] = {}
    for r in range(args.rounds):
        order = ["continuous", "batches"] if r % 2 == 0 else ["batches", "continuous"]
        for engine in order:
            with tempfile.TemporaryDirectory() as out:
                summary = data.regenerate(
                    model,
                    tokenizer,
                    prompts,
                    out,
                    batch_size=batch[engine],
                    max_new_tokens=args.max_new_tokens,
                    shard_size=len(prompts),
                    progress=False,
                    engine=engine,
                )
                answers[engine] = {rec["id"]: rec["response_ids"] for rec in data.load_shards(out)}
            rates[engine].append(summary["run_tokens_per_s"])
            print(
                f"round {r} {engine} (batch {batch[engine]}): {summary['run_response_tokens']} tokens, "
                f"{summary['run_seconds']:.1f} s, {summary['run_tokens_per_s']:.1f} tok/s",
                flush=True,
            )
    a, b = answers["continuous"], answers["batches"]
    same = sum(a[i] == b[i] for i in a)
    shared = []
    for i in a:
        n = next((k for k, (x, y) in enumerate(zip(a[i], b[i])) if x != y), min(len(a[i]), len(b[i])))
        shared.append(n / max(len(a[i]), len(b[i]), 1))
    cont, stat = statistics.median(rates["continuous"]), statistics.median(rates["batches"])
    print(f"\n{len(a)} answers, {args.rounds} rounds, {args.threads} threads, greedy bf16")
    print(
        f"continuous (batch {args.continuous_batch}): {cont:.1f} tok/s; batches (batch {args.batches_batch}): "
        f"{stat:.1f} tok/s; continuous / batches {cont / stat:.2f}x (medians)"
    )
    print(f"identical answers: {same}/{len(a)}; mean shared prefix {100 * statistics.mean(shared):.1f}% of the answer")


if __name__ == "__main__":
    main()
