"""Where the time of a decode step goes: the loop's phases, then torch.profiler's operator classes.

Decodes one prompt plainly and speculatively with the default target (after a warm-up; the median of three runs),
prints each phase's milliseconds per step (draft, verify, other: acceptance, cache bookkeeping and Python), then
profiles one run of each and groups the operators' CPU self time by class (GEMM, attention, elementwise and norms,
copies and cache, the rest). dflashkit's row kernels are not torch operators: scripts/bench_row_kernels.py times
them. `--eager` profiles transformers' forward instead of the fast path; scripts/step_cost.py times the target's
step alone by row count.

    python scripts/profile_step.py [--drafter auto] [--block-size 16] [--tokens 96] [--temperature 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dflashkit import DecodeStats, SpeculativeGenerator

PROMPT = "Write a short story about a robot who learns to paint."
CLASSES = {
    "GEMM (linear layers, LM head)": (
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::matmul",
        "aten::linear",
        "mkldnn::_linear_pointwise",
    ),
    "attention (SDPA)": ("scaled_dot_product", "flash_attention"),
    "copies, cat, cache": (
        "aten::copy_",
        "aten::cat",
        "aten::index",
        "aten::clone",
        "aten::contiguous",
        "aten::_to_copy",
        "aten::narrow",
        "aten::slice",
    ),
    "elementwise, norms, RoPE, softmax": (
        "aten::mul",
        "aten::add",
        "aten::pow",
        "aten::rsqrt",
        "aten::mean",
        "aten::silu",
        "aten::neg",
        "aten::softmax",
        "aten::_softmax",
        "aten::sub",
        "aten::div",
        "aten::cos",
        "aten::sin",
        "aten::argmax",
        "aten::exp",
    ),
}


def classify(name: str) -> str:
    for label, keys in CLASSES.items():
        if any(k in name for k in keys):
            return label
    return "other ops"


def run(
    gen: SpeculativeGenerator, use_drafter: bool, block: int | None, tokens: int, temperature: float = 0.0
) -> DecodeStats:
    from dflashkit import DecodeOptions, DecodeStats, decode
    from dflashkit.decoding.sampling import SamplingParams

    ids = gen.encode_prompt(PROMPT)
    stats = DecodeStats(1)
    options = DecodeOptions(
        max_new_tokens=tokens,
        block_size=block if use_drafter else None,
        stop_token_ids=frozenset(),
        sampling=SamplingParams(temperature=temperature),
    )
    gen.target.set_feature_layers(gen.drafter.config.target_layer_ids if use_drafter else ())
    for _ in decode(gen.target, gen.drafter if use_drafter else None, ids, options, stats):
        pass
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="auto", help="drafter folder (default: the shipped one)")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled (rejection sampler)")
    ap.add_argument("--eager", action="store_true", help="the eager path (transformers' forward, plain nn.Linear)")
    args = ap.parse_args()
    from dflashkit import SpeculativeGenerator
    from dflashkit.kernels import row_kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load(drafter=args.drafter, fast=not args.eager)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16, target: {gen.target.engine}")
    for use in (False, True, False, True):  # warm-up, then measured
        run(gen, use, args.block_size, 16, args.temperature)
    for use, label in ((False, "autoregressive"), (True, "speculative")):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            s = run(gen, use, args.block_size, args.tokens, args.temperature)
            times.append((time.perf_counter() - t, s))
        wall, s = sorted(times, key=lambda x: x[0])[1]  # the median run
        steps = max(1, s.steps)
        print(
            f"\n{label}: {s.new_tokens} tokens, {steps} steps, τ {s.tau:.2f}, {s.new_tokens / wall:.1f} tok/s "
            f"(prefill included); per step: draft {1e3 * s.draft_s / steps:.2f} ms, verify "
            f"{1e3 * s.verify_s / steps:.2f} ms, other {1e3 * s.other_s / steps:.2f} ms, "
            f"total {1e3 * s.decode_s / steps:.2f} ms"
        )
        with torch.profiler.profile() as prof:
            s = run(gen, use, args.block_size, args.tokens, args.temperature)
        per_class: dict[str, float] = defaultdict(float)
        for e in prof.key_averages():
            per_class[classify(e.key)] += e.self_cpu_time_total / 1e3
        total = sum(per_class.values())
        steps = max(1, s.steps)
        print(
            f"  operator self time per step (profiled run: {total / steps:.2f} ms of operators in "
            f"{1e3 * s.decode_s / steps:.2f} ms per step):"
        )
        for label_, ms in sorted(per_class.items(), key=lambda x: -x[1]):
            print(f"    {label_:38s} {ms / steps:7.2f} ms  {100 * ms / total:5.1f}%")
    print(
        f"\nmedian of 3 runs each; prompt: {PROMPT!r}. Operator time below the step's wall time is Python and "
        "framework overhead (the profiler adds some)",
        end="",
    )
    if row_kernels.kernel() is not None:
        print(
            f", and dflashkit's row kernels ({row_kernels.label()}: products and attention), which are not torch "
            "operators: time them with scripts/bench_row_kernels.py",
            end="",
        )
    print(".")


if __name__ == "__main__":
    main()
