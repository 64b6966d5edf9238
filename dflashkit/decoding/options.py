"""What one generation asks of the decode loop (DecodeOptions), and the checks a request passes before a model runs."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflashkit.decoding.grammar import CompiledGrammar
from dflashkit.decoding.penalties import Penalties
from dflashkit.decoding.sampling import (
    SamplingParams,
    check_sampler,
)
from dflashkit.decoding.tree import check_budget
from dflashkit.drafter.config import check_proposal_temperature
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.drafter.ngram_store import NgramStore
from dflashkit.errors import IncompatibleDrafterError, InvalidInputError
from dflashkit.target.adapter import TargetAdapter
from dflashkit.target.logprobs import check_top_logprobs

LOOKUP_ONLY_BLOCK = 8  # block size of prompt lookup without a drafter, unless given


@dataclass(frozen=True)
class DecodeOptions:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    block_size: int | None = None  # None: the drafter's trained block size
    proposal: str = (
        "sample"  # when sampling: "sample" (x ~ q, more accepted at T=1) or "argmax" (one-hot q); both exact
    )
    # when sampling: the drafter proposes at this multiple of the temperature (any q is exact; a drafter flatter than
    # the target is accepted more often sharpened); None: the drafter's own (config.proposal_temperature)
    proposal_temperature: float | None = None
    seed: int | None = None
    sampler: str = "rejection"  # when sampling: "rejection" or "coupled" (the seed's plain output, any drafter)
    stop_token_ids: frozenset[int] = frozenset()  # eos ids included by the caller
    lookup: bool = False  # draft by copying after a repeated n-gram where one exists (prompt lookup)
    lookup_store: NgramStore | None = None  # with lookup: the target's past answers, where the text has no repeat
    tree: int | None = (
        None  # drafter steps verify a token tree of this many nodes instead of a chain (dflashkit.decoding.tree)
    )
    tree_copies: bool = True  # with a tree, greedy or coupled: a copied step's tree also holds the copy (else a chain)
    draft_window: int | None = None  # drafting attends to the last N context tokens; None: the drafter's own, 0: all
    grammar: CompiledGrammar | None = None  # structured output: every token is one the grammar allows (chains only)
    logprobs: int | None = (
        None  # report each token's log-probability and this many alternatives (dflashkit.target.logprobs)
    )
    penalties: Penalties | None = None  # presence / frequency / repetition penalties, logit bias (chains only)

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens):
            raise InvalidInputError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.block_size is not None and not _is_int(self.block_size):
            raise InvalidInputError(f"block_size must be an integer >= 2, None or 'auto', got {self.block_size!r}")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            raise InvalidInputError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidInputError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.tree is not None:
            check_budget(self.tree)
        if self.proposal not in ("argmax", "sample"):
            raise InvalidInputError(f"proposal must be 'argmax' or 'sample', got {self.proposal!r}")
        if self.proposal_temperature is not None:
            check_proposal_temperature(self.proposal_temperature)
        check_draft_window(self.draft_window)
        check_top_logprobs(self.logprobs)
        check_sampler(self.sampler)
        if self.penalties is not None and not isinstance(self.penalties, Penalties):
            raise InvalidInputError(f"penalties must be a Penalties, got {type(self.penalties).__name__}")
        if self.block_size is not None and self.block_size < 2:
            raise InvalidInputError(f"block_size must be at least 2 (anchor + one draft), got {self.block_size}")


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_draft_window(window: object) -> int | None:
    """A requested drafting window: None (the drafter's own), 0 (the whole context) or a positive integer."""
    if window is not None and (not _is_int(window) or window < 0):
        raise InvalidInputError(f"draft_window must be an integer >= 0 (0: the whole context), got {window!r}")
    return window


def proposal_params(params: SamplingParams, drafter: DFlashDrafter, options: DecodeOptions) -> SamplingParams:
    """What the drafter proposes from when sampling (``params`` not greedy): the request's warping at the proposal
    temperature (the options', else the drafter's own multiple of the request's temperature). The coupled sampler's
    noisy drafter scores keep the request's temperature: there 0.85 lowered τ (scripts/proposal_temperature.py)."""
    ratio = options.proposal_temperature
    if ratio is None:
        ratio = drafter.config.proposal_temperature
    if ratio == 1.0:
        return params
    return dataclasses.replace(params, temperature=params.temperature * ratio)


def draft_window(drafter: DFlashDrafter, options: DecodeOptions) -> int | None:
    """The context window drafting uses: the options' (0: none), else the drafter's own (None: none)."""
    if options.draft_window is None:
        return drafter.config.context_window
    return options.draft_window or None


def as_token_list(ids: list[int] | Tensor) -> list[int]:
    """A prompt as a flat list of ints; refuses batches (batch size > 1 is not supported yet) and non-integers."""
    if isinstance(ids, Tensor):
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise InvalidInputError(
                f"batched input of shape {tuple(ids.shape)} is not supported: decode one prompt at a time"
            )
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise InvalidInputError(f"token ids must be integers, got a {ids.dtype} tensor")
        return ids.tolist()
    ids = list(ids)
    if any(isinstance(x, (list, tuple, Tensor)) for x in ids):
        if len(ids) == 1:
            return as_token_list(ids[0])
        raise InvalidInputError(f"batched input of {len(ids)} prompts is not supported: decode one prompt at a time")
    if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in ids):
        raise InvalidInputError("token ids must be integers")
    return [int(t) for t in ids]


def check_request(
    target: TargetAdapter, drafter: DFlashDrafter | None, prompt_ids: list[int], options: DecodeOptions
) -> int:
    """Validate a request; returns the block size (1 without a drafter)."""
    if not prompt_ids:
        raise InvalidInputError("the prompt is empty: give at least one token")
    vocab = target.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise InvalidInputError(f"prompt token ids must be in [0, {vocab}), got {min(prompt_ids)}..{max(prompt_ids)}")
    if options.lookup and options.lookup_store is not None:
        options.lookup_store.check_vocab(vocab)
    if options.penalties is not None:
        options.penalties.check_vocab(vocab)
    if options.max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be at least 1, got {options.max_new_tokens}")
    if len(prompt_ids) >= target.max_positions:
        raise InvalidInputError(
            f"prompt of {len(prompt_ids)} tokens leaves no room in the target's context of {target.max_positions}"
        )
    if options.block_size is not None and options.block_size > target.max_positions:
        raise InvalidInputError(
            f"block_size {options.block_size} is larger than the target's context ({target.max_positions} tokens)"
        )
    if drafter is None:
        if options.lookup:  # prompt lookup alone: blocks of options.block_size (default 8)
            return options.block_size if options.block_size is not None else LOOKUP_ONLY_BLOCK
        return 1
    block = options.block_size if options.block_size is not None else drafter.block_size
    if block < 2:
        raise InvalidInputError(f"block_size must be at least 2 (anchor + one draft), got {block}")
    cfg = drafter.config
    if cfg.hidden_size != target.hidden_size:
        raise IncompatibleDrafterError(
            f"drafter hidden size {cfg.hidden_size} != target hidden size {target.hidden_size}"
        )
    if cfg.vocab_size != vocab:
        raise IncompatibleDrafterError(f"drafter vocabulary {cfg.vocab_size} != target vocabulary {vocab}")
    if target.feature_layer_ids != list(cfg.target_layer_ids):
        raise IncompatibleDrafterError(
            f"target hooks layers {target.feature_layer_ids} but the drafter reads {cfg.target_layer_ids}: "
            "build the TargetAdapter with feature_layer_ids=drafter.config.target_layer_ids"
        )
    param = next(drafter.parameters())
    if param.dtype != target.dtype or param.device != target.device:
        raise IncompatibleDrafterError(
            f"drafter is {param.dtype} on {param.device} but the target is {target.dtype} on {target.device}"
        )
    return block
