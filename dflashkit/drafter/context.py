"""The drafter's context cache: the injected keys/values of the target features it has consumed, grown by verified
tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dflashkit.drafter.config import check_context_window
from dflashkit.drafter.text_columns import TextColumns
from dflashkit.errors import InvalidInputError

if TYPE_CHECKING:
    pass


KV = tuple[Tensor, Tensor]  # keys, values: [batch, kv_heads, seq, head_dim] each


class ContextCache:
    """Injected context K/V of every drafter layer, grown only by verified tokens.

    Buffers are preallocated (``keys`` and ``values`` [layers, kv_heads, capacity, head_dim]; per layer views
    [1, kv_heads, capacity, head_dim]) and grown by doubling, so appending costs a copy of the new rows only.
    Rows past ``length`` are scratch: the one-call drafter layers (dflashkit.kernels.row_kernels) write a block's own
    keys and values there. With a ``window``, drafting attends to the last ``window`` rows only (:attr:`first`
    on); rows the window had already passed when they arrived are not computed at all (:meth:`outside_window`).
    """

    def __init__(self, num_layers: int, capacity: int = 256, window: int | None = None) -> None:
        self.num_layers = num_layers
        self.capacity = capacity
        self.window = check_context_window(window)
        self.length = 0
        self.stored_from = 0  # rows before it were skipped (outside the window), never computed
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self._buffers: list[tuple[Tensor, Tensor]] | None = None
        self.text: TextColumns | None = None  # the text's tokens outside the draft vocabulary (set by new_context)

    def note_text(self, token_ids: list[int]) -> None:
        """Report tokens of the generation's text (its prompt, then what it emits), so that drafting can propose
        those outside the draft vocabulary too (:mod:`dflashkit.drafter.text_columns`); nothing without one."""
        if self.text is not None:
            self.text.add(token_ids)

    def outside_window(self, n: int) -> int:
        """How many of the next n rows drafting will never attend to (they fall before the window once all n are
        in): their keys and values need not be computed."""
        return 0 if self.window is None else max(0, n - self.window)

    def append(self, kvs: list[KV], skipped: int = 0) -> None:
        """Append rows: ``skipped`` rows that were not computed (see :meth:`outside_window`; their buffer rows are
        left as they are and never read), then the rows of ``kvs``."""
        like = kvs[0][0]  # [1, kv_heads, rows, head_dim]
        n = skipped + like.shape[2]
        start = self.prepare(n, skipped, 0, like.shape[1], like.shape[3], like.dtype, like.device)
        for (kb, vb), (k, v) in zip(self._buffers, kvs):
            kb[:, :, start : self.length + n] = k
            vb[:, :, start : self.length + n] = v
        self.commit(n, skipped)

    def prepare(
        self, n: int, skipped: int, scratch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> int:
        """Room for n more rows (the first ``skipped`` of them not computed) and ``scratch`` rows past them; returns
        the buffer row where the computed rows go. They count once :meth:`commit` is called."""
        if skipped and skipped > self.outside_window(n):
            raise InvalidInputError(
                f"{skipped} of {n} rows skipped, but only {self.outside_window(n)} fall outside the context window"
            )
        end = self.length + n + scratch
        if self._buffers is None:
            self._allocate((1, kv_heads, 0, head_dim), dtype, device, max(self.capacity, end))
        elif end > self._buffers[0][0].shape[2]:
            self.reserve(end)
        return self.length + skipped

    def commit(self, n: int, skipped: int = 0) -> None:
        """Count the n rows :meth:`prepare` made room for (and its buffer rows then written) as context."""
        start = self.length + skipped
        self.length += n
        if skipped:
            self.stored_from = start

    def reserve(self, end: int) -> None:
        """Room for rows < end (the buffers double when they would not fit)."""
        assert self.keys is not None, "context cache is empty"
        if end > self.keys.shape[2]:
            keys, values = self.keys, self.values
            self._allocate(keys[0:1].shape, keys.dtype, keys.device, max(2 * keys.shape[2], end))
            self.keys[:, :, : self.length] = keys[:, :, : self.length]
            self.values[:, :, : self.length] = values[:, :, : self.length]

    @property
    def first(self) -> int:
        """The first row a drafting step attends to: 0, or where the window of the last ``window`` rows starts."""
        return 0 if self.window is None else max(0, self.length - self.window)

    def layers(self) -> list[KV]:
        """Views of the rows drafting attends to (all, or the window): per layer (keys, values)
        [1, kv_heads, length - first, head_dim]."""
        assert self._buffers is not None, "context cache is empty"
        first = self.first
        return [(k[:, :, first : self.length], v[:, :, first : self.length]) for k, v in self._buffers]

    def crop(self, length: int) -> None:
        length = min(self.length, length)
        if self.window is not None and max(0, length - self.window) < self.stored_from:
            raise InvalidInputError("cannot crop a windowed context back into rows that were skipped")
        self.length = length

    def _allocate(
        self, like: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device, capacity: int
    ) -> None:
        """New buffers of the shape `like` [1, kv_heads, *, head_dim] for every layer."""
        shape = (self.num_layers, like[1], capacity, like[3])
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self._buffers = [(self.keys[i : i + 1], self.values[i : i + 1]) for i in range(self.num_layers)]
