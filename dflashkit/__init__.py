"""dflashkit: lossless speculative decoding with DFlash block-diffusion drafters.

The names below are imported on first use (:mod:`dflashkit.lazy`): ``import dflashkit`` alone loads neither torch
nor transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflashkit.lazy import lazy_exports

if TYPE_CHECKING:
    from dflashkit.decoding.grammar import Grammar, GrammarError
    from dflashkit.decoding.loop import Step, decode
    from dflashkit.decoding.lossless import Divergence
    from dflashkit.decoding.options import DecodeOptions
    from dflashkit.decoding.prefix_cache import PrefixCache
    from dflashkit.decoding.sampling import SamplingParams
    from dflashkit.decoding.stats import DecodeStats
    from dflashkit.drafter.checkpoint import load_drafter, save_drafter
    from dflashkit.drafter.config import DrafterConfig, build_target_layer_ids
    from dflashkit.drafter.identity import check_compatible, drafter_config_for
    from dflashkit.drafter.network import DFlashDrafter
    from dflashkit.errors import CheckpointError, DFlashError, IncompatibleDrafterError, InvalidInputError
    from dflashkit.generator import GenerationResult, SpeculativeGenerator, TextDelta
    from dflashkit.target.adapter import TargetAdapter
    from dflashkit.target.loading import DEFAULT_TARGET, load_target
    from dflashkit.target.logprobs import TokenLogprob

__version__ = "0.2.0"

# each public name -> the module that defines it
_EXPORTS = {
    "CheckpointError": "dflashkit.errors",
    "DEFAULT_TARGET": "dflashkit.target.loading",
    "DFlashDrafter": "dflashkit.drafter.network",
    "DFlashError": "dflashkit.errors",
    "DecodeOptions": "dflashkit.decoding.options",
    "DecodeStats": "dflashkit.decoding.stats",
    "Divergence": "dflashkit.decoding.lossless",
    "DrafterConfig": "dflashkit.drafter.config",
    "GenerationResult": "dflashkit.generator",
    "Grammar": "dflashkit.decoding.grammar",
    "GrammarError": "dflashkit.decoding.grammar",
    "IncompatibleDrafterError": "dflashkit.errors",
    "InvalidInputError": "dflashkit.errors",
    "PrefixCache": "dflashkit.decoding.prefix_cache",
    "SamplingParams": "dflashkit.decoding.sampling",
    "SpeculativeGenerator": "dflashkit.generator",
    "Step": "dflashkit.decoding.loop",
    "TargetAdapter": "dflashkit.target.adapter",
    "TextDelta": "dflashkit.generator",
    "TokenLogprob": "dflashkit.target.logprobs",
    "build_target_layer_ids": "dflashkit.drafter.config",
    "check_compatible": "dflashkit.drafter.identity",
    "decode": "dflashkit.decoding.loop",
    "drafter_config_for": "dflashkit.drafter.identity",
    "load_drafter": "dflashkit.drafter.checkpoint",
    "load_target": "dflashkit.target.loading",
    "save_drafter": "dflashkit.drafter.checkpoint",
}

__all__ = [  # the keys of _EXPORTS, written out for type checkers (tests/cli/test_main.py checks)
    "CheckpointError",
    "DEFAULT_TARGET",
    "DFlashDrafter",
    "DFlashError",
    "DecodeOptions",
    "DecodeStats",
    "Divergence",
    "DrafterConfig",
    "GenerationResult",
    "Grammar",
    "GrammarError",
    "IncompatibleDrafterError",
    "InvalidInputError",
    "PrefixCache",
    "SamplingParams",
    "SpeculativeGenerator",
    "Step",
    "TargetAdapter",
    "TextDelta",
    "TokenLogprob",
    "build_target_layer_ids",
    "check_compatible",
    "decode",
    "drafter_config_for",
    "load_drafter",
    "load_target",
    "save_drafter",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
