"""Structured output: speculative vs plain decoding under a grammar, interleaved in one process.

    .venv/bin/python scripts/grammar_speed.py [--rounds 3] [--max-new-tokens 96] [--threads 2]

For each prompt (JSON extraction tasks with a schema, and free prompts with "any JSON object"), each round runs
speculative decoding (the shipped drafter, the CLI's defaults: adaptive block size, prompt lookup) and plain
decoding, both constrained to the grammar, then both unconstrained; prints decoding tokens/s (after the prefill,
median over rounds; outputs are short, so prefill would weigh more on the shorter ones), τ, whether the
constrained speculative output equals the plain one, and whether the text parses as JSON and fits the schema.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from dflashkit import Grammar, SpeculativeGenerator

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SENTIMENT = {
    "type": "object",
    "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}, "reason": {"type": "string"}},
    "required": ["sentiment", "reason"],
    "additionalProperties": False,
}
CASES = [
    ("Extract the person as JSON: Maria Lopez is 34 and lives in Madrid.", Grammar.json_schema(PERSON), PERSON),
    ("Extract the person as JSON: Tom, aged 61, moved to Oslo last year.", Grammar.json_schema(PERSON), PERSON),
    ("Classify the review as JSON. Review: The battery died after two days.", Grammar.json_schema(SENTIMENT),
     SENTIMENT),
    ("Classify the review as JSON. Review: Lovely staff and a quiet room.", Grammar.json_schema(SENTIMENT), SENTIMENT),
    ("Describe a cat as a JSON object.", Grammar.json_object(), None),
    ("Give three facts about Mars as JSON.", Grammar.json_object(), None),
]


def fits(text: str, schema: dict | None) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if schema is None:
        return isinstance(value, dict)
    return set(value) == set(schema["required"]) and all(
        (isinstance(value[k], str) if spec.get("type") == "string" else
         isinstance(value[k], int) if spec.get("type") == "integer" else value[k] in spec.get("enum", [value[k]]))
        for k, spec in schema["properties"].items())  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load()
    gen.warmup()
    common = {"max_new_tokens": args.max_new_tokens, "block_size": "auto", "lookup": True}
    rows, free_rows = [], []
    for prompt, grammar, schema in CASES:
        speeds: dict[str, list[float]] = {"spec": [], "plain": [], "free_spec": [], "free_plain": []}
        taus = []
        for _ in range(args.rounds):
            spec = gen.generate(prompt, grammar=grammar, **common)
            plain = gen.generate(prompt, grammar=grammar, use_drafter=False, max_new_tokens=args.max_new_tokens)
            free = gen.generate(prompt, **common)
            free_plain = gen.generate(prompt, use_drafter=False, max_new_tokens=args.max_new_tokens)
            for key, r in (("spec", spec), ("plain", plain), ("free_spec", free), ("free_plain", free_plain)):
                speeds[key].append(len(r.token_ids) / r.stats.decode_s)
            taus.append(spec.stats.tau)
        med = {k: statistics.median(v) for k, v in speeds.items()}
        rows.append(med["spec"] / med["plain"])
        free_rows.append(med["free_spec"] / med["free_plain"])
        print(f"{grammar.kind:11s} {len(spec.token_ids):3d} tok  spec {med['spec']:5.1f} tok/s (τ {statistics.median(taus):.2f})"
              f"  plain {med['plain']:5.1f}  speedup {rows[-1]:.2f}x | unconstrained {len(free.token_ids):3d} tok: "
              f"spec {med['free_spec']:5.1f} plain {med['free_plain']:5.1f} speedup {free_rows[-1]:.2f}x | identical "
              f"{spec.token_ids == plain.token_ids}  fits {fits(spec.text, schema)}  finish {spec.finish_reason}  "
              f"{spec.text[:60]!r}", flush=True)  # fmt: skip
    print(f"median speedup over plain decoding: {statistics.median(free_rows):.2f}x unconstrained, "
          f"{statistics.median(rows):.2f}x under a grammar ({len(rows)} prompts)")


if __name__ == "__main__":
    main()
