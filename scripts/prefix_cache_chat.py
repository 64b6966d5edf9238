"""Multi-turn chats with and without the prompt prefix cache, in one process, interleaved.

    .venv/bin/python scripts/prefix_cache_chat.py [--chats 6] [--turns 3] [--max-new-tokens 128] [--threads 2]

Each chat is an MT-Bench question's two turns plus "Summarise your answers so far in two sentences." as a third;
every turn re-sends the whole conversation (as chat clients do). Both modes see the same messages (the uncached
run's answers are the assistant turns); the order of the two modes alternates per chat. Default target and drafter
with the CLI's defaults (adaptive block size, prompt lookup), greedy, bf16. Prints per turn the prompt tokens, the
tokens restored from the cache, the median prefill time (= time to the first token) of each mode and their ratio,
and whether every cached answer equals the uncached one (the first differing position otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflashkit import PrefixCache, SpeculativeGenerator
from dflashkit.bench.datasets import load_questions

FOLLOW_UP = "Summarise your answers so far in two sentences."


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chats", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-mib", type=float, default=256)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load()
    gen.warmup()
    _, questions = load_questions("mt-bench", limit=args.chats, seed=1)
    cache = PrefixCache.of_mib(args.cache_mib)
    options = {"max_new_tokens": args.max_new_tokens, "block_size": "auto", "lookup": True}
    rows: dict[int, dict[str, list]] = {}
    differences = []
    t_all = time.perf_counter()
    for c, question in enumerate(questions):
        turns = [*question.turns, FOLLOW_UP][: args.turns]
        messages: list[dict[str, str]] = []
        for t, user in enumerate(turns):
            messages.append({"role": "user", "content": user})
            runs = {}
            for mode in ("uncached", "cached") if c % 2 == 0 else ("cached", "uncached"):
                t0 = time.perf_counter()
                result = gen.generate(messages, prefix_cache=cache if mode == "cached" else None, **options)
                runs[mode] = (result, time.perf_counter() - t0)
            row = rows.setdefault(
                t,
                {
                    "prompt": [],
                    "cached_tokens": [],
                    "prefill": [],
                    "prefill_cached": [],
                    "total": [],
                    "total_cached": [],
                    "same": [],
                },
            )
            plain, cached = runs["uncached"][0], runs["cached"][0]
            row["prompt"].append(plain.prompt_tokens)
            row["cached_tokens"].append(cached.stats.cached_prompt_tokens)
            row["prefill"].append(plain.stats.prefill_s)
            row["prefill_cached"].append(cached.stats.prefill_s)
            row["total"].append(runs["uncached"][1])
            row["total_cached"].append(runs["cached"][1])
            same = cached.token_ids == plain.token_ids
            row["same"].append(same)
            if not same:
                differences.append((c, t, first_difference(cached.token_ids, plain.token_ids)))
            messages.append({"role": "assistant", "content": plain.text})
        print(f"chat {c + 1}/{len(questions)} done ({time.perf_counter() - t_all:.0f} s)", flush=True)

    med = statistics.median
    print(
        f"\n{len(questions)} chats x {args.turns} turns, max_new_tokens {args.max_new_tokens}, greedy, "
        f"{gen.target.dtype}, {torch.get_num_threads()} threads; engine: {gen.target.engine}"
    )
    print(
        "| turn | prompt tokens (median) | restored (median) | prefill uncached | prefill cached | ratio | "
        "turn wall time uncached / cached | identical |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|---|")
    for t, r in rows.items():
        ratios = [a / b for a, b in zip(r["prefill"], r["prefill_cached"])]
        print(
            f"| {t + 1} | {med(r['prompt']):.0f} | {med(r['cached_tokens']):.0f} | {1000 * med(r['prefill']):.0f} ms "
            f"| {1000 * med(r['prefill_cached']):.0f} ms | {med(ratios):.1f}x | {med(r['total']):.2f} / "
            f"{med(r['total_cached']):.2f} s | {sum(r['same'])}/{len(r['same'])} |"
        )
    print(
        f"prefix cache: {len(cache)} sequences, {cache.nbytes / 2**20:.1f} MiB, {cache.hits} hits, "
        f"{cache.misses} misses, {cache.reused_tokens} tokens restored"
    )
    for c, t, at in differences:
        print(f"chat {c + 1} turn {t + 1}: cached and uncached answers differ from token {at}")


if __name__ == "__main__":
    main()
