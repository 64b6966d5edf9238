"""Per-layer GEMM time of the default target's Linear shapes: bf16 weights vs weight-only int8.

    python scripts/bench_int8_gemm.py --threads 1 [--torchao]

For each shape (out x in) of SmolLM2-135M's projections and M = 1, 2, 4, 8, 16 activation rows, times
`F.linear` with bf16 weights and `aten._weight_int8pack_mm` (int8 weights, one bf16 scale per output
channel, bf16 activations: what :mod:`dflashkit.kernels.int8` runs); with --torchao also torchao's
`Int8WeightOnlyConfig` (if installed). Prints the median microseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query heads and 3 K/V heads of 64, vocabulary 49152
SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def median_us(fn, budget_s: float = 0.05, repeats: int = 5) -> float:
    fn()
    t = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t, 1e-7)
    n = max(1, int(budget_s / repeats / once))
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--torchao", action="store_true", help="also time torchao's Int8WeightOnlyConfig")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    from dflashkit.kernels.int8 import quantize_weight

    cols = ["bf16", "int8"] + (["torchao"] if args.torchao else [])
    print(f"torch {torch.__version__}, {args.threads} thread(s); median µs per call")
    print("| layer | out x in | M | " + " | ".join(cols) + " | int8 / bf16 |")
    print("|---|---|---:|" + "---:|" * len(cols) + "---:|")
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
            qw, scale = quantize_weight(w)
            ao = None
            if args.torchao:
                from torchao.quantization import Int8WeightOnlyConfig, quantize_

                ao = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16))
                ao[0].weight.data.copy_(w)
                quantize_(ao, Int8WeightOnlyConfig())
            for m in rows:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                t = {
                    "bf16": median_us(lambda x=x, w=w: F.linear(x, w)),
                    # fmt: skip
                    "int8": median_us(lambda x=x, qw=qw, s=scale: torch.ops.aten._weight_int8pack_mm(x, qw, s)),
                }
                if ao is not None:
                    t["torchao"] = median_us(lambda x=x, ao=ao: ao(x))
                cells = " | ".join(f"{t[c]:.0f}" for c in cols)
                print(f"| {name} | {n}x{k} | {m} | {cells} | {t['int8'] / t['bf16']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
