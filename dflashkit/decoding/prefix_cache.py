"""Prompt prefix cache: what a finished generation computed, kept for the next prompt that begins the same way.

A chat's next turn re-sends the whole conversation: its prompt is the previous prompt + the answer + the new
message. Without a cache the target prefills all of it again, every turn (seconds on a 2-core CPU for a few
thousand tokens); with one, a generation restores the target's keys and values (and the drafter's features) of the
longest prefix it shares with a kept sequence and prefills only the rest, as llama.cpp's server does
(``cache_prompt``). OpenAI's API reports the reused part as ``usage.prompt_tokens_details.cached_tokens``.

What is kept are copies ([layers, kv_heads, n, head_dim] keys and values, [1, n, features] drafter features), so a
kept sequence serves any number of later generations, concurrent ones too, and no cache buffer (e.g. a CUDA-graph
slot) stays held. The cached keys and values are the target's own for those tokens; they were computed in other
passes (a prefill, verify steps) than a fresh prefill would use, so where the forward is not row-exact (oneDNN
prefills, GPUs) they may differ from a fresh prefill's in the last bits, as in any engine with a prompt cache;
greedy outputs then part from an uncached run only at numerical ties.

Each kept sequence has an owner (a server's client: :meth:`PrefixCache.scoped` gives an owner's view), and a prompt
is matched only against its owner's sequences: how many of its tokens were restored would otherwise tell one client
how another's prompts began. All owners share the one memory budget and its least-recently-used order.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dflashkit.errors import InvalidInputError

MIN_REUSE = 8  # a shorter shared prefix (a chat template's header) is prefilled again: not worth a restore


@dataclass(frozen=True)
class CachedSequence:
    """A processed token sequence: the target's keys / values and the drafter features at its positions."""

    token_ids: tuple[int, ...]
    keys: Tensor  # [layers, kv_heads, n, head_dim]
    values: Tensor  # [layers, kv_heads, n, head_dim]
    features: Tensor | None  # [1, n, n_feat * hidden], None when the target had no feature layers
    feature_layers: tuple[int, ...] = ()  # the target layers `features` came from

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if (
            self.keys.shape != self.values.shape
            or self.keys.shape[2] != n
            or (self.features is not None and self.features.shape[1] != n)
        ):
            raise ValueError(
                f"a cached sequence of {n} tokens with keys {tuple(self.keys.shape)}, values "
                f"{tuple(self.values.shape)}, features "
                f"{None if self.features is None else tuple(self.features.shape)}"
            )

    @property
    def nbytes(self) -> int:
        tensors = (self.keys, self.values) + ((self.features,) if self.features is not None else ())
        return sum(t.numel() * t.element_size() for t in tensors)


def common_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Kept sequences, least recently used first out, within ``max_bytes``; thread-safe.

    :meth:`match` finds the kept sequence sharing the longest prefix with a prompt; :meth:`add` keeps a finished
    generation's sequence (and drops kept ones that are prefixes of it: a conversation keeps only its last turn).
    Both take an ``owner`` (default ""): a prompt is matched only against sequences of its own owner, and a sequence
    drops only its owner's prefixes; the budget and the least-recently-used order are shared by all owners.
    """

    def __init__(self, max_bytes: int, min_reuse: int = MIN_REUSE) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise InvalidInputError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        if not isinstance(min_reuse, int) or min_reuse < 1:
            raise InvalidInputError(f"min_reuse must be an integer >= 1, got {min_reuse!r}")
        self.max_bytes, self.min_reuse = max_bytes, min_reuse
        self._kept: OrderedDict[tuple[str, tuple[int, ...]], CachedSequence] = OrderedDict()  # (owner, token ids)
        self._lock = threading.Lock()
        self._model: weakref.ref | None = None  # the target model the kept keys and values are of
        self.hits = self.misses = 0
        self.reused_tokens = 0

    @classmethod
    def of_mib(cls, mib: float) -> PrefixCache | None:
        """A cache of ``mib`` MiB, or None for 0 (no cache)."""
        if isinstance(mib, bool) or not isinstance(mib, (int, float)) or mib < 0:
            raise InvalidInputError(f"the prefix cache size must be a number of MiB >= 0, got {mib!r}")
        return cls(int(mib * 2**20)) if mib > 0 else None

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._kept.values())

    def scoped(self, owner: str) -> ScopedPrefixCache:
        """This cache as ``owner`` sees it: what the decode loop is given for one client's generation."""
        return ScopedPrefixCache(self, owner)

    def bind(self, model: Any) -> None:
        """Tie the cache to one target model (the first it is used with): keys and values are a model's own."""
        with self._lock:
            bound = self._model() if self._model is not None else None
            if bound is None:
                self._model, self._kept = weakref.ref(model), OrderedDict()
            elif bound is not model:
                raise InvalidInputError(
                    "this prefix cache holds another target model's keys and values: use one PrefixCache per model"
                )

    def match(
        self, prompt_ids: list[int], feature_layers: tuple[int, ...] = (), owner: str = ""
    ) -> tuple[CachedSequence, int] | None:
        """The kept sequence of ``owner`` sharing the longest prefix with ``prompt_ids`` and that length, capped so
        that at least the prompt's last token is prefilled again (its logits start the answer); None below
        ``min_reuse`` tokens. ``feature_layers``: the drafter features needed (only sequences kept with those
        qualify)."""
        best, length = None, 0
        with self._lock:
            for (kept_by, key), seq in self._kept.items():
                if kept_by != owner:
                    continue
                if feature_layers and (seq.features is None or seq.feature_layers != tuple(feature_layers)):
                    continue
                n = min(common_prefix(key, prompt_ids), len(prompt_ids) - 1)
                if n > length:
                    best, length = seq, n
            if best is None or length < self.min_reuse:
                self.misses += 1
                return None
            self._kept.move_to_end((owner, best.token_ids))
            self.hits += 1
            self.reused_tokens += length
            return best, length

    def add(self, seq: CachedSequence, owner: str = "") -> None:
        """Keep ``seq`` for ``owner`` (most recent); that owner's kept sequences it extends are dropped, then the
        oldest of any owner until within budget."""
        if seq.nbytes > self.max_bytes or len(seq.token_ids) < self.min_reuse:
            return
        ids = seq.token_ids
        with self._lock:
            for key in [k for k in self._kept if k[0] == owner and len(k[1]) <= len(ids) and ids[: len(k[1])] == k[1]]:
                del self._kept[key]
            self._kept[(owner, ids)] = seq
            total = sum(s.nbytes for s in self._kept.values())
            while total > self.max_bytes:
                _, dropped = self._kept.popitem(last=False)
                total -= dropped.nbytes

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


class ScopedPrefixCache:
    """One owner's view of a :class:`PrefixCache`, with the ``bind`` / ``match`` / ``add`` the decode loop calls:
    it matches only that owner's sequences and keeps new ones as that owner's. A server gives each client's
    generations the view of the client's owner id, so a client's ``cached_tokens`` say nothing of other clients'
    prompts."""

    def __init__(self, cache: PrefixCache, owner: str) -> None:
        if not isinstance(cache, PrefixCache):
            raise InvalidInputError(f"a scoped prefix cache needs a PrefixCache, got {type(cache).__name__}")
        if not isinstance(owner, str):
            raise InvalidInputError(f"a prefix cache owner must be a string, got {owner!r}")
        self.cache, self.owner = cache, owner

    @property
    def max_bytes(self) -> int:
        return self.cache.max_bytes

    @property
    def min_reuse(self) -> int:
        return self.cache.min_reuse

    def bind(self, model: Any) -> None:
        self.cache.bind(model)

    def match(self, prompt_ids: list[int], feature_layers: tuple[int, ...] = ()) -> tuple[CachedSequence, int] | None:
        return self.cache.match(prompt_ids, feature_layers, owner=self.owner)

    def add(self, seq: CachedSequence) -> None:
        self.cache.add(seq, owner=self.owner)
