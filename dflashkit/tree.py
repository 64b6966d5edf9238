"""Token-tree drafts: several candidates per block position, verified together in one target pass.

A DFlash drafter scores every block position in one pass, each conditioned only on the context and the
anchor (its rows are marginals, not conditioned on the drafts before them). A chain keeps each row's top
token; a tree keeps, where the drafter is unsure, its second and third choices too. The tree is built best
first (as EAGLE-2's dynamic trees): a node's value is the product of the drafter's probabilities along its
path, and the `budget` nodes of largest value are kept, so that a confident drafter gets a deep narrow tree
and an unsure one a wide shallow one.

Verification walks down the tree with the target's own tokens: at the anchor the target picks its token
(argmax, or a sample from its warped distribution); if a child of the current node carries that token the
walk moves there and the target picks again from that node's logits row; otherwise the token is emitted and
the step ends. Every emitted token is the target's own choice given exactly the tokens before it, so the
output is the plain decoder's (greedy) or distributed as the plain decoder's (sampling): lossless by
construction, without any acceptance ratio.

Rows of the verify pass: row 0 is the anchor (the last emitted token), row i >= 1 is node i-1; each row
attends to the cache, its ancestors and itself, at position start + depth.
"""

from __future__ import annotations

import heapq
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .errors import InvalidInputError

TOP_CANDIDATES = 4  # candidates per block position a tree may use (the drafter's top-4 of each row)


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
        """bool [n+1, n+1]: row r sees row c iff c is r or one of its ancestors (the anchor is everyone's)."""
        n = len(self.tokens) + 1
        mask = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            mask[i + 1] |= mask[parent]
        return mask.to(device)

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


def check_budget(budget: object) -> int:
    """A token tree's node budget: an int >= 1 (booleans refused); raises InvalidInputError otherwise."""
    if not isinstance(budget, numbers.Integral) or isinstance(budget, bool) or budget < 1:
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


def build_tree(scores: Tensor, columns: Tensor | None, budget: int, top: int = TOP_CANDIDATES) -> DraftTree:
    """The `budget` nodes of largest path probability from drafter scores [k, V'] (row j: block offset j+1).

    ``columns`` [V'] maps score columns to token ids (None: the columns are the vocabulary). Each position
    offers its `top` best tokens; a node's value is the product of the drafter's softmax probabilities along
    its path (a path down the first choices is the chain); see :func:`best_first`.
    """
    probs, index = scores.float().softmax(-1).topk(min(top, scores.shape[1]), dim=-1)  # [k, top] each
    tokens = (columns[index] if columns is not None else index).tolist()
    parents, depths, ranks = best_first(probs.tolist(), budget)
    return DraftTree([tokens[d - 1][r] for d, r in zip(depths, ranks)], parents, depths)
