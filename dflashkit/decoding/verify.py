"""Verification: which drafts a target pass accepts, and the token it adds.

A step feeds the target the last emitted token (the anchor) and k drafts in one pass, and reads k + 1 rows of
logits: row j is the target's distribution p_j after the anchor and drafts[:j]. In the words of the speculative
decoding papers (Leviathan et al. 2023, "Fast inference from transformers via speculative decoding"; Chen et al.
2023, "Accelerating large language model decoding with speculative sampling"):

* **accepted** tokens: the longest prefix of the drafts the rule keeps;
* a **recovered** token: where draft j is rejected, a token drawn from the residual max(0, p_j - q_j) (normalised;
  greedy: the target's argmax, i.e. its own token at that position), which replaces it;
* the **bonus** token: when all k drafts are accepted, one more token drawn from p_k, for free.

Every step so emits accepted + 1 tokens, each distributed exactly as the target alone would emit it. Rules here:
greedy (:func:`verify_greedy`: drafts equal to the argmax), exact rejection sampling of chains
(:func:`verify_sampled`; sampled drafts as a block, Sun et al. 2024), coupled sampling (drafts equal to the target's
own Gumbel-max choice under the seed's noise, :func:`longest_match`) and token trees walked down from the root
(:func:`verify_tree_sampled`, :meth:`dflashkit.decoding.tree.DraftTree.walk`). The :class:`Verifier` classes at the
end are what the decode loop calls: one per sampler, each the same four questions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflashkit.decoding.grammar import masked
from dflashkit.decoding.propose import Proposal
from dflashkit.decoding.sampling import (
    PositionNoise,
    SamplingParams,
    argmax,
    over_vocabulary,
    sample,
    sample_at,
    temperature_only,
    warp,
)
from dflashkit.decoding.tree import DraftTree
from dflashkit.kernels import row_kernels


def verify_greedy(target_logits: Tensor, drafts: Tensor, allowed: Tensor | None = None) -> tuple[int, int]:
    """Longest prefix of drafts [k] matching the target's argmax, and the target's next token.

    target_logits [k+1, vocab]: row j predicts the token after the j-th verified input; ``allowed`` [k+1, vocab]:
    each row's tokens under a grammar (None: all).
    """
    # compared in Python: each small torch op after the target's pass pays 10-70 µs for the caches it swept
    return longest_match(drafts.tolist(), argmax(target_logits, allowed).tolist())


def longest_match(drafted: list[int], chosen: list[int]) -> tuple[int, int]:
    """The drafts kept when the target's own choices are ``chosen`` [k+1] (greedy, or coupled sampling's): the
    longest prefix of ``drafted`` [k] equal to them, and the target's token after it."""
    accepted = next((i for i, (d, b) in enumerate(zip(drafted, chosen)) if d != b), len(drafted))
    return accepted, chosen[accepted]


def verify_sampled(
    target_probs: Tensor,
    drafts: Tensor,
    draft_probs: Tensor | None,
    generator: torch.Generator | None,
    uniforms: list[float] | None = None,
) -> tuple[int, int]:
    """Exact speculative sampling over a chain of k drafts.

    target_probs [k+1, vocab] (warped); drafts [k]; draft_probs [k, vocab] or None for one-hot proposals.
    Returns (number of accepted drafts, the token emitted after them).

    Sampled drafts are verified as a block (:func:`block_verification`), which keeps at least as many drafts in
    expectation as accepting them token by token; for one-hot proposals (argmax drafts, copies) the two rules
    have the same law and the token-by-token one, a little cheaper, is used.

    ``uniforms``: the k + 1 numbers in [0, 1) it decides with (drawn from ``generator`` where None): u_i is draft
    i+1's coin (kept while u_i < p(x) for one-hot drafts; the block's stops otherwise), and the emitted token lies at
    1 - u_k of its distribution's running sum. :func:`verify_sampled_logits` gives the row kernels' version of this
    function the same numbers, used the same way.
    """
    k = drafts.shape[0]
    if uniforms is None:
        uniforms = torch.rand(k + 1, generator=generator, dtype=torch.float64, device=target_probs.device).tolist()
    at = 1 - uniforms[k]
    if k and draft_probs is not None:
        weights = block_weights(target_probs, drafts, draft_probs)
        # the prefix ends at the last offset i whose coin comes up (probability h_i); h_i <= w_i, so a coin at or
        # above w_i fails without reading the vocabulary row that h_i needs (w_i is tiny beyond a few offsets)
        accepted = next(
            (
                i
                for i in range(k, 0, -1)
                if uniforms[i - 1] < weights[i] and uniforms[i - 1] < block_stop(target_probs, draft_probs, weights, i)
            ),
            0,
        )
        if accepted == k:
            return k, sample_at(target_probs[k], at)
        return accepted, sample_at(block_residual(target_probs, draft_probs, weights, accepted), at)
    p_x = (
        target_probs[torch.arange(k, device=drafts.device), drafts].tolist() if k else []
    )  # one-hot q: accept w.p. p(x)
    accepted = next((i for i in range(k) if not uniforms[i] < p_x[i]), k)
    if accepted == k:
        return k, sample_at(target_probs[k], at)
    residual = target_probs[accepted].clone()
    residual[drafts[accepted]] = 0
    return accepted, sample_at(residual if float(residual.sum()) > 0 else target_probs[accepted], at)


def verify_sampled_logits(
    logits: Tensor,
    params: SamplingParams,
    drafts: Tensor,
    draft_probs: Tensor | None,
    generator: torch.Generator | None,
    columns: Tensor | None = None,
) -> tuple[int, int]:
    """:func:`verify_sampled` on the target's rows of logits [k+1, vocab] (masked or adjusted as the step needs),
    warped as ``params`` ask; draft_probs [k, vocab], or [k, V'] over the tokens ``columns`` (a draft vocabulary:
    :func:`propose` with ``dense=False``). Where a temperature alone warps them and the row kernels run (CPU), the
    whole verification is one call (:func:`dflashkit.kernels.row_kernels.verify_chain`: ~0.2 ms a sampled step
    against ~0.7 for the ~40 torch ops of warping and verifying, each slowed by the caches the target's pass has
    just swept); elsewhere torch's. Both decide with the same k + 1 uniforms, the same way: they emit the same
    tokens but where the rounding of a probability decides."""
    k = drafts.shape[0]
    uniforms = torch.rand(k + 1, generator=generator, dtype=torch.float64, device=logits.device)
    if temperature_only(params, logits.shape[-1]):
        done = row_kernels.verify_chain(logits, params.temperature, drafts, draft_probs, uniforms, columns)
        if done is not None:
            return done
    if draft_probs is not None and columns is not None:
        draft_probs = over_vocabulary(draft_probs, columns, logits.shape[-1])
    return verify_sampled(warp(logits, params), drafts, draft_probs, generator, uniforms.tolist())


def block_verification(target_probs: Tensor, drafts: Tensor, draft_probs: Tensor) -> tuple[list[float], list[float]]:
    """The law of block verification (Sun et al. 2024, "Block verification accelerates speculative decoding"):
    of all exact ways to verify one chain of drafts, the one that keeps the most drafts in expectation.

    With p the target's rows and q the drafter's, the weights are w_0 = 1, w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i))
    (w_i bounds how much of the target's mass on x_1..x_i the drafts can claim), and the residual after i drafts
    is r_i = max(0, w_i p_{i+1} - q_{i+1}) (:func:`block_residual`). Walking back from i = k, the kept prefix
    ends at i with probability h_k = w_k, h_i = |r_i| / (|r_i| + 1 - w_i) for 0 < i < k (:func:`block_stop`),
    given that it did not end further on; where it ends at i < k the next token is drawn from r_i. With k = 1
    this is the usual min(1, p / q) acceptance and norm(max(0, p - q)) correction.

    target_probs [k+1, vocab], drafts [k], draft_probs [k, vocab]. Returns (weights w_0..w_k, stops h_1..h_k).
    """
    weights = block_weights(target_probs, drafts, draft_probs)
    return weights, [block_stop(target_probs, draft_probs, weights, i) for i in range(1, drafts.shape[0] + 1)]


def block_weights(target_probs: Tensor, drafts: Tensor, draft_probs: Tensor) -> list[float]:
    """w_0..w_k of :func:`block_verification`: w_0 = 1, w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i))."""
    idx = torch.arange(drafts.shape[0], device=drafts.device)
    ratios = (target_probs[idx, drafts].double() / draft_probs[idx, drafts].double()).tolist()  # q(x) > 0: drawn
    weights = [1.0]
    for ratio in ratios:
        weights.append(min(1.0, weights[-1] * ratio))
    return weights


def block_stop(target_probs: Tensor, draft_probs: Tensor, weights: list[float], i: int) -> float:
    """h_i of :func:`block_verification` (1 <= i <= k): h_k = w_k, else |r_i| / (|r_i| + 1 - w_i) <= w_i."""
    if i == len(weights) - 1:
        return weights[i]
    mass = float((weights[i] * target_probs[i] - draft_probs[i]).clamp_min(0).sum())  # |r_i|, one [vocab] row
    denominator = mass + 1.0 - weights[i]
    return mass / denominator if denominator > 0 else 1.0  # 0/0 only where w_i = 1 and r_i = 0


def block_residual(target_probs: Tensor, draft_probs: Tensor, weights: list[float], i: int) -> Tensor:
    """The distribution [vocab] of the token emitted after i kept drafts (i < k): max(0, w_i p_{i+1} - q_{i+1}),
    normalised (the target's row where rounding left it empty: an event of probability 0)."""
    residual = (weights[i] * target_probs[i] - draft_probs[i]).clamp_min(0)
    total = residual.sum()
    return residual / total if total > 0 else target_probs[i]


def verify_tree_sampled(
    target_probs: Tensor, tree: DraftTree, draft_probs: Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Exact speculative sampling over a token tree (recursive rejection sampling; SpecInfer, Miao et al. 2024;
    without replacement as in Jeon et al. 2024).

    target_probs [rows, vocab] (warped; row 0 the anchor, row i+1 node i); draft_probs [depth, vocab]: the
    distribution the candidates at each depth were drawn from, without replacement and in the order the tree
    lists a node's children (:func:`dflashkit.decoding.tree.sample_tree`). At a node with target distribution p, the
    i-th child x_i is accepted with probability min(1, p(x_i) / q_i(x_i)), q_i the proposal with the earlier
    children removed and renormalised; after a rejection p becomes norm(max(0, p - q_i)). An accepted child
    continues the walk from its own row; where every child is rejected (or there are none) the token is drawn
    from what p has become. Given the tokens before it each emitted token is distributed as the target's.
    Returns the rows of the accepted nodes (a path from the anchor) and the token emitted after them.
    """
    uniforms = torch.rand(
        len(tree), generator=generator, dtype=torch.float64, device=target_probs.device
    ).tolist()  # one per node
    row, path = 0, []
    while True:
        p, reached = target_probs[row], None
        children = tree.children(row)
        if children:
            q = draft_probs[tree.row_depth(row)]
            left = float(q.sum())  # q's mass not yet proposed: q_i = q / left, the tried children being 0 in p
            for token, child in children:
                q_x = float(q[token]) / left
                if q_x <= 0:  # never for a drawn candidate
                    break
                if uniforms[child - 1] * q_x < float(p[token]):  # P(accept) = min(1, p / q_i)
                    reached = child
                    break
                # p <- norm(max(0, p - q_i)): where a tried child's q_i is still counted, p is already 0 there
                residual = (p - q * (1.0 / left)).clamp_min_(0)
                total = float(residual.sum())
                p = residual.div_(total) if total > 0 else p  # total 0 only if p == q_i, where nothing is rejected
                left -= float(q[token])
        if reached is None:
            return path, int(sample(p, generator))
        path.append(reached)
        row = reached


NO_DRAFTS = torch.empty(0, dtype=torch.long)


class Verifier:
    """How a step decides the target's tokens: greedy (this class), :class:`RejectionVerifier` or
    :class:`CoupledVerifier`. ``position`` is the output position a row decides (coupled noise depends on it)."""

    walks_own_tokens = True  # a tree is walked with the target's own choice per row (greedy, coupled)

    def first(self, row: Tensor, allowed: Tensor | None, position: int) -> int:
        """The target's token from one row [vocab] (prefill), among ``allowed`` [vocab] (None: all)."""
        return int(argmax(row, allowed))

    def chain(self, rows: Tensor, masks: Tensor | None, proposal: Proposal, position: int) -> tuple[int, int]:
        """(accepted drafts, next token) of a chain; rows [k+1, vocab] as adjusted, masks [k+1, vocab] or None."""
        return verify_greedy(rows, proposal.drafts, masks)

    def walk(self, logits: Tensor, proposal: Proposal, position: int) -> tuple[list[int], int]:
        """(accepted node rows, next token) of a tree pass; logits [nodes+1, vocab]."""
        return proposal.tree.walk(argmax(logits).tolist().__getitem__)

    def observed(self, rows: Tensor, position: int) -> Tensor:
        """What an observer sees of the rows that decided: the scores the decision maximised."""
        return rows

    def drafting(
        self, scores: Tensor, position: int, columns: Tensor | None, params: SamplingParams, mode: str
    ) -> tuple[Tensor, SamplingParams, str]:
        """The drafter's scores [k, V'] and how drafts are drawn from them (params, "sample" or "argmax")."""
        return scores, params, mode


class RejectionVerifier(Verifier):
    """Exact speculative (rejection) sampling with the generation's ``generator``."""

    walks_own_tokens = False

    def __init__(self, params: SamplingParams, generator: torch.Generator) -> None:
        self.params, self.generator = params, generator

    def first(self, row: Tensor, allowed: Tensor | None, position: int) -> int:
        return verify_sampled_logits(masked(row, allowed)[None], self.params, NO_DRAFTS, None, self.generator)[1]

    def chain(self, rows: Tensor, masks: Tensor | None, proposal: Proposal, position: int) -> tuple[int, int]:
        p = proposal
        return verify_sampled_logits(masked(rows, masks), self.params, p.drafts, p.q, self.generator, p.q_columns)

    def walk(self, logits: Tensor, proposal: Proposal, position: int) -> tuple[list[int], int]:
        if proposal.q is not None:  # sampled candidates: recursive rejection sampling down the tree
            return verify_tree_sampled(warp(logits, self.params), proposal.tree, proposal.q, self.generator)
        return proposal.tree.walk(lambda r: self.first(logits[r], None, position))  # the drafter's top choices


class CoupledVerifier(Verifier):
    """Coupled sampling: every decision is the argmax of the row's scores plus the seed's Gumbel noise at its output
    position (:class:`~dflashkit.decoding.sampling.PositionNoise`), so the text is the seed's plain sampled text
    whatever is drafted; drafts are proposed under the same noise and accepted where they equal those choices."""

    def __init__(self, params: SamplingParams, noise: PositionNoise) -> None:
        self.params, self.noise = params, noise

    def first(self, row: Tensor, allowed: Tensor | None, position: int) -> int:
        return self.noise.argmax(masked(row, allowed)[None], self.params, position)[0]

    def chain(self, rows: Tensor, masks: Tensor | None, proposal: Proposal, position: int) -> tuple[int, int]:
        return longest_match(proposal.drafts.tolist(), self.noise.argmax(masked(rows, masks), self.params, position))

    def walk(self, logits: Tensor, proposal: Proposal, position: int) -> tuple[list[int], int]:
        at = [position + d for d in (0, *proposal.tree.depths)]  # row r decides output position + its depth
        return proposal.tree.walk(lambda r: self.first(logits[r], None, at[r]))

    def observed(self, rows: Tensor, position: int) -> Tensor:
        return self.noise.scores(rows, self.params, position)

    def drafting(
        self, scores: Tensor, position: int, columns: Tensor | None, params: SamplingParams, mode: str
    ) -> tuple[Tensor, SamplingParams, str]:
        # the Gumbel-max proposal under the target's noise: the argmax of the drafter's noisy scores
        return self.noise.scores(scores, self.params, position, columns), SamplingParams(), "argmax"
