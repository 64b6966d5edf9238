"""Drafts copied from earlier text (prompt lookup): the continuation of the latest earlier occurrence of the
longest n-gram that ends the text so far.

Small chat models repeat themselves and their prompts a lot: on 300 greedy SmolLM2-135M-Instruct answers to
ShareGPT prompts (docs/experiments.md), 24% of the steps end with a 2-4-gram seen before, and copying up to 15
tokens after it gives τ 4.6 on those steps (τ 1.89 over all steps with plain steps elsewhere: more than
the shipped drafter's τ on its own). Unigram matches add steps with τ ~1.5 only, no better than the drafter.
The decode loop uses these drafts where a match exists and the DFlash drafter elsewhere. Any draft is verified by the
target as usual, and a draft that is a fixed function of the emitted text is an exact proposal (a one-hot q),
so output stays lossless at any temperature.

The index is incremental: appending a token registers the n-grams that now have a continuation, so a lookup
costs a few dictionary probes however long the text is. Where the text has no repeat of its own, an optional
:class:`~dflashkit.drafter.ngram_store.NgramStore` (the target's past answers) proposes instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflashkit.drafter.ngram_store import NgramStore

DEFAULT_MIN_NGRAM = 2
DEFAULT_MAX_NGRAM = 4


class NgramLookup:
    """Latest position of every n-gram (min_n <= n <= max_n) of a growing token list, for prompt lookup."""

    def __init__(
        self,
        tokens: Iterable[int] = (),
        min_ngram: int = DEFAULT_MIN_NGRAM,
        max_ngram: int = DEFAULT_MAX_NGRAM,
        store: NgramStore | None = None,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.store = store  # fallback where the text has no repeat of its own
        self.from_store = False  # whether the last proposal came from the store
        self.tokens: list[int] = []
        self._end: dict[
            tuple[int, ...], int
        ] = {}  # n-gram -> index of its last token, latest occurrence with a successor
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens; each n-gram that ends just before a new token becomes findable."""
        toks = self.tokens
        for t in tokens:
            toks.append(int(t))
            end = len(toks) - 2  # the n-grams ending here now have a continuation (the new token)
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._end[tuple(toks[end - n + 1 : end + 1])] = end

    def propose(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the latest earlier occurrence of the longest suffix n-gram;
        without one, the store's proposal if there is a store ([] when neither has one)."""
        toks = self.tokens
        self.from_store = False
        if max_tokens <= 0:
            return []
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            end = self._end.get(tuple(toks[len(toks) - n :]))
            if end is not None:
                return toks[end + 1 : end + 1 + max_tokens]
        if self.store is not None:
            proposal = self.store.propose(toks, max_tokens)
            self.from_store = bool(proposal)
            return proposal
        return []
