"""CUDA graphs of the target's fast forward: one graph per step shape over a pooled static KV cache."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflashkit.errors import InvalidInputError
from dflashkit.kernels.cuda_graphs import MAX_ROWS, Capture, _Graphs, _Shape, cuda_capture
from dflashkit.kernels.quantize import WEIGHT_ONLY
from dflashkit.target.fast import FastTargetForward, StaticKVCache, StepInputs


def unsupported_reason(forward: FastTargetForward) -> str | None:
    """Why the fast forward cannot be replayed from graphs (None: it can)."""
    if forward.device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the target is on {forward.device}"
    if isinstance(forward.head, WEIGHT_ONLY):
        return "weight-only quantized targets are not graphed"
    rope_type = getattr(forward.rotary, "rope_type", "default")
    if rope_type == "dynamic" or "dynamic" in str(rope_type):
        return f"rotary type {rope_type!r} changes with the sequence length"
    return None


@dataclass(eq=False)
class _Slot:
    """The buffers behind a GraphCache: keys/values, static inputs, and the graphs captured over them."""

    keys: Tensor
    values: Tensor
    ids: Tensor  # [1, MAX_ROWS] long
    start: Tensor  # [1] long
    offsets: Tensor  # [MAX_ROWS] long
    visible: Tensor  # [MAX_ROWS, MAX_ROWS] bool
    rows: Tensor  # [MAX_ROWS] long: 0..MAX_ROWS-1
    chain: Tensor  # [MAX_ROWS, MAX_ROWS] bool, lower triangle: a chain's visibility
    key_positions: Tensor  # [capacity] long
    cos: Tensor
    sin: Tensor
    shapes: dict[tuple, _Shape] = field(default_factory=dict)


class GraphCache(StaticKVCache):
    """A :class:`StaticKVCache` of fixed capacity over a pooled slot whose graphs outlive the generation."""

    def __init__(self, slot: _Slot) -> None:  # not super().__init__: it would allocate new buffers
        self.slot = slot
        self.keys, self.values = slot.keys, slot.values
        self.length = 0

    def reserve(self, end: int) -> None:
        if end > self.capacity:  # graphs recorded these buffers' addresses: they cannot grow
            raise InvalidInputError(
                f"{end} positions do not fit this graph cache of {self.capacity}: ask "
                "new_cache for the capacity the generation needs"
            )


class GraphedSteps(_Graphs):
    """Runs the fast forward's decode steps from CUDA graphs (see the module docstring)."""

    def __init__(self, forward: FastTargetForward, capture: Capture | None = None, max_rows: int = MAX_ROWS) -> None:
        if capture is None:
            reason = unsupported_reason(forward)
            if reason is not None:
                raise InvalidInputError(reason)
            capture = cuda_capture
        super().__init__(capture, max_rows)
        self.forward = forward

    def _label(self, key: tuple) -> str:
        return f"steps of {key[0]} rows"

    # ---- caches -----------------------------------------------------------------------------------------

    def new_cache(self, capacity: int) -> GraphCache:
        """A cache for one generation of up to ``capacity`` positions (rounded up to a power of two, reused)."""
        return self._lend(capacity, GraphCache)

    def _new_slot(self, capacity: int) -> _Slot:
        f, device, rows = self.forward, self.forward.device, self.max_rows
        shape = (len(f.layers), f.kv_heads, capacity, f.head_dim)
        cos, sin = f.rotary_tables(capacity)
        zeros = functools.partial(torch.zeros, device=device)
        return _Slot(
            keys=zeros(shape, dtype=f.dtype),
            values=zeros(shape, dtype=f.dtype),
            ids=zeros(1, rows, dtype=torch.long),
            start=zeros(1, dtype=torch.long),
            offsets=zeros(rows, dtype=torch.long),
            visible=zeros(rows, rows, dtype=torch.bool),
            rows=torch.arange(rows, device=device),
            chain=torch.ones(rows, rows, dtype=torch.bool, device=device).tril_(),
            key_positions=torch.arange(capacity, device=device),
            cos=cos,
            sin=sin,
        )

    # ---- steps ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: Tensor,
        start: int,
        cache: GraphCache,
        logits_rows: int,
        feature_layers: list[int],
        tree: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The fast forward's step (same arguments and results), replayed from a graph where one applies."""
        n = input_ids.shape[1]
        key = (n, logits_rows, tuple(feature_layers))
        if start == 0 or cache.length != start or n > self.max_rows or start + n > cache.capacity or key in self.failed:
            # prefills (start 0: a new length each time) and shapes that failed run eagerly
            return self.forward(input_ids, start, cache, logits_rows, feature_layers, tree)
        slot = cache.slot
        slot.ids[:, :n].copy_(input_ids)
        slot.start.fill_(start)
        if tree is None:  # a chain: row i at position start + i sees rows 0..i
            slot.offsets[:n].copy_(slot.rows[:n])
            slot.visible[:n, :n].copy_(slot.chain[:n, :n])
        else:
            offsets, visible = tree
            if offsets.shape != (n,) or visible.shape != (n, n):
                raise InvalidInputError(f"a tree of {n} rows needs offsets [{n}] and visibility [{n}, {n}]")
            slot.offsets[:n].copy_(offsets)
            slot.visible[:n, :n].copy_(visible)
        shape = slot.shapes.get(key) or self._capture(key, slot)
        if shape is None:
            return self.forward(input_ids, start, cache, logits_rows, feature_layers, tree)
        if shape.checks_left:  # the first replays are checked against the eager forward on the same inputs
            expected, _ = self.forward(input_ids, start, cache, logits_rows, feature_layers, tree)
            cache.length = start
            shape.replay()
            if not self._agrees(key, slot.shapes, shape, expected):
                return self.forward(input_ids, start, cache, logits_rows, feature_layers, tree)  # rewrites the rows
        else:
            shape.replay()
        cache.length = start + n
        features = shape.features.clone() if shape.features is not None else None
        return shape.logits.clone(), features  # the next replay overwrites the static outputs

    def _capture(self, key: tuple, slot: _Slot) -> _Shape | None:
        """Record the step of this shape over the slot's static buffers (inputs already in place); None if that
        fails."""
        n, logits_rows, feature_layers = key
        inputs = StepInputs(
            slot.ids[:, :n],
            slot.start,
            slot.offsets[:n],
            slot.rows[:n],
            slot.visible[:n, :n],
            slot.key_positions,
            slot.cos,
            slot.sin,
        )
        shape = _Shape()

        def step() -> None:
            shape.logits, shape.features = self.forward.static_step(
                inputs, slot.keys, slot.values, logits_rows, list(feature_layers)
            )

        return self._record(key, slot.shapes, shape, step)
