"""A datastore of the target's own answers (REST-style retrieval drafts): the most frequent next token after
every n-gram of the regenerated training answers.

Prompt lookup (:mod:`dflashkit.decoding.lookup`) copies from the text of the current generation only. Small chat models
also repeat themselves *across* answers ("Here's a step-by-step...", code idioms, the phrasing of math steps),
so where the text so far has no repeat of its own, the store chains the most frequent continuation of its last
n tokens in the target's regenerated answers: no drafter pass, a dictionary probe per drafted token. Its effect
on the shipped drafter is measured in docs/experiments.md.

A draft that is a fixed function of the emitted text is an exact proposal (a one-hot q), so the output stays
lossless at any temperature; the store changes speed only. It is saved next to a drafter as
``ngram_store.safetensors`` (tensors ``contexts`` [M, n] and ``next`` [M], plus ``counts`` [M]; each uint16 where its
values fit, as token ids of vocabularies up to 65,536 do, else int32: 8 bytes an n-gram of 3 instead of 20).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import Tensor

from dflashkit.errors import CheckpointError
from dflashkit.fsutil import atomic_write

FILENAME = "ngram_store.safetensors"
DEFAULT_N = 3
DEFAULT_MIN_COUNT = 2
DEFAULT_MAX_DRAFT = 7  # a chain of most-frequent guesses: each further token is less likely to be accepted


class NgramStore:
    """Most frequent next token after each n-gram seen at least ``min_count`` times in a corpus."""

    def __init__(
        self,
        table: dict[tuple[int, ...], int],
        n: int,
        counts: dict[tuple[int, ...], int] | None = None,
        max_draft: int = DEFAULT_MAX_DRAFT,
        min_count: int | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self.table = table
        self.counts = counts or {}
        self.max_draft = max_draft
        self.min_count = min_count  # the count an n-gram needed to be kept (None: not recorded)

    @cached_property
    def max_token(self) -> int:
        """The largest token id in the store (-1 when empty), for the vocabulary check."""
        return max((t for key, nxt in self.table.items() for t in (*key, nxt)), default=-1)

    def __len__(self) -> int:
        return len(self.table)

    @classmethod
    def build(
        cls,
        sequences: Iterable[Sequence[int]],
        n: int = DEFAULT_N,
        min_count: int = DEFAULT_MIN_COUNT,
        max_draft: int = DEFAULT_MAX_DRAFT,
    ) -> NgramStore:
        """The store of ``sequences`` (e.g. the last prompt tokens + the response of every regenerated answer)."""
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        followers: defaultdict[tuple[int, ...], Counter] = defaultdict(Counter)
        for seq in sequences:
            seq = [int(t) for t in seq]
            for i in range(n, len(seq)):
                followers[tuple(seq[i - n : i])][seq[i]] += 1
        table, counts = {}, {}
        for key, c in followers.items():
            token, count = max(c.items(), key=lambda kv: (kv[1], -kv[0]))  # most frequent; the smaller id on ties
            if count >= min_count:
                table[key], counts[key] = token, count
        return cls(table, n, counts, max_draft, min_count)

    def merged(self, other: NgramStore) -> NgramStore:
        """The union of two stores (e.g. one training round's answers with the shipped store's), so that the store grows
        with every batch of regenerated answers. A store keeps each n-gram's top follower and its count only, so
        where both hold an n-gram: the same follower adds the counts (exact), different followers keep the one
        counted more often (the other follower's count in this corpus is not known: approximate)."""
        if other.n != self.n:
            raise ValueError(f"cannot merge a store of {other.n}-grams into one of {self.n}-grams")
        table, counts = dict(self.table), dict(self.counts)
        for key, token in other.table.items():
            count = other.counts.get(key, 0)
            if key not in table:
                table[key], counts[key] = token, count
            elif table[key] == token:
                counts[key] = counts.get(key, 0) + count
            elif (count, -token) > (counts.get(key, 0), -table[key]):  # more often; the smaller id on ties
                table[key], counts[key] = token, count
        min_counts = [m for m in (self.min_count, other.min_count) if m is not None]
        return NgramStore(table, self.n, counts, self.max_draft, min(min_counts) if min_counts else None)

    def pruned(self, max_entries: int) -> NgramStore:
        """The ``max_entries`` n-grams counted most often (the smaller n-gram first on equal counts): a size cap
        for a store that grows round by round, which drops the rarest continuations, the ones least often
        proposed and accepted (an n-gram without a recorded count, from a store file written before counts were kept,
        counts 0)."""
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if len(self.table) <= max_entries:
            return self
        kept = sorted(self.table, key=lambda key: (-self.counts.get(key, 0), key))[:max_entries]
        return NgramStore(
            {key: self.table[key] for key in kept},
            self.n,
            {key: self.counts[key] for key in kept if key in self.counts},
            self.max_draft,
            self.min_count,
        )

    def propose(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` (and ``max_draft``) tokens: the most frequent continuation of the last n tokens,
        then of the last n tokens with it appended, and so on ([] when the text's last n-gram is not stored)."""
        if len(tokens) < self.n:
            return []
        out: list[int] = []
        ctx = list(tokens[-self.n :])
        for _ in range(min(max_tokens, self.max_draft)):
            token = self.table.get(tuple(ctx))
            if token is None:
                break
            out.append(token)
            ctx = ctx[1:] + [token]
        return out

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a store whose token ids do not fit the target's vocabulary (made for another tokenizer)."""
        if self.max_token >= vocab_size:
            raise CheckpointError(
                f"the n-gram store holds token id {self.max_token}, outside the target's "
                f"vocabulary of {vocab_size}: it was built for another tokenizer"
            )

    def save(self, path: str | os.PathLike) -> None:
        """Write the store as safetensors (atomically)."""
        keys = sorted(self.table)
        contexts = torch.tensor(keys, dtype=torch.int64).reshape(len(keys), self.n)
        nxt = torch.tensor([self.table[k] for k in keys], dtype=torch.int64)
        counts = torch.tensor([self.counts.get(k, 0) for k in keys], dtype=torch.int64)
        tensors = {"contexts": _narrow(contexts), "next": _narrow(nxt), "counts": _narrow(counts)}
        blob = save(
            tensors,
            metadata={
                "format": "dflashkit-ngram-store",
                "n": str(self.n),
                "max_draft": str(self.max_draft),
                **({"min_count": str(self.min_count)} if self.min_count is not None else {}),
            },
        )
        atomic_write(path, lambda f: f.write(blob), binary=True)  # a kill never leaves a torn store

    @classmethod
    def load(cls, path: str | os.PathLike) -> NgramStore:
        try:
            with safe_open(str(path), "pt") as f:  # tensors and metadata in one read
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
            contexts, nxt = tensors["contexts"], tensors["next"]
        except Exception as e:  # a torn or foreign file: say which file
            raise CheckpointError(f"{path} is not a readable n-gram store: {e}") from e
        if contexts.dim() != 2 or nxt.shape != contexts.shape[:1]:
            raise CheckpointError(f"{path}: contexts {tuple(contexts.shape)} and next {tuple(nxt.shape)} do not match")
        keys = [tuple(row) for row in contexts.long().tolist()]
        counts = tensors.get("counts")
        return cls(
            dict(zip(keys, nxt.long().tolist())),
            contexts.shape[1],
            dict(zip(keys, counts.long().tolist())) if counts is not None else None,
            int(meta.get("max_draft", DEFAULT_MAX_DRAFT)),
            int(meta["min_count"]) if "min_count" in meta else None,
        )


def _narrow(values: Tensor) -> Tensor:
    """``values`` (int64) as uint16 where they all fit (token ids of a vocabulary up to 65,536, counts up to 65,535:
    the shipped store's largest count is ~34K), else as int32."""
    fits = values.numel() == 0 or (int(values.min()) >= 0 and int(values.max()) <= 0xFFFF)
    return values.to(torch.uint16 if fits else torch.int32)


def find_store(folder: str | os.PathLike) -> Path | None:
    """The store saved in a drafter folder, if any."""
    path = Path(folder) / FILENAME
    return path if path.is_file() else None
