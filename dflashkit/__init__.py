"""dflashkit: lossless speculative decoding with DFlash block-diffusion drafters."""

from .checkpoint import load_drafter, save_drafter
from .config import DrafterConfig, build_target_layer_ids
from .decode import DecodeOptions, Step, decode
from .drafter import DFlashDrafter
from .errors import CheckpointError, DFlashError, IncompatibleDrafterError, InvalidInputError
from .grammar import Grammar, GrammarError
from .generator import GenerationResult, SpeculativeGenerator, TextDelta
from .identity import check_compatible, drafter_config_for
from .logprobs import TokenLogprob
from .lossless import Divergence
from .models import DEFAULT_TARGET, load_target
from .prefix_cache import PrefixCache
from .sampling import SamplingParams
from .stats import DecodeStats
from .target import TargetAdapter

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "DEFAULT_TARGET", "DFlashDrafter", "DFlashError", "DecodeOptions", "DecodeStats",
    "Divergence", "DrafterConfig", "GenerationResult", "Grammar", "GrammarError", "IncompatibleDrafterError", "InvalidInputError",
    "PrefixCache", "SamplingParams", "SpeculativeGenerator", "Step", "TargetAdapter", "TextDelta", "TokenLogprob", "build_target_layer_ids",
    "check_compatible", "decode", "drafter_config_for", "load_drafter", "load_target", "save_drafter",
]
