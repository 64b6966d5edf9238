"""Token-tree drafts: several candidates per block position, verified together in one target pass.

A DFlash drafter scores every block position in one pass, each conditioned only on the context and the
anchor (its rows are marginals, not conditioned on the drafts before them). A chain keeps each row's top
token; a tree keeps, where the drafter is unsure, its second and third choices too. The tree is built best
first (as EAGLE-2's dynamic trees): a node's value is the product of the drafter's probabilities along its
path, and the `budget` nodes of largest value are kept, so that a confident drafter gets a deep narrow tree
and an unsure one a wide shallow one.

Greedy (and coupled sampling, whose decisions are argmaxes of noisy scores) verification walks down the tree with
the target's own tokens: at the anchor the target picks its token
(argmax, or a sample from its warped distribution); if a child of the current node carries that token the
walk moves there and the target picks again from that node's logits row; otherwise the token is emitted and
the step ends. Every emitted token is the target's own choice given exactly the tokens before it, so the
output is the plain decoder's (greedy) or distributed as the plain decoder's (sampling): lossless by
construction, without any acceptance ratio.

With prompt lookup, a greedy or coupled step whose text has a copy verifies one tree of the copy and the
drafter's candidates (:func:`build_tree` with ``copy``): where the copy goes wrong, the drafter's branches carry on.

When sampling with rejection (the default sampler without a seed), a node's children are instead drawn from
the drafter without replacement (:func:`sample_tree`) and tried in turn by recursive rejection sampling
(:func:`dflashkit.decoding.sampling.verify_tree_sampled`): the target's sample falls among the drafter's top choices far
less often than one of several sampled candidates is accepted.

Rows of the verify pass: row 0 is the anchor (the last emitted token), row i >= 1 is node i-1; each row
attends to the cache, its ancestors and itself, at position start + depth.
"""

from __future__ import annotations

import heapq
import itertools
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflashkit.errors import InvalidInputError
from dflashkit.kernels import row_kernels

TOP_CANDIDATES = 4  # candidates per block position a tree may use (the drafter's top-4 of each row)
# What a copied token (prompt lookup, the n-gram store) is worth per depth in a tree that also holds the drafter's
# candidates (:func:`build_tree` with ``copy``). Replayed greedy answers with the shipped drafter and 15 nodes reached
# the highest τ at 0.8 and 0.95 (of 0.5 / 0.8 / 0.95), each best on some evaluation sets; 0.9 lies between the two
# (docs/experiments.md, "Does one verify tree holding both the copy ... reach τ 3.5?").
COPY_WORTH = 0.9


@dataclass
class DraftTree:
    """Nodes in the order they were chosen (a parent always before its children)."""

    tokens: list[int]  # token id of each node
    parents: list[int]  # row of each node's parent: 0 for the anchor, i+1 for node i
    depths: list[int]  # 1 for the anchor's children
    _children: list[dict[int, int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not (len(self.tokens) == len(self.parents) == len(self.depths)):
            raise InvalidInputError("a draft tree needs one parent and one depth per token")
        self._children = [{} for _ in range(len(self.tokens) + 1)]  # per row: token -> row of that child
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if not 0 <= parent <= i:
                raise InvalidInputError(f"node {i}: parent row {parent} does not come before it")
            if token in self._children[parent]:
                raise InvalidInputError(f"node {i}: its parent already has a child with token {token}")
            self._children[parent][token] = i + 1

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def child(self, row: int, token: int) -> int | None:
        """Row of the child of `row` that carries `token`, if there is one."""
        return self._children[row].get(token)

    def position_offsets(self, device: torch.device | str = "cpu") -> Tensor:
        """Offset of each row from the anchor's position [n+1]: 0 for the anchor, a node's depth."""
        return torch.tensor([0] + self.depths, device=device)

    def attention_mask(self, device: torch.device | str = "cpu") -> Tensor:
        """bool [n+1, n+1]: row r sees row c iff c is r or one of its ancestors (the anchor is everyone's). Built in
        bytes, one tensor at the end (4 µs for 12 rows; row by row in torch, 45)."""
        n = len(self.tokens) + 1
        flat = bytearray(n * n)
        flat[0] = 1
        for i, parent in enumerate(self.parents):  # a row sees what its parent sees, and itself
            row = (i + 1) * n
            flat[row : row + n] = flat[parent * n : parent * n + n]
            flat[row + i + 1] = 1
        return torch.frombuffer(flat, dtype=torch.bool).view(n, n).to(device)

    def children(self, row: int) -> list[tuple[int, int]]:
        """(token, row) of each child of `row`, in the order the children were chosen."""
        return list(self._children[row].items())

    def row_depth(self, row: int) -> int:
        """Depth of a row: 0 for the anchor, a node's depth otherwise."""
        return self.depths[row - 1] if row else 0

    def walk(self, choose: Callable[[int], int]) -> tuple[list[int], int]:
        """Follow the target's tokens down the tree: ``choose(row)`` is the target's token after `row`.

        Returns the rows of the accepted nodes (a path from the anchor) and the target's token after the last.
        """
        row, path = 0, []
        while True:
            token = choose(row)
            nxt = self.child(row, token)
            if nxt is None:
                return path, token
            path.append(nxt)
            row = nxt


def _whole(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_tree_option(tree: object) -> int | None:
    """A generation's ``tree`` option: None (the default: chains, or the trees that seeded sampling verifies by
    default), 0 (chains whatever the default) or a node budget >= 1; raises InvalidInputError otherwise."""
    if tree is not None and not (_whole(tree) and tree >= 0):
        raise InvalidInputError(f"tree must be 0 (chains) or a number of nodes >= 1 (None: the default), got {tree!r}")
    return None if tree is None else int(tree)


def check_budget(budget: object) -> int:
    """A token tree's node budget: an int >= 1 (booleans refused); raises InvalidInputError otherwise."""
    if not (_whole(budget) and budget >= 1):
        raise InvalidInputError(f"tree must be a number of nodes, at least one node (None: a chain), got {budget!r}")
    return int(budget)


def best_first(probs: list[list[float]], budget: int) -> tuple[list[int], list[int], list[int]]:
    """The shape of the best tree: ``probs[d][r]`` is the probability of the r-th choice at depth d+1 (each row
    sorted, largest first); a node's value is the product along its path. Returns parents (row: 0 for the
    anchor, i+1 for node i), depths and ranks of the `budget` nodes of largest value, in the order chosen
    (a parent before its children). A popped node pushes its next sibling and its first child, so at most
    2·budget nodes are ever scored."""
    check_budget(budget)
    parents: list[int] = []
    depths: list[int] = []
    ranks: list[int] = []
    values = [1.0]  # by row: the anchor's, then each chosen node's
    heap = [(-probs[0][0], 0, 0, 1, 0)]  # (-value, order, parent row, depth, rank): order breaks ties
    order = 1
    while heap and len(parents) < budget:
        neg, _, parent, depth, rank = heapq.heappop(heap)
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        values.append(-neg)
        if rank + 1 < len(probs[depth - 1]):  # the next sibling: same parent, the next choice at this depth
            heapq.heappush(heap, (-values[parent] * probs[depth - 1][rank + 1], order, parent, depth, rank + 1))
            order += 1
        if depth < len(probs):  # the first child: one position deeper, the first choice there
            heapq.heappush(heap, (neg * probs[depth][0], order, len(parents), depth + 1, 0))
            order += 1
    return parents, depths, ranks


def build_tree(
    scores: Tensor,
    columns: Tensor | None,
    budget: int,
    top: int = TOP_CANDIDATES,
    copy: Sequence[int] = (),
    copy_worth: float = COPY_WORTH,
) -> DraftTree:
    """The `budget` nodes of largest path probability from drafter scores [k, V'] (row j: block offset j+1).

    ``columns`` [V'] maps score columns to token ids (None: the columns are the vocabulary). Each position
    offers its `top` best tokens; a node's value is the product of the drafter's softmax probabilities along
    its path (a path down the first choices is the chain); see :func:`best_first`.

    ``copy``: a copied continuation (prompt lookup, the n-gram store) that competes for the same budget: its
    token at depth d is worth ``copy_worth ** d``, and the drafter's candidates hang under copied nodes too,
    worth the copied node's value times their probability (:func:`hybrid_tree`). One verify then holds the
    copy and the drafter's alternatives where the copy may go wrong: the greedy walk takes whichever the
    target follows.
    """
    top = min(top, scores.shape[1])
    fused = row_kernels.top_probs(scores, top)  # bf16 on a CPU: one pass per row (ties: the smaller index first)
    probs, index = fused if fused is not None else scores.float().softmax(-1).topk(top, dim=-1)  # [k, top] each
    tokens = (columns[index] if columns is not None else index).tolist()
    if copy:
        return hybrid_tree(probs.tolist(), tokens, list(copy), budget, copy_worth)
    return _best_tree(probs.tolist(), tokens, budget)


def hybrid_tree(
    probs: list[list[float]],
    tokens: list[list[int]],
    copy: list[int],
    budget: int,
    copy_worth: float = COPY_WORTH,
    min_worth: float = 0.0,
) -> DraftTree:
    """Best first over two sources: the copy (its d-th token worth copy_worth^d, offered under the copy's own
    prefix) and the drafter (``tokens[d][r]`` with probability ``probs[d][r]`` at depth d+1, under any node,
    worth the node's value times that probability). A token offered twice under one node is one node. Nodes
    worth less than ``min_worth`` are left out (docs/experiments.md weighs that; decoding uses 0)."""
    check_budget(budget)
    chosen: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    worth = [1.0]  # by row: the anchor, then each chosen node
    on_copy = [True]  # by row: whether its path is a prefix of the copy
    children: list[set[int]] = [set()]
    heap: list[tuple[float, int, int, int, int]] = []  # (-value, order, parent row, depth, token)
    order = itertools.count()  # ties: the earlier offer first

    def offer(row: int) -> None:
        depth = (depths[row - 1] if row else 0) + 1
        if on_copy[row] and depth <= len(copy):
            heapq.heappush(heap, (-(copy_worth**depth), next(order), row, depth, copy[depth - 1]))
        if depth <= len(probs):
            for p, t in zip(probs[depth - 1], tokens[depth - 1]):
                heapq.heappush(heap, (-worth[row] * p, next(order), row, depth, t))

    offer(0)
    while heap and len(chosen) < budget:
        neg, _, parent, depth, token = heapq.heappop(heap)
        if -neg < min_worth:  # the rest are worth less still
            break
        if token in children[parent]:
            continue
        children[parent].add(token)
        chosen.append(token)
        parents.append(parent)
        depths.append(depth)
        worth.append(-neg)
        on_copy.append(on_copy[parent] and depth <= len(copy) and copy[depth - 1] == token)
        children.append(set())
        offer(len(chosen))
    return DraftTree(chosen, parents, depths)


def _best_tree(probs: list[list[float]], tokens: list[list[int]], budget: int) -> DraftTree:
    """The tree of :func:`best_first`'s shape over sorted probabilities ``probs[d][r]``, node tokens
    ``tokens[d][r]`` (the r-th candidate at depth d+1)."""
    parents, depths, ranks = best_first(probs, budget)
    return DraftTree([tokens[d - 1][r] for d, r in zip(depths, ranks)], parents, depths)


def sample_without_replacement(probs: Tensor, count: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Per row of probs [k, V], up to `count` distinct indices drawn one after another, each draw from what is
    left renormalised (the order matters: the i-th index is what the i-th rejection-sampling stage proposes).
    Gumbel-top-k (Vieira 2014; Kool et al. 2019): the largest log p + Gumbel noise, in order, are such draws, for
    all rows in one pass. Returns indices [k, c] and a mask [k, c] of the real draws (a row with fewer than
    `count` tokens of nonzero probability has fewer)."""
    u = torch.rand(probs.shape, generator=generator, dtype=torch.float32, device=probs.device).clamp_min(1e-30)
    keys = probs.float() / -u.log()  # p / Exp(1): ordered as log p + Gumbel(0, 1); 0 where p is 0
    top = keys.topk(min(count, probs.shape[-1]), dim=-1)
    return top.indices, top.values > 0


def sample_tree(
    probs: Tensor, columns: Tensor | None, budget: int, generator: torch.Generator | None, top: int = TOP_CANDIDATES
) -> DraftTree:
    """A token tree for sampling (temperature > 0), verified by recursive rejection sampling
    (:func:`dflashkit.decoding.sampling.verify_tree_sampled`).

    probs [k, V']: the drafter's proposal distribution at each block offset (warped as the request asks);
    ``columns`` [V'] maps its columns to token ids (None: the vocabulary). At every offset up to `top`
    candidates are drawn without replacement, in order; every node at depth d has as children a prefix of
    depth d's candidates, which rejection sampling tries in that order. The shape is :func:`build_tree`'s, best
    first over the drafter's sorted probabilities: a function of q alone, since whether a candidate is tried must
    not depend on what was drawn (trying a second candidate only when it is likely would bias the draws that are
    tried away from q, and the acceptance ratio with them).

    Why not the greedy tree of the drafter's top choices, walked with the target's sample: at temperature 1 the
    target's sample lands among them about as often as one sampled draft is accepted. Shipped SmolLM2 drafter, the
    anchor's 4 children, no lookup (docs/experiments.md): the first position is
    accepted at 0.50 / 0.67 / 0.58 with sampled candidates against 0.45 / 0.62 / 0.43 with the top choices and
    0.34 / 0.43 / 0.39 for a chain's single draft (MT-Bench / HumanEval / MATH-500).
    """
    shape = probs.float().topk(min(top, probs.shape[-1]), dim=-1).values  # [k, top]: sorted, what sets the shape
    counts = (shape > 0).sum(1).tolist()
    values = [row[:n] for row, n in zip(shape.tolist(), counts)]
    index, _ = sample_without_replacement(probs, top, generator)  # [k, top]: ranks < counts are real draws
    tokens = (columns[index] if columns is not None else index).tolist()
    usable = next((d for d, v in enumerate(values) if not v), len(values))  # a row with nothing to draw ends it
    return _best_tree(values[:usable], tokens, budget) if usable else DraftTree([], [], [])
