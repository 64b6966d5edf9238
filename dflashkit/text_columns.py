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
chains over the shipped drafter, same answers (`python scripts/text_columns_tau.py --limit 6`): τ 2.22 / 2.81 / 2.60
with the draft vocabulary, 2.32 / 2.90 / 2.65 with it and the text's tokens, 2.34 / 2.90 / 2.65 with the whole
vocabulary (whose head costs 6x the draft vocabulary's). Decoding stays lossless whatever a drafter proposes; this only
changes what it can propose.

Rows are kept in two parts so that a token that arrives late costs little: the rows packed for the fast product
(repacked when the unpacked rest reaches :data:`PACK_EVERY`), and the rest, multiplied as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import PackedLinear
from .quantize import Int8Linear

PACK_EVERY = 64  # unpacked rows at which all rows are packed again (packing ~1.3 µs a row + ~0.13 ms a call)


def head_rows(lm_head: nn.Module, ids: Tensor, packed: bool = True) -> Callable[[Tensor], Tensor]:
    """The target's head restricted to the output rows `ids` [n]: a weight-only int8 head keeps its rows in int8;
    other heads' rows are prepacked for the fast product (``packed``) or multiplied as they are."""
    if isinstance(lm_head, Int8Linear):
        return lm_head.rows(ids)
    rows = lm_head.weight[ids.to(lm_head.weight.device)].detach()  # [n, hidden]
    return PackedLinear(rows) if packed else (lambda hidden: F.linear(hidden, rows))


class TextColumns:
    """The tokens of one generation's text outside a draft vocabulary, and the head over them."""

    def __init__(self, draft_vocab: Tensor, in_vocab: frozenset[int]) -> None:
        self.draft_vocab = draft_vocab  # [V'] the drafter's own columns
        self._in_vocab = in_vocab  # its token ids, shared by every generation of the drafter
        self.tokens: list[int] = []  # the text's tokens outside it, in the order first seen
        self._seen: set[int] = set()
        self._packed: tuple[int, object, Callable[[Tensor], Tensor]] | None = None  # (rows, head key, head)
        self._rest: tuple[int, object, Callable[[Tensor], Tensor]] | None = None
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

    def scores(self, hidden: Tensor, scores: Tensor, lm_head: nn.Module) -> Tensor:
        """Scores [rows, V' + E] of drafter hidden states [rows, hidden]: their draft vocabulary's ``scores``
        [rows, V'], then their products with the text's tokens' rows of the target's head ``lm_head``."""
        if not self.tokens:
            return scores
        key = _head_key(lm_head)
        if len(self.tokens) - (self._packed[0] if self._packed and self._packed[1] == key else 0) >= PACK_EVERY:
            ids = torch.tensor(self.tokens)
            self._packed, self._rest = (len(ids), key, head_rows(lm_head, ids)), None
        done = self._packed[0] if self._packed is not None and self._packed[1] == key else 0
        parts = [scores]
        if done:
            parts.append(self._packed[2](hidden))  # [rows, packed E]
        if done < len(self.tokens):
            if self._rest is None or self._rest[0] != len(self.tokens) or self._rest[1] != key:
                ids = torch.tensor(self.tokens[done:])
                self._rest = (len(self.tokens), key, head_rows(lm_head, ids, packed=False))
            parts.append(self._rest[2](hidden))  # [rows, the rest of E]
        return torch.cat([p.to(scores.dtype) for p in parts], -1)


def _head_key(lm_head: nn.Module) -> tuple:
    """What the cached rows were taken from: the head and its weights as they are now."""
    weight = lm_head.qweight if isinstance(lm_head, Int8Linear) else lm_head.weight
    return (id(lm_head), weight.data_ptr(), -1 if weight.is_inference() else weight._version)
