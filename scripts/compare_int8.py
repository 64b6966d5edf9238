"""The bf16 target against its weight-only int8 version (``--quantize int8``), plain and speculative decoding, in one
process, interleaved per prompt (the order alternates), after one warm-up generation each.

    .venv/bin/python scripts/compare_int8.py [--limit 2] [--max-new-tokens 128] [--threads 2]

Prompts: the README prompt plus --limit prompts of each evaluation set. Speculative runs use the defaults of
`dflashkit generate` (adaptive block size, prompt lookup). Prints each prompt's tokens/s and the medians; checks
that each target's speculative output equals its own plain output.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflashkit import SpeculativeGenerator
from dflashkit.training.evalsets import load_set


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gens = {"bf16": SpeculativeGenerator.load(), "int8": SpeculativeGenerator.load(quantize="int8")}
    prompts = ["Explain speculative decoding in two sentences."]
    for name in ("mt-bench", "humaneval", "math500"):
        prompts += load_set(name, limit=args.limit)
    for gen in gens.values():
        gen.generate(prompts[0], max_new_tokens=32, block_size="auto", lookup=True)
    print(f"engine: {gens['int8'].target.engine}")
    rates: dict[str, list[float]] = {}
    for i, prompt in enumerate(prompts):
        for weights in ("bf16", "int8") if i % 2 else ("int8", "bf16"):
            gen = gens[weights]
            plain = gen.generate(prompt, max_new_tokens=args.max_new_tokens, use_drafter=False)
            spec = gen.generate(prompt, max_new_tokens=args.max_new_tokens, block_size="auto", lookup=True)
            if spec.token_ids != plain.token_ids:
                print(f"  prompt {i}, {weights}: speculative output differs from plain decoding")
            rates.setdefault(f"{weights} plain", []).append(plain.stats.tokens_per_s)
            rates.setdefault(f"{weights} speculative", []).append(spec.stats.tokens_per_s)
        print(f"prompt {i}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in sorted(rates.items())) + " tok/s", flush=True)
    print("median tok/s: " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in sorted(rates.items())))


if __name__ == "__main__":
    main()
