"""dflashkit: lossless speculative decoding with DFlash block-diffusion drafters."""

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
]
