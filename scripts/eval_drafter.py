"""τ and speedup of a drafter per evaluation set, interleaved with plain decoding in the same loop.

    .venv/bin/python scripts/eval_drafter.py --drafter DIR [--limit 10] [--max-new-tokens 128] [--json OUT]

Greedy, block size of the drafter, the embedded target in bf16 unless --target/--dtype say otherwise. Per
prompt: speculative then plain decoding (after one warm-up of each), so both see the same machine state;
speedup = plain decode time per token / speculative decode time per token (prefill excluded), reported as
the ratio of the per-set totals and as the median of per-prompt ratios. Greedy outputs are compared token
for token; a divergence is classified as a bf16 tie or not (not a tie = a bug).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from dflashkit import SpeculativeGenerator
from dflashkit.evalsets import available_sets, load_set


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", default=None)
    ap.add_argument("--sets", default=",".join(available_sets()))
    ap.add_argument("--limit", type=int, default=10, help="prompts per set (seeded subset)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write per-prompt figures here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load(args.target, args.drafter, dtype=getattr(torch, args.dtype))
    gen.warmup()
    opts = dict(max_new_tokens=args.max_new_tokens, block_size=args.block_size)
    report: dict = {"settings": vars(args), "sets": {}}
    for name in args.sets.split(","):
        rows = []
        for prompt in load_set(name, args.limit):
            r = gen.compare_ar(gen.generate(prompt, **opts), prompt, **opts)
            d = r.divergence
            rows.append({
                "tau": r.stats.tau, "new_tokens": r.stats.new_tokens, "spec_decode_s": r.stats.decode_s,
                "ar_decode_s": r.ar.stats.decode_s, "ar_new_tokens": r.ar.stats.new_tokens, "speedup": r.speedup,
                "identical": r.identical, "divergence": d.as_dict() if d else None,
                "accepted_histogram": r.stats.acceptance_histogram,
            })  # fmt: skip
        steps_tokens = sum(x["new_tokens"] for x in rows)
        tau = statistics.fmean(x["tau"] for x in rows)
        spec_tpot = sum(x["spec_decode_s"] for x in rows) / sum(max(1, x["new_tokens"] - 1) for x in rows)
        ar_tpot = sum(x["ar_decode_s"] for x in rows) / sum(max(1, x["ar_new_tokens"] - 1) for x in rows)
        bad = [x["divergence"] for x in rows if x["divergence"] and not x["divergence"]["tie"]]
        summary = {
            "prompts": len(rows), "tokens": steps_tokens, "mean_tau": tau, "speedup_tpot": ar_tpot / spec_tpot,
            "speedup_median_per_prompt": statistics.median(x["speedup"] for x in rows),
            "spec_tok_s": 1 / spec_tpot, "ar_tok_s": 1 / ar_tpot,
            "identical": sum(bool(x["identical"]) for x in rows), "tie_divergences": sum(
                1 for x in rows if x["divergence"] and x["divergence"]["tie"]), "non_tie_divergences": len(bad),
        }  # fmt: skip
        report["sets"][name] = {"summary": summary, "prompts": rows}
        print(f"{name:10s} τ {tau:.2f} | speedup {summary['speedup_tpot']:.2f}x (median per prompt "
              f"{summary['speedup_median_per_prompt']:.2f}x) | {summary['spec_tok_s']:.1f} vs {summary['ar_tok_s']:.1f}"
              f" tok/s | identical {summary['identical']}/{len(rows)}, ties {summary['tie_divergences']}, "
              f"non-ties {len(bad)}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    bad_total = sum(s["summary"]["non_tie_divergences"] for s in report["sets"].values())
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())
