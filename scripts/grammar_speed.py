"""Structured output: speculative vs plain decoding under a grammar, interleaved in one process.

    .venv/bin/python scripts/grammar_speed.py [--rounds 3] [--max-new-tokens 96] [--threads 2]

For each prompt (JSON extraction tasks with a schema, and free prompts with "any JSON object"), each round runs
speculative decoding (the shipped drafter, the CLI's defaults: adaptive block size, prompt lookup) and plain
decoding, both constrained to the grammar, then both unconstrained; prints decoding tokens/s (after the prefill,
median over rounds; outputs are short, so prefill would weigh more on the shorter ones), τ, whether the
constrained speculative output equals the plain one, and whether the text parses as JSON and fits the schema.

With --llama-server, llama-server on the target's bf16 GGUF decodes the same prompt ids under the same schema
(its `json_schema` field; "any JSON object" as {"type": "object"}), greedy, in the same rounds; its tok/s is its
own `predicted_per_second` (generation after the first token, measured inside the server). Its grammar engine
allows other whitespace than dflashkit's, so its text may differ; only speeds are compared.
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
    (
        "Classify the review as JSON. Review: The battery died after two days.",
        Grammar.json_schema(SENTIMENT),
        SENTIMENT,
    ),
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
    ap.add_argument("--llama-server", action="store_true", help="also time llama-server (bf16 GGUF) under the schema")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load()
    gen.warmup()
    common = {"max_new_tokens": args.max_new_tokens, "block_size": "auto", "lookup": True}
    llama = None
    if args.llama_server:
        from dflashkit.bench.assets import target_bf16_gguf
        from dflashkit.interop.llama_server import LlamaServer, find_llama_server

        binary, (gguf, why) = find_llama_server(), target_bf16_gguf(None)
        if binary is None or gguf is None:
            raise SystemExit(f"--llama-server: {why or 'no llama-server binary'}")
        llama = LlamaServer(binary, gguf, threads=args.threads or torch.get_num_threads()).start()
    rows, free_rows, llama_rows = [], [], []
    for prompt, grammar, schema in CASES:
        speeds: dict[str, list[float]] = {"spec": [], "plain": [], "free_spec": [], "free_plain": [], "llama": []}
        taus = []
        ids = gen.encode_prompt(prompt)
        for _ in range(args.rounds):
            if llama is not None:
                c = llama.complete(ids, args.max_new_tokens, extra={"json_schema": schema or {"type": "object"}})
                speeds["llama"].append(float(c.timings["predicted_per_second"]))
            spec = gen.generate(prompt, grammar=grammar, **common)
            plain = gen.generate(prompt, grammar=grammar, use_drafter=False, max_new_tokens=args.max_new_tokens)
            free = gen.generate(prompt, **common)
            free_plain = gen.generate(prompt, use_drafter=False, max_new_tokens=args.max_new_tokens)
            for key, r in (("spec", spec), ("plain", plain), ("free_spec", free), ("free_plain", free_plain)):
                speeds[key].append(len(r.token_ids) / r.stats.decode_s)
            taus.append(spec.stats.tau)
        med = {k: statistics.median(v) for k, v in speeds.items() if v}
        rows.append(med["spec"] / med["plain"])
        free_rows.append(med["free_spec"] / med["free_plain"])
        print(f"{grammar.kind:11s} {len(spec.token_ids):3d} tok  spec {med['spec']:5.1f} tok/s (τ {statistics.median(taus):.2f})"
              f"  plain {med['plain']:5.1f}  speedup {rows[-1]:.2f}x | unconstrained {len(free.token_ids):3d} tok: "
              f"spec {med['free_spec']:5.1f} plain {med['free_plain']:5.1f} speedup {free_rows[-1]:.2f}x | identical "
              f"{spec.token_ids == plain.token_ids}  fits {fits(spec.text, schema)}  finish {spec.finish_reason}  "
              f"{spec.text[:60]!r}", flush=True)  # fmt: skip
        if llama is not None:
            llama_rows.append(med["spec"] / med["llama"])
            print(
                f"            llama-server bf16 under the schema: {med['llama']:5.1f} tok/s -> dflashkit "
                f"speculative {llama_rows[-1]:.2f}x, plain {med['plain'] / med['llama']:.2f}x",
                flush=True,
            )
    print(
        f"median speedup over plain decoding: {statistics.median(free_rows):.2f}x unconstrained, "
        f"{statistics.median(rows):.2f}x under a grammar ({len(rows)} prompts)"
    )
    if llama is not None:
        print(
            f"median dflashkit speculative / llama-server bf16 under the same schema: {statistics.median(llama_rows):.2f}x"
        )
        llama.close()


if __name__ == "__main__":
    main()
