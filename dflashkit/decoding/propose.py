"""What a step verifies: a copy of earlier text (prompt lookup, the n-gram store), the drafter's chain or token tree,
cut where a grammar refuses; block sizes chosen by the adaptive policies.

A :class:`Proposal` is the step's candidates; :class:`Proposer` makes one per step and learns from the outcome
(:meth:`Proposer.accepted`). Another kind of drafter plugs in by providing ``draft_scores`` as
:class:`~dflashkit.drafter.network.DFlashDrafter` does: scores for k positions from the target features it is fed.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from dflashkit.decoding.adaptive import AdaptiveBlockSize
from dflashkit.decoding.grammar import TokenConstraint
from dflashkit.decoding.lookup import NgramLookup
from dflashkit.decoding.sampling import SamplingParams, over_vocabulary, propose, warp
from dflashkit.decoding.stats import DecodeStats
from dflashkit.decoding.tree import DraftTree, build_tree, sample_tree


@dataclass
class Proposal:
    """One step's candidates after the anchor: a chain of drafts, or the nodes of a tree."""

    drafts: Tensor  # [k] long: the chain, or the tree's nodes in order
    size: int  # the block size the step runs at (what the adaptive policies judge)
    drafted: int  # drafts asked of the drafter (k), or the copy's length
    copied: list[int] = field(default_factory=list)  # tokens copied from earlier text ([]: none)
    from_store: bool = False  # the copy came from the n-gram store
    q: Tensor | None = None  # [k, V'] (chains) or [k, vocab] (trees): what sampled drafts were drawn from
    q_columns: Tensor | None = None  # the tokens q's columns score, where q is over a draft vocabulary
    tree: DraftTree | None = None
    masks: Tensor | None = None  # [rows, vocab] bool: each verify row's tokens under a grammar


class DraftRule(Protocol):
    """How drafts are drawn from the drafter's scores (the verifier's side of it: coupled sampling adds its noise)."""

    walks_own_tokens: bool

    def drafting(
        self, scores: Tensor, position: int, columns: Tensor | None, params: SamplingParams, mode: str
    ) -> tuple[Tensor, SamplingParams, str]: ...


class Proposer:
    """Proposes each step's candidates and keeps the drafter's inputs (the target features it has not read yet).

    ``policy`` chooses the drafter's block sizes and ``copy_policy`` the copies' (None: ``largest``); without a
    drafter (prompt lookup alone) the copy policy may choose size 1, no copy, and every step without a copy is
    reported to it as a plain step. ``tree``: the node budget of token trees (None: chains); ``tree_copies``: a
    greedy or coupled tree also holds the copy.
    """

    def __init__(
        self,
        target: Any,
        drafter: Any,
        context: Any,
        features: Tensor | None,
        *,
        lookup: NgramLookup | None,
        block: int,
        largest: int,
        policy: AdaptiveBlockSize | None,
        copy_policy: AdaptiveBlockSize | None,
        rule: DraftRule,
        params: SamplingParams,
        proposal: str,
        tree: int | None,
        tree_copies: bool,
        constraint: TokenConstraint | None,
        generator: torch.Generator,
        stats: DecodeStats,
    ) -> None:
        self.target, self.drafter, self.context = target, drafter, context
        self.pending, self.pending_start = features, 0  # features of processed positions not yet in `context`
        self.lookup, self.block, self.largest = lookup, block, largest
        self.policy, self.copy_policy = policy, copy_policy
        self.rule, self.params, self.mode = rule, params, proposal
        self.tree, self.tree_copies = tree, tree_copies
        self.constraint, self.generator, self.stats = constraint, generator, stats
        self.none = torch.empty(0, dtype=torch.long, device=target.device)

    def propose(self, token: int, pos: int, produced: int, room: int) -> Proposal:
        """Candidates after ``token`` (at ``pos``, output position ``produced``), at most ``room`` of them."""
        copied, copy_block, masks = [], self.largest, None
        if self.lookup is not None:  # copies are as long as their own policy chooses (none: the largest block)
            copied = self.lookup.propose(min(self.largest - 1, room))
            if copied and self.copy_policy is not None:  # the policy is asked only where there is a copy to size
                copy_block = self.copy_policy.choose()  # 1 (prompt lookup alone): a plain step pays more
                copied = copied[: copy_block - 1]
        if copied and self.constraint:  # one-hot proposals: cut at the first token the grammar refuses
            n, masks = self.constraint.cut(copied)
            copied = copied[:n]
        from_store = bool(copied) and self.lookup.from_store
        # a tree walked with the target's own tokens (greedy, coupled) holds the copy and the drafter's candidates
        in_tree = bool(copied) and self.tree is not None and self.tree_copies and self.rule.walks_own_tokens
        if copied and not in_tree:  # a fixed function of the text: a one-hot proposal
            drafts = torch.tensor(copied, dtype=torch.long, device=self.none.device)
            return Proposal(drafts, copy_block, len(copied), copied, from_store, masks=masks)
        if self.drafter is None:  # no copy, no drafter: a plain step (size 1)
            size, k = 1, 0
        else:
            size = copy_block if copied else (self.policy.choose() if self.policy else self.block)
            k = min((self.largest if copied else size) - 1, room)
        if self.tree is not None:  # a tree of N nodes is at most N deep: draft no further
            k = min(k, self.tree)
        proposal = Proposal(self.none, size, k, copied, from_store)
        if k > 0:
            t = time.perf_counter()
            self._draft(proposal, token, pos, produced)
            self.stats.draft_s += time.perf_counter() - t
        if self.constraint and proposal.masks is None:
            proposal.masks = self.constraint.allowed()[None]  # no drafts: the one verify row
        return proposal

    def _draft(self, p: Proposal, token: int, pos: int, produced: int) -> None:
        """The drafter's k = ``p.drafted`` candidates: a chain, a tree, or a chain the grammar cuts."""
        vocab = self.target.vocab_size
        scores, columns = self.drafter.draft_scores(
            self.context,
            self.pending,
            self.pending_start,
            token,
            pos,
            p.drafted,
            self.target.embed_tokens,
            self.target.lm_head,
        )  # [k, V'] over the draft vocabulary `columns` (None: the whole vocabulary)
        self.pending = None
        scores, params, mode = self.rule.drafting(scores, produced, columns, self.params, self.mode)
        if self.tree is not None:
            if mode == "sample" and not params.greedy:  # sampled candidates, drawn from q
                q = warp(scores, params)  # [k, V']
                p.tree = sample_tree(q, columns, self.tree, self.generator)
                p.q = over_vocabulary(q, columns, vocab) if columns is not None else q  # [k, vocab]
            else:  # the drafter's top choices (greedy, or coupled: argmaxes of noisy scores) [+ the copy]
                p.tree = build_tree(scores, columns, self.tree, copy=p.copied)
            p.drafts = torch.tensor(p.tree.tokens, dtype=torch.long, device=self.none.device)
        elif self.constraint:  # each row masked by what the grammar allows after the drafts before it
            row = functools.partial(
                propose, params=params, mode=mode, generator=self.generator, token_ids=columns, vocab_size=vocab
            )
            p.drafts, p.q, p.masks = self.constraint.propose(scores, columns, row)
            p.drafted = p.drafts.shape[0]
        else:  # q over the draft vocabulary `columns` (None: the whole vocabulary)
            p.drafts, p.q = propose(scores, params, mode, self.generator, columns, vocab, dense=False)
            p.q_columns = columns

    def accepted(self, emitted: list[int], features: Tensor | None, pos: int) -> None:
        """After verification: the target features of the accepted rows at ``pos``.. ([1, n, F]) and the emitted
        tokens, for the drafter's next step and the copies."""
        if self.drafter and features is not None:
            if self.pending is None:
                self.pending, self.pending_start = features, pos
            else:
                self.pending = torch.cat((self.pending, features), 1)
        if self.context is not None:
            self.context.note_text(emitted)
        if self.lookup is not None:
            self.lookup.extend(emitted)

    def observe(self, p: Proposal, accepted: int, seconds: float) -> None:
        """The step's outcome, for the policy that chose its size (the drafter's, or the copies'); without a drafter
        a step without a copy is a plain step, which the copy policy weighs copies against."""
        if self.policy and not p.copied:  # the policy models the drafter's acceptance and cost
            self.policy.observe(p.size, p.drafted, accepted, seconds)
        elif self.copy_policy is not None and (p.copied or self.drafter is None):
            self.copy_policy.observe(p.size, len(p.copied), accepted, seconds)
