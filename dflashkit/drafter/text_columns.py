"""A drafter's draft vocabulary widened, per generation, by the tokens of that generation's own text.

A drafter with a draft vocabulary scores only those columns of the target's head (the shipped SmolLM2 drafter: the
8,192 tokens most frequent in its training answers), so it can never propose a token outside them, however plainly
the text calls for it: a word of the prompt that the answer repeats (" chloroplast", " Calvin"), a LaTeX token of a
math question ("_{", "}$"). Of the target's greedy answers to the evaluation sets, 13.3% / 5.6% / 6.2% of the tokens
(MT-Bench / HumanEval / MATH-500, 6 prompts each, 128 tokens) lie outside the shipped draft vocabulary, most of them
tokens of the prompt or of the answer before them.

:class:`TextColumns` adds the head rows of the tokens of the prompt and of the output so far that the draft
vocabulary lacks: a drafting step scores the draft vocabulary's V' columns and then these E, and its columns map
is the draft vocabulary followed by these tokens. The drafter's hidden states are unchanged (it trained over the
target's own head rows, so a row it never scored still means what it means to the target). Teacher-forced 15-draft
chains over the shipped drafter, same answers (docs/experiments.md): τ 2.22 / 2.81 / 2.60
with the draft vocabulary, 2.32 / 2.90 / 2.65 with it and the text's tokens, 2.34 / 2.90 / 2.65 with the whole
vocabulary (whose head costs 6x the draft vocabulary's). Decoding stays lossless whatever a drafter proposes; this only
changes what it can propose.

Rows are kept in two parts so that a token that arrives late costs little: the settled rows, packed for the fast
product once per :data:`PACK_EVERY` new rows, and the recent rest, packed again whenever a token joins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit.kernels import row_kernels
from dflashkit.kernels.quantize import WEIGHT_ONLY

PACK_EVERY = 64  # recent rows at which all rows are packed together again


def head_rows(lm_head: nn.Module, ids: Tensor) -> Callable[[Tensor], Tensor]:
    """Products with the target head's output rows `ids` [n] only: [..., hidden] -> [..., n]. Set up with no module
    parameter (registering one anywhere makes a drafter take its parameter list again, see
    ``DFlashDrafter._fast_forward``): a weight-only quantized head's rows stay quantized (buffers); bf16 rows on a CPU
    with dflashkit's row kernels are packed for them (products of any shape, no setup per shape: a bf16 ``F.linear`` of
    a shape oneDNN has not seen takes ~0.9 ms on a CPU, most of it making its primitive); other CPU rows multiply in
    fp32, rows on a GPU as they are."""
    if isinstance(lm_head, WEIGHT_ONLY):
        return lm_head.rows(ids)
    rows = lm_head.weight[ids.to(lm_head.weight.device)].detach()  # [n, hidden]
    if row_kernels.usable(rows):
        packed, n = row_kernels.pack(rows), rows.shape[0]
        return lambda hidden: (
            row_kernels.linear(hidden, packed, n)
            if hidden.dtype == torch.bfloat16
            else F.linear(hidden, rows.to(hidden.dtype))
        )
    if rows.device.type == "cpu":
        rows = rows.float()
        return lambda hidden: hidden.float() @ rows.T
    return lambda hidden: F.linear(hidden, rows.to(hidden.dtype))


class TextColumns:
    """The tokens of one generation's text outside a draft vocabulary, and the head over them."""

    def __init__(self, draft_vocab: Tensor, in_vocab: frozenset[int]) -> None:
        self.draft_vocab = draft_vocab  # [V'] the drafter's own columns
        self._in_vocab = in_vocab  # its token ids, shared by every generation of the drafter
        self.tokens: list[int] = []  # the text's tokens outside it, in the order first seen
        self._seen: set[int] = set()
        # the settled rows (packed again every PACK_EVERY new rows): (rows covered, head key, head over them); the
        # recent rest (packed again whenever a token joins; fewer than PACK_EVERY rows): (first row, end, key, head)
        self._settled: tuple[int, object, Callable[[Tensor], Tensor]] | None = None
        self._recent: tuple[int, int, object, Callable[[Tensor], Tensor]] | None = None
        self._columns: Tensor | None = None

    def add(self, token_ids: Iterable[int]) -> None:
        """Note tokens of the text (prompt or output); those outside the draft vocabulary become columns."""
        for t in token_ids:
            if t not in self._in_vocab and t not in self._seen:
                self._seen.add(t)
                self.tokens.append(t)
                self._columns = None

    def columns(self) -> Tensor:
        """Token id of each scored column [V' + E]: the draft vocabulary, then the text's tokens."""
        if self._columns is None:
            extra = torch.tensor(self.tokens, dtype=self.draft_vocab.dtype, device=self.draft_vocab.device)
            self._columns = torch.cat((self.draft_vocab, extra))
        return self._columns

    def scores(self, hidden: Tensor, scores: Tensor, lm_head: nn.Module, key: object) -> Tensor:
        """Scores [rows, V' + E] of drafter hidden states [rows, hidden]: their draft vocabulary's ``scores``
        [rows, V'], then their products with the text's tokens' rows of the target's head ``lm_head``. ``key``
        changes whenever the head's weights do (the drafter passes its draft head's): the rows are taken again."""
        if not self.tokens:
            return scores
        settled = self._settled[0] if self._settled is not None and self._settled[1] == key else 0
        if len(self.tokens) - settled >= PACK_EVERY:
            settled = len(self.tokens)
            self._settled = (settled, key, head_rows(lm_head, torch.tensor(self.tokens)))
        parts = [scores]
        if settled:
            parts.append(self._settled[2](hidden))  # [rows, settled]
        if settled < len(self.tokens):
            if self._recent is None or self._recent[:3] != (settled, len(self.tokens), key):
                self._recent = (settled, len(self.tokens), key, head_rows(lm_head, torch.tensor(self.tokens[settled:])))
            parts.append(self._recent[3](hidden))  # [rows, the rest]
        return torch.cat([p.to(scores.dtype) for p in parts], -1)
