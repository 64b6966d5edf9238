"""The decode loop: prefill, then draft a block, verify it in one target pass, accept, update both caches.

Without a drafter the same loop verifies a block of one token per step, which is plain autoregressive
decoding through the same code: the baseline that speedups are measured against.

State between steps:
  pos      index of `token`, the last emitted token; the target has processed positions < pos only
  cache    target KV cache over positions < pos
  context  drafter's injected K/V over the positions whose target features have been consumed
  pending  target features of processed positions not yet in the drafter's context (prompt, then the
           anchor + accepted drafts of the steps since the drafter last ran)

With ``lookup`` on, a step whose text so far ends with an n-gram seen before drafts the tokens that followed
it (:mod:`dflashkit.decoding.lookup`) instead of running the drafter; verification is the same either way. With a
``grammar``, the target and the drafts are masked to what it allows (:mod:`dflashkit.decoding.grammar`); with
``penalties``, each verify row's logits are adjusted by its own history (:mod:`dflashkit.decoding.penalties`).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflashkit.decoding.adaptive import AdaptiveBlockSize
from dflashkit.decoding.grammar import CompiledGrammar, masked
from dflashkit.decoding.lookup import NgramLookup
from dflashkit.decoding.penalties import Penalties
from dflashkit.decoding.prefix_cache import CachedSequence, PrefixCache
from dflashkit.decoding.sampling import (
    PositionNoise,
    SamplingParams,
    argmax,
    check_sampler,
    over_vocabulary,
    propose,
    warp,
)
from dflashkit.decoding.stats import DecodeStats
from dflashkit.decoding.tree import build_tree, check_budget, sample_tree
from dflashkit.decoding.verify import longest_match, verify_greedy, verify_sampled_logits, verify_tree_sampled
from dflashkit.drafter.config import check_proposal_temperature
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.drafter.ngram_store import NgramStore
from dflashkit.errors import IncompatibleDrafterError, InvalidInputError
from dflashkit.target.adapter import TargetAdapter
from dflashkit.target.logprobs import TokenLogprob, check_top_logprobs, token_logprobs

LOOKUP_ONLY_BLOCK = 8  # block size of prompt lookup without a drafter, unless given
NO_DRAFTS = torch.empty(0, dtype=torch.long)

# Called after every target pass with its logits rows and the tokens the step emitted.
StepObserver = Callable[[Tensor, list[int]], None]


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


@dataclass
class Step:
    """Tokens emitted by one target pass; from_draft[i] says whether token i was the drafter's; logprobs[i]
    its log-probability under the target (with options.logprobs, else None)."""

    tokens: list[int]
    from_draft: list[bool]
    finished: bool = False
    logprobs: list[TokenLogprob] | None = None


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


def decode(
    target: TargetAdapter,
    drafter: DFlashDrafter | None,
    prompt_ids: list[int],
    options: DecodeOptions,
    stats: DecodeStats | None = None,
    observer: StepObserver | None = None,
    block_policy: AdaptiveBlockSize | None = None,
    prefix_cache: PrefixCache | None = None,
) -> Iterator[Step]:
    """Generate after `prompt_ids` (batch 1), yielding each step's tokens as soon as they are verified.

    With `block_policy`, each step's block size is chosen by it (at most the block size in force) and the
    step is reported back to it; with prompt lookup, copied drafts are as long as its ``copies`` policy
    chooses (copied and drafted tokens are accepted at different rates), or as its largest block without one.
    With `prefix_cache`, the prefill restores the longest prefix of the prompt kept there and runs only the rest,
    and the generation's own sequence is kept there when it ends (:mod:`dflashkit.decoding.prefix_cache`).
    """
    prompt_ids = as_token_list(prompt_ids)
    block = _check(target, drafter, prompt_ids, options)
    if block_policy is not None and drafter is not None and block_policy.max_block > block:
        raise InvalidInputError(
            f"the adaptive policy allows blocks of {block_policy.max_block}, more than the "
            f"block size in force ({block})"
        )
    policy = block_policy if drafter is not None else None
    largest = policy.max_block if policy else block  # the largest block a step may use (drafted or copied)
    copy_policy = policy.copies if policy is not None else None  # the length of copied drafts (None: largest - 1)
    stats = stats if stats is not None else DecodeStats(block_size=largest)
    stats.block_size, stats.prompt_tokens = largest, len(prompt_ids)
    stats.target_weights, stats.engine = target.weights, target.engine
    stats.lookup = options.lookup
    params = options.sampling
    device = target.device
    seed = options.seed if options.seed is not None else random.randrange(1 << 62)
    gen = torch.Generator(device=device).manual_seed(seed)
    # coupled sampling: every decision is the argmax of noisy scores, the noise a function of (seed, position)
    noise = (
        PositionNoise(seed, target.vocab_size, device) if options.sampler == "coupled" and not params.greedy else None
    )
    # what sampled drafts are drawn from (the proposal temperature's warping)
    draft_sampling = proposal_params(params, drafter, options) if drafter is not None and not params.greedy else params
    stats.sampler = None if params.greedy else options.sampler
    max_new = min(options.max_new_tokens, target.max_positions - len(prompt_ids))

    def scored(rows: Tensor, position: int) -> Tensor:  # rows [n, vocab] deciding positions position.. (coupled)
        return noise.scores(rows, params, position) if noise is not None else rows

    def choose(logits: Tensor, allowed: Tensor | None = None, position: int = 0) -> int:  # the target's token
        if params.greedy:  # from one row of logits, deciding output `position`
            return int(argmax(logits, allowed))
        if noise is not None:
            return noise.argmax(masked(logits, allowed)[None], params, position)[0]
        return verify_sampled_logits(masked(logits, allowed)[None], params, NO_DRAFTS, None, gen)[1]

    constraint = options.grammar.start() if options.grammar is not None else None
    stats.grammar = options.grammar.kind if options.grammar is not None else None
    stop_ids = options.stop_token_ids | (
        constraint.eos_token_ids if constraint else frozenset()
    )  # a grammar ends at eos
    penalties = options.penalties if options.penalties is not None and options.penalties.active else None
    history = penalties.start(prompt_ids, target.vocab_size, device) if penalties else None

    def adjusted(rows: Tensor, drafts: Tensor | list[int] = ()) -> Tensor:  # the logits the decision is made on
        return history.apply(rows, drafts) if history is not None else rows

    def logprobs_of(rows: Tensor, tokens: list[int]) -> list[TokenLogprob] | None:  # rows [>= len(tokens), vocab]
        return token_logprobs(rows, tokens, options.logprobs) if options.logprobs is not None else None

    # ---- prefill ----------------------------------------------------------------------------------------
    t_start = time.perf_counter()
    capacity = len(prompt_ids) + max_new + block
    feature_layers = tuple(target.feature_layer_ids)
    if prefix_cache is not None:
        prefix_cache.bind(target.model)
    reused = prefix_cache.match(prompt_ids, feature_layers) if prefix_cache is not None else None
    cached = reused[1] if reused is not None else 0
    cache = (
        target.restore(reused[0].keys, reused[0].values, cached, capacity)
        if reused is not None
        else target.new_cache(capacity=capacity)
    )
    prompt = torch.tensor([prompt_ids[cached:]], device=device)
    logits, features = target.forward(prompt, cached, cache, logits_rows=1)
    if reused is not None and features is not None:
        features = torch.cat((reused[0].features[:, :cached], features), 1)  # [1, prompt, F]
    stats.cached_prompt_tokens = cached
    decided = adjusted(logits[-1:])  # [1, vocab]
    masks = constraint.allowed()[None] if constraint else None  # [1, vocab]
    token = choose(decided[-1], masks[0] if masks is not None else None, 0)
    if constraint:
        constraint.consume([token])
    if history is not None:
        history.consume([token])
    if observer:
        observer(scored(masked(decided, masks), 0), [token])
    stats.target_forwards += 1
    stats.prefill_s = time.perf_counter() - t_start
    t_decode = time.perf_counter()

    pos = len(prompt_ids)
    produced = 1
    sequence = [*prompt_ids, token]  # the cache holds positions < pos = len(sequence) - 1
    kept_features = [features] if prefix_cache is not None and features is not None else None
    stats.draft_window = draft_window(drafter, options) if drafter else None
    context = drafter.new_context(capacity=pos + max_new + block, window=stats.draft_window) if drafter else None
    if context is not None:  # drafts may propose the text's own tokens (dflashkit.drafter.text_columns)
        context.note_text(sequence)
    pending, pending_start = features, 0
    lookup = NgramLookup(prompt_ids + [token], store=options.lookup_store) if options.lookup else None
    use_trees = (
        options.tree is not None
        and drafter is not None
        and target.supports_trees
        and constraint is None
        and penalties is None
    )
    stats.tree = options.tree if use_trees else None

    consistent = True  # the cache holds exactly positions < pos (between steps)
    try:
        finished = token in stop_ids or produced >= max_new
        stats.new_tokens = produced
        _finish(stats, finished, token in stop_ids, t_decode)
        yield Step([token], [False], finished, logprobs_of(logits[-1:], [token]))

        while not finished:
            # ---- draft ------------------------------------------------------------------------------------
            consistent = False
            t_step = time.perf_counter()
            room = min(max_new - produced - 1, target.max_positions - pos - 1)  # drafts that can still be emitted
            copied, copy_block = [], largest
            if lookup is not None:  # copies are as long as their own policy chooses (none: the largest block)
                copy_block = copy_policy.choose() if copy_policy is not None else largest
                copied = lookup.propose(min(copy_block - 1, room))
            drafts, q, tree, masks = torch.empty(0, dtype=torch.long, device=device), None, None, None
            q_columns = None  # the tokens q's columns score, where q is over a draft vocabulary
            if copied and constraint:  # one-hot proposals: cut at the first token the grammar refuses
                n, masks = constraint.cut(copied)
                copied = copied[:n]
            # a tree walked with the target's own tokens (greedy, coupled) holds the copy and the drafter's candidates
            hybrid = bool(copied) and use_trees and options.tree_copies and (params.greedy or noise is not None)
            if copied and not hybrid:  # a fixed function of the text: a one-hot proposal
                size, k = copy_block, len(copied)
                drafts = torch.tensor(copied, dtype=torch.long, device=device)
            else:
                size = copy_block if copied else (policy.choose() if policy else block)
                k = min((largest if copied else size) - 1, room) if drafter else 0
                if use_trees:  # a tree of N nodes is at most N deep: draft no further
                    k = min(k, options.tree)
                if k > 0:
                    t = time.perf_counter()
                    scores, columns = drafter.draft_scores(
                        context, pending, pending_start, token, pos, k, target.embed_tokens, target.lm_head
                    )  # [k, V'] over the draft vocabulary `columns` (None: the whole vocabulary)
                    pending = None
                    draft_params, mode = draft_sampling, options.proposal
                    if noise is not None:  # the Gumbel-max proposal under the target's noise: argmax of noisy scores
                        scores = noise.scores(scores, params, produced, columns)  # [k, V']
                        draft_params, mode = SamplingParams(), "argmax"
                    if use_trees:
                        if mode == "sample" and not draft_params.greedy:  # sampled candidates
                            q = warp(scores, draft_params)  # [k, V']: what each depth's candidates are drawn from
                            tree = sample_tree(q, columns, options.tree, gen)
                            if columns is not None:
                                q = over_vocabulary(q, columns, target.vocab_size)  # [k, vocab]
                        else:  # the drafter's top choices (greedy, or coupled: argmaxes of noisy scores) [+ the copy]
                            tree = build_tree(scores, columns, options.tree, copy=copied)
                        drafts = torch.tensor(tree.tokens, dtype=torch.long, device=device)
                    elif constraint:  # each row masked by what the grammar allows after the drafts before it
                        propose_row = functools.partial(
                            propose,
                            params=draft_params,
                            mode=mode,
                            generator=gen,
                            token_ids=columns,
                            vocab_size=target.vocab_size,
                        )
                        drafts, q, masks = constraint.propose(scores, columns, propose_row)
                        k = drafts.shape[0]
                    else:  # q over the draft vocabulary `columns` (None: the whole vocabulary)
                        drafts, q = propose(scores, draft_params, mode, gen, columns, target.vocab_size, dense=False)
                        q_columns = columns
                    stats.draft_s += time.perf_counter() - t
                if constraint and masks is None:
                    masks = constraint.allowed()[None]  # no drafts: the one verify row

            # ---- verify -----------------------------------------------------------------------------------
            t = time.perf_counter()
            block_ids = torch.cat((torch.tensor([token], device=device), drafts))[None]  # [1, rows]
            rows = block_ids.shape[1]
            if tree is not None:  # one pass over the tree, then walk down it with the target's own tokens
                shape = (tree.position_offsets(device), tree.attention_mask(device))
                logits, features = target.forward(block_ids, pos, cache, logits_rows=rows, tree=shape)  # [rows, vocab]
                if q is not None:  # sampled candidates: recursive rejection sampling down the tree
                    path, token = verify_tree_sampled(warp(logits, params), tree, q, gen)
                else:
                    if params.greedy:  # the target's token after each row: its argmax, or a sample drawn when reached
                        target_token = argmax(logits).tolist().__getitem__
                    else:  # row r decides output position produced + its depth
                        positions = [produced + d for d in (0, *tree.depths)]
                        target_token = functools.partial(
                            lambda rows_logits, at, r: choose(rows_logits[r], None, at[r]), logits, positions
                        )
                    path, token = tree.walk(target_token)
                kept = [0] + path  # rows of the anchor and the accepted nodes
                accepted, accepted_drafts = len(path), [tree.tokens[r - 1] for r in path]
                observed = scored(logits[kept], produced) if observer else None
            else:
                logits, features = target.forward(block_ids, pos, cache, logits_rows=rows)  # [rows, vocab]
                decided = adjusted(logits, drafts)  # row r: penalties over the output so far + drafts[:r]
                observed = None
                if params.greedy:
                    accepted, token = verify_greedy(decided, drafts, masks)
                elif noise is not None:  # coupled: greedy on the noisy scores of positions produced ..
                    rows_decided = masked(decided, masks)
                    accepted, token = longest_match(drafts.tolist(), noise.argmax(rows_decided, params, produced))
                    if observer:
                        observed = scored(rows_decided, produced)  # [rows, vocab]
                else:
                    accepted, token = verify_sampled_logits(masked(decided, masks), params, drafts, q, gen, q_columns)
                if observer and observed is None:
                    observed = masked(decided, masks)
                accepted_drafts = drafts[:accepted].tolist()
            stats.verify_s += time.perf_counter() - t
            stats.target_forwards += 1

            # ---- accept: keep the anchor + accepted drafts in both caches ----------------------------------
            if tree is not None:
                TargetAdapter.keep_rows(cache, pos, kept)
            else:
                TargetAdapter.crop(cache, pos + accepted + 1)
            if features is not None and (drafter or kept_features is not None):
                new = features[:, kept] if tree is not None else features[:, : accepted + 1]  # [1, accepted+1, F]
                if drafter:
                    pending, pending_start = (
                        (new, pos) if pending is None else (torch.cat((pending, new), 1), pending_start)
                    )
                if kept_features is not None:
                    kept_features.append(new)
            pos += accepted + 1

            emitted = accepted_drafts + [token]
            sequence += emitted
            consistent = True
            if context is not None:
                context.note_text(emitted)
            if lookup is not None:
                lookup.extend(emitted)
            if observer:
                observer(observed, emitted)
            stats.record_step(
                tree.depth if tree is not None else k,
                accepted,
                copied=bool(copied),
                from_store=bool(copied) and lookup.from_store,
                tree_nodes=len(tree) if tree is not None else 0,
            )
            if policy and not copied:  # the policy models the drafter's acceptance and cost
                policy.observe(size, k, accepted, time.perf_counter() - t_step)
            elif copy_policy is not None and copied:  # ... and its copy policy those of copied drafts
                copy_policy.observe(size, len(copied), accepted, time.perf_counter() - t_step)
            stop_at = next((i for i, t in enumerate(emitted) if t in stop_ids), None)
            if stop_at is not None:
                emitted = emitted[: stop_at + 1]
            if constraint:
                constraint.consume(emitted)
            if history is not None:
                history.consume(emitted)
            produced += len(emitted)
            finished = stop_at is not None or produced >= max_new
            stats.new_tokens = produced
            _finish(stats, finished, stop_at is not None, t_decode)
            yield Step(
                emitted,
                ([True] * accepted + [False])[: len(emitted)],
                finished,
                logprobs_of(logits[kept] if tree is not None else logits, emitted),
            )
    finally:
        if prefix_cache is not None and consistent:
            _keep(prefix_cache, target, cache, sequence[:pos], kept_features, feature_layers)


def _keep(
    prefix_cache: PrefixCache,
    target: TargetAdapter,
    cache: object,
    token_ids: list[int],
    kept_features: list[Tensor] | None,
    feature_layers: tuple[int, ...],
) -> None:
    """Keep a generation's processed sequence (its cache's positions < len(token_ids)) in the prefix cache."""
    one = target.snapshot(cache, 1)  # one position: its size, so that a sequence past the budget is not copied
    if one is None:
        return
    per_position = sum(t.numel() * t.element_size() for t in one)
    if kept_features:
        per_position += kept_features[0].shape[-1] * kept_features[0].element_size()
    if len(token_ids) * per_position > prefix_cache.max_bytes:
        return
    kv = target.snapshot(cache, len(token_ids))
    if kv is None:
        return
    features = torch.cat(kept_features, 1)[:, : len(token_ids)] if kept_features else None
    prefix_cache.add(CachedSequence(tuple(token_ids), *kv, features, feature_layers if features is not None else ()))


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


def _finish(stats: DecodeStats, finished: bool, stopped: bool, t_decode: float) -> None:
    stats.decode_s = time.perf_counter() - t_decode
    if finished:
        stats.finish_reason = "stop" if stopped else "length"


def _check(target: TargetAdapter, drafter: DFlashDrafter | None, prompt_ids: list[int], options: DecodeOptions) -> int:
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
