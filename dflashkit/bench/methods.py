"""What the benchmark runs: the method interface, and dflashkit's own decode loop as methods.

A method turns a :class:`Request` (prompt token ids, sampling settings) into a :class:`Record` (output
tokens and when they came). Every method is timed the same way, from the call with token ids to the first
and to the last new token, so TTFT and TPOT compare across methods. The autoregressive baseline is the
same decode loop as DFlash with no drafter (block size 1): the speedup convention of the DFlash paper.

Peers (transformers' ``generate``, llama-cpp-python, llama-server over HTTP) are further
:class:`Method` subclasses in :mod:`dflashkit.bench.peers`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dflashkit.decoding.adaptive import LOOKUP_ALONE_BLOCK, AdaptiveBlockSize, BlockPolicies
from dflashkit.decoding.defaults import COUPLED_TREE, default_tree, default_tree_copies
from dflashkit.decoding.lookup import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM
from dflashkit.decoding.loop import DecodeOptions, StepObserver, decode
from dflashkit.decoding.sampling import SamplingParams
from dflashkit.decoding.stats import DecodeStats
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.drafter.ngram_store import NgramStore
from dflashkit.target.adapter import TargetAdapter
from dflashkit.text import eos_token_ids

# How a method's greedy tokens relate to the baseline's:
EXACT = "exact"  # same loop, weights, dtype and kernels: identical up to bf16 ties (a non-tie is a bug)
KERNELS = "kernels"  # same weights and dtype, other kernels (transformers' attention): ties may flip
OTHER_WEIGHTS = "other-weights"  # other (e.g. quantized) weights: compare speed, not tokens


@dataclass(frozen=True)
class Request:
    """One generation: prompt token ids (chat template applied) and how to sample."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float  # 0: greedy; otherwise plain sampling at this temperature (no top-k / top-p)
    seed: int
    stop_token_ids: frozenset[int]
    messages: tuple[dict[str, str], ...] = ()  # the chat behind prompt_ids, for methods that take text
    sampler: str = "rejection"  # dflashkit's sampler when sampling ("coupled": outputs comparable token for token)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Record:
    """What one method produced for one request, and when (seconds from the call with token ids)."""

    tokens: list[int]
    ttft_s: float  # to the first new token (prefill included)
    total_s: float  # to the last new token
    accepted_lengths: list[int] | None = None  # per verification step: accepted drafts (speculative methods)
    drafted_lengths: list[int] | None = None  # per verification step: drafts proposed (when known)
    steps_total: int | None = None  # engines reporting only totals: verification passes ...
    accepted_total: int | None = None  # ... and drafts accepted over the whole generation
    block_size: int | None = None
    phases_s: dict[str, float] = field(default_factory=dict)  # e.g. draft / verify time (dflashkit methods)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)


class Method(ABC):
    """A way of generating. `name` is unique in a run; `family` groups methods (dflashkit, transformers, ...);
    `comparable` is EXACT, KERNELS or OTHER_WEIGHTS; `note` says what exactly runs."""

    name: str = ""
    family: str = ""
    comparable: str = EXACT
    note: str = ""

    def unavailable(self) -> str | None:
        """Why this method cannot run here (a sentence for the skip line), or None when it can."""
        return None

    def warmup(self, request: Request) -> None:
        """One untimed generation so that first-call costs (allocations, lazy init) stay out of timings."""
        self.generate(request)

    @abstractmethod
    def generate(self, request: Request) -> Record:
        """Generate for one request, timing it (see :class:`Record`)."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "comparable": self.comparable, "note": self.note}

    def close(self) -> None:
        """Free what the method holds (models, processes)."""


class TargetSession:
    """The target shared by every method: the model, its tokenizer, and dflashkit's adapter over it.

    The adapter switches the model to dflashkit's packed grouped-query attention and (``fast``, the default)
    decodes through the fast path; :meth:`transformers_mode` gives transformers' own "sdpa" attention and
    ``nn.Linear`` layers (and no feature hooks) back for the peers' `generate` calls.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, fast: bool = True) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.original_attention = getattr(model.config, "_attn_implementation", None)
        self.fast = fast
        self.adapter = TargetAdapter(model, (), fast=fast)
        self.engine_attention = getattr(model.config, "_attn_implementation", None)
        self.eos_token_ids = eos_token_ids(model, tokenizer)

    @property
    def dtype(self) -> torch.dtype:
        return self.adapter.dtype

    @contextmanager
    def transformers_mode(self) -> Iterator[PreTrainedModel]:
        """The model as transformers loaded it (its own attention implementation, no hooks), for a while."""
        self.adapter.set_feature_layers(())
        switch = self.original_attention is not None and self.original_attention != self.engine_attention
        if switch:
            self.model.set_attn_implementation(self.original_attention)
        self.adapter.use_packed_linears(False)
        try:
            yield self.model
        finally:
            self.adapter.use_packed_linears(self.fast)
            if switch:
                self.model.set_attn_implementation(self.engine_attention)


def options_for(
    request: Request,
    block_size: int | None = None,
    lookup: bool = False,
    lookup_store: NgramStore | None = None,
    tree: int | None = None,
    tree_copies: bool = True,
) -> DecodeOptions:
    return DecodeOptions(
        max_new_tokens=request.max_new_tokens,
        sampling=SamplingParams(temperature=request.temperature),
        block_size=block_size,
        seed=request.seed,
        sampler=request.sampler,
        stop_token_ids=request.stop_token_ids,
        lookup=lookup,
        lookup_store=lookup_store,
        tree=tree,
        tree_copies=tree_copies,
    )


def run_decode_loop(
    session: TargetSession,
    drafter: DFlashDrafter | None,
    request: Request,
    block_size: int | None = None,
    observer: StepObserver | None = None,
    block_policy: AdaptiveBlockSize | None = None,
    lookup: bool = False,
    tree: int | None = None,
    tree_copies: bool = True,
    store: NgramStore | None = None,
) -> Record:
    """dflashkit's decode loop on one request (drafter None: autoregressive, or prompt lookup alone), timed
    from outside. With lookup, the n-gram store of past answers is ``store``, else the drafter's."""
    session.adapter.set_feature_layers(drafter.config.target_layer_ids if drafter else ())
    stats = DecodeStats(block_size=1)
    tokens: list[int] = []
    t0 = time.perf_counter()
    ttft = None
    if store is None and lookup and drafter is not None:
        store = drafter.ngram_store  # the drafter's store of past answers
    store = store if lookup else None
    options = options_for(request, block_size, lookup, store, tree, tree_copies)
    for step in decode(session.adapter, drafter, request.prompt_ids, options, stats, observer, block_policy):
        if ttft is None:
            ttft = time.perf_counter() - t0
        tokens.extend(step.tokens)
    total = time.perf_counter() - t0
    return Record(
        tokens=tokens,
        ttft_s=ttft if ttft is not None else total,
        total_s=total,
        accepted_lengths=list(stats.accepted_lengths),
        drafted_lengths=list(stats.drafted_lengths),
        block_size=stats.block_size,
        phases_s={"prefill": stats.prefill_s, "draft": stats.draft_s, "verify": stats.verify_s, "other": stats.other_s},
    )


class Autoregressive(Method):
    """The baseline: dflashkit's decode loop without a drafter (one target pass per token)."""

    name = "ar"
    family = "dflashkit"
    comparable = EXACT
    note = "dflashkit decode loop without a drafter (block size 1): the baseline"

    def __init__(self, session: TargetSession) -> None:
        self.session = session

    def generate(self, request: Request) -> Record:
        return run_decode_loop(self.session, None, request)


class DFlash(Method):
    """dflashkit's speculative decode loop with a DFlash drafter at one block size, or "auto" (adaptive);
    with ``lookup``, steps that can copy a repeated n-gram's continuation do so instead of drafting."""

    family = "dflashkit"
    comparable = EXACT

    def __init__(
        self,
        session: TargetSession,
        drafter: DFlashDrafter,
        block_size: int | str,
        drafter_label: str,
        lookup: bool = False,
        tree: int | None = None,
    ) -> None:
        self.session, self.drafter, self.block_size, self.lookup = session, drafter, block_size, lookup
        self.tree = tree
        prefix, with_lookup = ("dflash-lookup", " + prompt lookup") if lookup else ("dflash", "")
        drafter.use_fast_path(session.fast)  # the target's fast path, or the eager path
        trained = drafter.block_size
        self.policy = None
        if tree is not None:  # token trees of up to `tree` nodes, at most block_size - 1 deep; "auto": sized per step
            if block_size == "auto":  # the policies size copies and tree depths as they size the default's chains
                self.policy = BlockPolicies(trained)
                self.name = f"{prefix}-auto-tree{tree}"
                sizes = f"block size chosen per step (sampling: among {self.policy.get(False).candidates})"
            else:  # the trained block size keeps the plain name (the token-tree benches before sizes were asked)
                self.name = f"{prefix}-tree{tree}" if block_size == trained else f"{prefix}-b{block_size}-tree{tree}"
                sizes = f"block size {block_size}"
            self.note = (
                f"dflashkit decode loop, drafter {drafter_label}{with_lookup}, "
                f"token trees of up to {tree} nodes, {sizes}"
            )
            return
        if block_size == "auto":  # policies for the whole run (greedy, sampled): estimates carry over between prompts
            self.policy = BlockPolicies(trained)
            self.name = f"{prefix}-auto"
            self.note = (
                f"dflashkit decode loop, drafter {drafter_label}{with_lookup}, block size chosen per step "
                f"among {self.policy.get(True).candidates} (sampling: {self.policy.get(False).candidates}; "
                f"under coupled sampling, token trees of {COUPLED_TREE} nodes as by default)"
            )
            return
        self.name = f"{prefix}-b{block_size}"
        beyond = f", beyond its trained block size {trained}" if block_size > trained else ""
        self.note = f"dflashkit decode loop, drafter {drafter_label}{with_lookup}, block size {block_size}{beyond}"

    def generate(self, request: Request) -> Record:
        if self.policy is not None and self.tree is not None:  # trees asked for, sized per step
            policy = self.policy.get(request.greedy, tree=True)
            return run_decode_loop(
                self.session,
                self.drafter,
                request,
                block_policy=policy,
                lookup=self.lookup,
                tree=self.tree,
                tree_copies=default_tree_copies(None, self.tree),
            )
        if self.policy is not None:  # what the library does by default (e.g. token trees under coupled sampling)
            tree = default_tree(
                None,
                has_drafter=True,
                sampled=not request.greedy,
                sampler=request.sampler,
                block_size="auto",
                batched=False,
                supports_trees=self.session.adapter.supports_trees,
            )
            policy = self.policy.get(request.greedy, tree=tree is not None)
            return run_decode_loop(
                self.session,
                self.drafter,
                request,
                block_policy=policy,
                lookup=self.lookup,
                tree=tree,
                tree_copies=default_tree_copies(None, None),
            )
        return run_decode_loop(self.session, self.drafter, request, self.block_size, lookup=self.lookup, tree=self.tree)


class PromptLookup(Method):
    """Prompt lookup alone in dflashkit's decode loop: drafts copied after a repeated n-gram, no drafter. Block size
    "auto" (the default: what a target without a drafter decodes with) sizes each copy with the adaptive policy,
    which also takes plain steps where copies do not pay; an integer copies up to that block every time."""

    family = "dflashkit"
    comparable = EXACT

    def __init__(self, session: TargetSession, block_size: int | str = "auto", store: NgramStore | None = None) -> None:
        self.session, self.block_size, self.store = session, block_size, store
        grams = f"prompt lookup ({DEFAULT_MIN_NGRAM}-{DEFAULT_MAX_NGRAM}-grams), no drafter"
        if store is not None:
            grams += f", an n-gram store of {len(store):,} {store.n}-grams where the text has no repeat"
        self.policies = BlockPolicies(LOOKUP_ALONE_BLOCK, lookup_alone=True) if block_size == "auto" else None
        if self.policies is not None:  # estimates carry over between prompts, as in a generator
            self.name = "lookup-store" if store is not None else "lookup"
            self.note = f"dflashkit decode loop, {grams}, copies of up to {LOOKUP_ALONE_BLOCK - 1} tokens, sized"
        else:
            self.name = f"lookup-b{block_size}" + ("-store" if store is not None else "")
            self.note = f"dflashkit decode loop, {grams}, block size {block_size}"

    def generate(self, request: Request) -> Record:
        if self.policies is not None:
            policy = self.policies.get(request.greedy)
            return run_decode_loop(self.session, None, request, block_policy=policy, lookup=True, store=self.store)
        return run_decode_loop(self.session, None, request, self.block_size, lookup=True, store=self.store)


class Unavailable(Method):
    """A method that was asked for but cannot be built here (e.g. DFlash without a drafter): listed as skipped."""

    def __init__(self, name: str, family: str, reason: str, comparable: str = EXACT, note: str = "") -> None:
        self.name, self.family, self.reason, self.comparable, self.note = name, family, reason, comparable, note

    def unavailable(self) -> str | None:
        return self.reason

    def generate(self, request: Request) -> Record:
        raise RuntimeError(f"{self.name} is unavailable: {self.reason}")
