"""Benchmark harness: DFlash against autoregressive decoding and the alternatives users would pick.

    dflashkit bench --quick --drafter untrained

Modules: :mod:`.datasets` (questions and templates), :mod:`.methods` (the method interface, dflashkit's
loop), :mod:`.peers` (transformers generate, llama.cpp), :mod:`.assets` (models assembled from packages),
:mod:`.metrics` (τ, α_k, TPOT, speedups), :mod:`.runner` (the interleaved loop, losslessness),
:mod:`.report` and :mod:`.plots` (JSON, Markdown, PNG), :mod:`.command` (the CLI).

The names below are imported on first use, so that building the ``dflashkit bench`` parser (every ``dflashkit
--help``) loads no torch.
"""

from __future__ import annotations

from dflashkit.lazy import lazy_exports

# each public name -> the module that defines it
_EXPORTS = {
    "Autoregressive": "dflashkit.bench.methods",
    "BenchConfig": "dflashkit.bench.runner",
    "BenchResult": "dflashkit.bench.runner",
    "DFlash": "dflashkit.bench.methods",
    "Method": "dflashkit.bench.methods",
    "Record": "dflashkit.bench.methods",
    "Request": "dflashkit.bench.methods",
    "TargetSession": "dflashkit.bench.methods",
    "run_bench": "dflashkit.bench.runner",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
