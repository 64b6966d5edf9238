"""Benchmark harness: DFlash against autoregressive decoding and the alternatives users would pick.

    dflashkit bench --quick --drafter untrained        # ~5 minutes on a 2-core CPU

Modules: :mod:`.datasets` (questions and templates), :mod:`.methods` (the method interface, dflashkit's
loop), :mod:`.peers` (transformers generate, llama.cpp), :mod:`.assets` (models assembled from packages),
:mod:`.metrics` (τ, α_k, TPOT, speedups), :mod:`.runner` (the interleaved loop, losslessness),
:mod:`.report` and :mod:`.plots` (JSON, Markdown, PNG), :mod:`.command` (the CLI).
"""

from dflashkit.bench.methods import Autoregressive, DFlash, Method, Record, Request, TargetSession
from dflashkit.bench.runner import BenchConfig, BenchResult, run_bench

__all__ = [
    "Autoregressive",
    "BenchConfig",
    "BenchResult",
    "DFlash",
    "Method",
    "Record",
    "Request",
    "TargetSession",
    "run_bench",
]
