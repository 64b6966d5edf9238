"""The decode loop: prefill, then propose a block, verify it in one target pass, accept, update both caches.

    prefill   the target reads the prompt (or what the prefix cache lacks of it) and chooses the first token
    step      propose k candidates after the last token     (decoding/propose.py: copies, drafter chain or tree)
              one target pass over the anchor + candidates  ([k+1, vocab] logits, and features for the drafter)
              accept the longest prefix the rule allows     (decoding/verify.py: greedy, rejection, coupled, trees)
              keep those rows in the target's KV cache, hand their features to the drafter, emit accepted + 1

Without a drafter (and without prompt lookup) every step proposes nothing and verifies one row: plain
autoregressive decoding through the same code, the baseline that speedups are measured against. With prompt lookup
alone, a step where the text repeats verifies a copy, and every other step is such a plain step.

State between steps (:class:`Generation`):
  pos      index of `token`, the last emitted token; the target has processed positions < pos only
  cache    target KV cache over positions < pos
  context  drafter's injected K/V over the positions whose target features it has consumed (the proposer keeps the
           features of the positions processed since then)

Options are components the step calls, never branches in it: the :class:`~dflashkit.decoding.verify.Verifier` of the
sampler, the :class:`~dflashkit.decoding.propose.Proposer`, a grammar's constraint (masks), penalties (logits
adjusted by each row's own history), and observers (statistics, log-probabilities, a caller's ``observer``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from dflashkit.decoding.adaptive import AdaptiveBlockSize
from dflashkit.decoding.grammar import TokenConstraint, masked
from dflashkit.decoding.lookup import NgramLookup
from dflashkit.decoding.options import DecodeOptions, as_token_list, check_request, draft_window, proposal_params
from dflashkit.decoding.penalties import PenaltyState
from dflashkit.decoding.prefix_cache import CachedSequence, PrefixCache, ScopedPrefixCache
from dflashkit.decoding.propose import Proposal, Proposer
from dflashkit.decoding.sampling import PositionNoise
from dflashkit.decoding.stats import DecodeStats
from dflashkit.decoding.verify import CoupledVerifier, RejectionVerifier, Verifier
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import InvalidInputError
from dflashkit.target.adapter import TargetAdapter
from dflashkit.target.logprobs import TokenLogprob, token_logprobs

# Called after every target pass with its logits rows and the tokens the step emitted.
StepObserver = Callable[[Tensor, list[int]], None]


# Where an emitted token came from: a draft of the DFlash drafter that the target accepted, a copy of earlier text
# (prompt lookup: the prompt and output so far, or the n-gram store of past answers) that it accepted, or the target
# itself (each step's bonus / recovered token, the prefill's token, every token of plain decoding).
ORIGINS = ("drafter", "copy", "target")


@dataclass
class Step:
    """Tokens emitted by one target pass; origins[i] says which of :data:`ORIGINS` token i came from; logprobs[i]
    its log-probability under the target (with options.logprobs, else None)."""

    tokens: list[int]
    origins: list[str]
    finished: bool = False
    logprobs: list[TokenLogprob] | None = None

    @property
    def from_draft(self) -> list[bool]:
        """Whether each token was an accepted draft (the drafter's or a copy)."""
        return [o != "target" for o in self.origins]


@dataclass
class Generation:
    """One generation between steps: the target's cache and position, and the components each step calls."""

    target: TargetAdapter
    device: torch.device  # the target's (read once: the adapter's property looks it up on every call)
    cache: object  # the target's KV cache over positions < pos
    proposer: Proposer
    verifier: Verifier
    stats: DecodeStats
    options: DecodeOptions
    token: int  # the last emitted token, at position pos
    pos: int
    produced: int  # tokens emitted so far
    max_new: int
    stop_ids: frozenset[int]
    sequence: list[int]  # prompt + emitted; the cache holds sequence[:pos]
    constraint: TokenConstraint | None = None  # a grammar's state
    history: PenaltyState | None = None  # penalties' state
    observer: StepObserver | None = None
    kept_features: list[Tensor] | None = None  # features of positions < pos, for the prefix cache
    t_decode: float = 0.0

    def adjusted(self, rows: Tensor, drafts: Tensor | list[int] = ()) -> Tensor:
        """The logits a decision is made on: row r with penalties over the output so far + drafts[:r]."""
        return self.history.apply(rows, drafts) if self.history is not None else rows

    def emit(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Count emitted tokens (cut after a stop token) into the grammar, penalties and statistics."""
        stop_at = next((i for i, t in enumerate(tokens) if t in self.stop_ids), None)
        if stop_at is not None:
            tokens = tokens[: stop_at + 1]
        if self.constraint:
            self.constraint.consume(tokens)
        if self.history is not None:
            self.history.consume(tokens)
        self.produced += len(tokens)
        return tokens, self.finish(stop_at is not None)

    def finish(self, stopped: bool) -> bool:
        """Statistics after emitting; whether the generation ends (a stop token, or max_new tokens emitted)."""
        finished = stopped or self.produced >= self.max_new
        self.stats.new_tokens = self.produced
        self.stats.decode_s = time.perf_counter() - self.t_decode
        if finished:
            self.stats.finish_reason = "stop" if stopped else "length"
        return finished

    def logprobs(self, rows: Tensor, tokens: list[int]) -> list[TokenLogprob] | None:  # rows [>= len(tokens), vocab]
        return token_logprobs(rows, tokens, self.options.logprobs) if self.options.logprobs is not None else None


def step(g: Generation) -> Step:
    """One speculative step: propose, verify in one target pass, accept, update both caches."""
    t_step = time.perf_counter()
    room = min(g.max_new - g.produced - 1, g.target.max_positions - g.pos - 1)  # drafts that can still be emitted
    p = g.proposer.propose(g.token, g.pos, g.produced, room)  # p.drafts [k]: a chain, or a tree's nodes

    t = time.perf_counter()
    block_ids = torch.cat((torch.tensor([g.token], device=g.device), p.drafts))[None]  # [1, k+1]
    rows = block_ids.shape[1]
    if p.tree is not None:  # one pass over the tree, then walk down it with the target's own tokens
        shape = (p.tree.position_offsets(g.device), p.tree.attention_mask(g.device))
        logits, features = g.target.forward(block_ids, g.pos, g.cache, logits_rows=rows, tree=shape)  # [k+1, vocab]
        path, token = g.verifier.walk(logits, p, g.produced)
        kept = [0, *path]  # rows of the anchor and the accepted nodes
        accepted, drafts = len(path), [p.tree.tokens[r - 1] for r in path]
        if g.observer or g.options.logprobs is not None:
            logits = logits[kept]  # [accepted+1, vocab]: the rows that decided
        decided = logits
    else:
        logits, features = g.target.forward(block_ids, g.pos, g.cache, logits_rows=rows)  # [k+1, vocab]
        decided = g.adjusted(logits, p.drafts)
        accepted, token = g.verifier.chain(decided, p.masks, p, g.produced)
        kept, drafts = None, p.drafts[:accepted].tolist()
        if g.observer:
            decided = masked(decided, p.masks)
    g.stats.verify_s += time.perf_counter() - t
    g.stats.target_forwards += 1

    # accept: keep the anchor + accepted drafts in the target's cache, hand their features on
    if kept is not None:
        TargetAdapter.keep_rows(g.cache, g.pos, kept)
    else:
        TargetAdapter.crop(g.cache, g.pos + accepted + 1)
    new = None
    if features is not None and (g.proposer.drafter or g.kept_features is not None):
        new = features[:, kept] if kept is not None else features[:, : accepted + 1]  # [1, accepted+1, F]
        if g.kept_features is not None:
            g.kept_features.append(new)
    emitted = drafts + [token]
    g.proposer.accepted(emitted, new, g.pos)
    g.pos += accepted + 1
    g.sequence += emitted
    if g.observer:
        g.observer(g.verifier.observed(decided, g.produced), emitted)
    g.stats.record_step(
        p.tree.depth if p.tree is not None else p.drafted,
        accepted,
        copied=bool(p.copied),
        from_store=p.from_store,
        tree_nodes=len(p.tree) if p.tree is not None else 0,
    )
    g.proposer.observe(p, accepted, time.perf_counter() - t_step)
    g.token = token
    tokens, finished = g.emit(emitted)
    origins = (_draft_origins(p, drafts) + ["target"])[: len(tokens)]
    return Step(tokens, origins, finished, g.logprobs(logits, tokens))


def _draft_origins(p: Proposal, accepted: list[int]) -> list[str]:
    """The origin of each accepted draft: a chain is all copied or all drafted; in a tree that holds a copy and
    the drafter's candidates, a node on the copy's own path is the copy's (a token both offer is one node)."""
    if not p.copied:
        return ["drafter"] * len(accepted)
    if p.tree is None:
        return ["copy"] * len(accepted)
    on_copy = 0
    while on_copy < min(len(accepted), len(p.copied)) and accepted[on_copy] == p.copied[on_copy]:
        on_copy += 1
    return ["copy"] * on_copy + ["drafter"] * (len(accepted) - on_copy)


def decode(
    target: TargetAdapter,
    drafter: DFlashDrafter | None,
    prompt_ids: list[int],
    options: DecodeOptions,
    stats: DecodeStats | None = None,
    observer: StepObserver | None = None,
    block_policy: AdaptiveBlockSize | None = None,
    prefix_cache: PrefixCache | ScopedPrefixCache | None = None,
) -> Iterator[Step]:
    """Generate after `prompt_ids` (batch 1), yielding each step's tokens as soon as they are verified.

    With `block_policy`, each step's block size is chosen by it (at most the block size in force) and the
    step is reported back to it; with prompt lookup, copied drafts are as long as its ``copies`` policy
    chooses (copied and drafted tokens are accepted at different rates), or as its largest block without one.
    Without a drafter only its ``copies`` policy decides (prompt lookup alone, blocks of up to its largest when
    ``options.block_size`` is None; without lookup the policy is not used): a copy, or a plain step where copies
    do not pay (:class:`~dflashkit.decoding.adaptive.BlockPolicies` with ``lookup_alone``).
    With `prefix_cache`, the prefill restores the longest prefix of the prompt kept there and runs only the rest,
    and the generation's own sequence is kept there when it ends (:mod:`dflashkit.decoding.prefix_cache`).
    """
    prompt_ids = as_token_list(prompt_ids)
    block = check_request(target, drafter, prompt_ids, options)
    if drafter is None and not options.lookup:
        block_policy = None  # plain decoding: nothing to size
    elif drafter is None and block_policy is not None and options.block_size is None:
        block = block_policy.max_block  # prompt lookup alone: copies as long as the policy allows
    if block_policy is not None and block_policy.max_block > block:
        raise InvalidInputError(
            f"the adaptive policy allows blocks of {block_policy.max_block}, "
            f"more than the block size in force ({block})"
        )
    g, first = _prefill(target, drafter, prompt_ids, options, block, stats, observer, block_policy, prefix_cache)
    consistent = True  # the cache holds exactly positions < pos (between steps)
    try:
        finished = g.finish(g.token in g.stop_ids)
        yield Step([g.token], ["target"], finished, g.logprobs(first, [g.token]))
        while not finished:
            consistent = False
            out = step(g)
            consistent, finished = True, out.finished
            yield out
    finally:
        if prefix_cache is not None and consistent:
            _keep(prefix_cache, target, g.cache, g.sequence[: g.pos], g.kept_features, tuple(target.feature_layer_ids))


def _prefill(
    target: TargetAdapter,
    drafter: DFlashDrafter | None,
    prompt_ids: list[int],
    options: DecodeOptions,
    block: int,
    stats: DecodeStats | None,
    observer: StepObserver | None,
    block_policy: AdaptiveBlockSize | None,
    prefix_cache: PrefixCache | ScopedPrefixCache | None,
) -> tuple[Generation, Tensor]:
    """Set up the generation's components, run the prompt through the target and choose the first token; returns
    the generation and the prompt's last row of logits [1, vocab]."""
    policy = block_policy if drafter is not None else None  # the drafter's block sizes
    largest = block_policy.max_block if block_policy else block  # the largest block a step may use (drafted or copied)
    copy_policy = block_policy.copies if block_policy is not None and options.lookup else None
    stats = stats if stats is not None else DecodeStats(block_size=largest)
    stats.block_size, stats.prompt_tokens = largest, len(prompt_ids)
    stats.target_weights, stats.engine = target.weights, target.engine
    stats.lookup = options.lookup
    params, device = options.sampling, target.device
    seed = options.seed if options.seed is not None else random.randrange(1 << 62)
    gen = torch.Generator(device=device).manual_seed(seed)
    if params.greedy:
        verifier = Verifier()
    elif options.sampler == "coupled":  # each decision: the argmax of noisy scores; noise: f(seed, position)
        verifier = CoupledVerifier(params, PositionNoise(seed, target.vocab_size, device))
    else:
        verifier = RejectionVerifier(params, gen)
    stats.sampler = None if params.greedy else options.sampler
    max_new = min(options.max_new_tokens, target.max_positions - len(prompt_ids))
    constraint = options.grammar.start() if options.grammar is not None else None
    stats.grammar = options.grammar.kind if options.grammar is not None else None
    # a grammar ends at eos
    stop_ids = options.stop_token_ids | (constraint.eos_token_ids if constraint else frozenset())
    penalties = options.penalties if options.penalties is not None and options.penalties.active else None
    history = penalties.start(prompt_ids, target.vocab_size, device) if penalties else None

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
    decided = history.apply(logits[-1:]) if history is not None else logits[-1:]  # [1, vocab]
    masks = constraint.allowed()[None] if constraint else None  # [1, vocab]
    token = verifier.first(decided[-1], masks[0] if masks is not None else None, 0)
    if constraint:
        constraint.consume([token])
    if history is not None:
        history.consume([token])
    if observer:
        observer(verifier.observed(masked(decided, masks), 0), [token])
    stats.target_forwards += 1
    stats.prefill_s = time.perf_counter() - t_start

    pos = len(prompt_ids)
    stats.draft_window = draft_window(drafter, options) if drafter else None
    context = drafter.new_context(capacity=pos + max_new + block, window=stats.draft_window) if drafter else None
    if context is not None:  # drafts may propose the text's own tokens (dflashkit.drafter.text_columns)
        context.note_text([*prompt_ids, token])
    use_trees = (
        options.tree is not None
        and drafter is not None
        and target.supports_trees
        and constraint is None
        and penalties is None
    )
    stats.tree = options.tree if use_trees else None
    proposer = Proposer(
        target,
        drafter,
        context,
        features,
        lookup=NgramLookup(prompt_ids + [token], store=options.lookup_store) if options.lookup else None,
        block=block,
        largest=largest,
        policy=policy,
        copy_policy=copy_policy,
        rule=verifier,
        params=proposal_params(params, drafter, options) if drafter is not None and not params.greedy else params,
        proposal=options.proposal,
        tree=options.tree if use_trees else None,
        tree_copies=options.tree_copies,
        constraint=constraint,
        generator=gen,
        stats=stats,
    )
    return Generation(
        target=target,
        device=device,
        cache=cache,
        proposer=proposer,
        verifier=verifier,
        stats=stats,
        options=options,
        token=token,
        pos=pos,
        produced=1,
        max_new=max_new,
        stop_ids=stop_ids,
        sequence=[*prompt_ids, token],
        constraint=constraint,
        history=history,
        observer=observer,
        kept_features=[features] if prefix_cache is not None and features is not None else None,
        t_decode=time.perf_counter(),
    ), logits[-1:]


def _keep(
    prefix_cache: PrefixCache | ScopedPrefixCache,
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
