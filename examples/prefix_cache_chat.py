"""A multi-turn chat that reuses the KV cache of its earlier turns: dflashkit's prompt prefix cache.

Chat clients send the whole conversation again at every turn. With a `PrefixCache`, the generator restores the cached
keys and values of the longest prefix it has already seen (the earlier turns and its own answers) and prefills only
the new tokens. This example chats with the default target (the embedded SmolLM2-135M-Instruct) and its shipped
drafter, greedily, and prints each turn's answer, its prompt tokens, the tokens restored from the cache and the
prefill time; with --compare each turn also runs without the cache, to show the prefill it saves and that the answer
is the same (the cache changes speed, not output).

    python examples/prefix_cache_chat.py [--turns 3] [--max-new-tokens 64] [--compare] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch

from dflashkit import PrefixCache, SpeculativeGenerator

TURNS = [
    "Name three uses of a paperclip.",
    "Which of them is the most surprising, and why?",
    "Summarise your answers so far in two sentences.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=len(TURNS), help=f"user turns, at most {len(TURNS)}")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--compare", action="store_true", help="also run each turn without the cache")
    ap.add_argument("--cache-mib", type=float, default=256, help="the cache's memory budget")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    gen = SpeculativeGenerator.load()  # the default target and its shipped drafter
    cache = PrefixCache.of_mib(args.cache_mib)
    messages: list[dict[str, str]] = []
    for turn, user in enumerate(TURNS[: args.turns], 1):
        messages.append({"role": "user", "content": user})
        result = gen.generate(messages, max_new_tokens=args.max_new_tokens, prefix_cache=cache)
        stats = result.stats
        print(f"turn {turn}, user: {user}\nassistant: {result.text.strip()}")
        print(
            f"  {result.prompt_tokens} prompt tokens, {stats.cached_prompt_tokens} restored from the cache, "
            f"prefill {stats.prefill_s * 1000:.0f} ms; {stats.new_tokens} new tokens, τ {stats.tau:.2f}"
        )
        if args.compare:
            plain = gen.generate(messages, max_new_tokens=args.max_new_tokens)
            same = "the same answer" if plain.token_ids == result.token_ids else "a different answer"
            print(f"  without the cache: prefill {plain.stats.prefill_s * 1000:.0f} ms, {same}")
        messages.append({"role": "assistant", "content": result.text})
    print(
        f"cache: {len(cache)} sequences, {cache.nbytes / 2**20:.1f} MiB, {cache.hits} hits, {cache.misses} misses, "
        f"{cache.reused_tokens} tokens restored"
    )


if __name__ == "__main__":
    main()
