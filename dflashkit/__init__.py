"""dflashkit: lossless speculative decoding with DFlash block-diffusion drafters.

The names below are imported on first use (PEP 562): ``import dflashkit`` alone loads neither torch nor
transformers, so the command line's ``--help`` and argument errors answer at once, while
``from dflashkit import SpeculativeGenerator`` works as for any package."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

# each public name -> the module that defines it (imported by __getattr__ when the name is first asked for)
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

__all__ = [
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
]  # the keys of _EXPORTS (tests/cli/test_main.py checks)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept in this module's namespace."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dflashkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
