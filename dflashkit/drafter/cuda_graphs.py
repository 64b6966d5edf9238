"""CUDA graphs of the drafter's steps: one graph per step shape over a static context."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflashkit.drafter.context import ContextCache
from dflashkit.errors import InvalidInputError
from dflashkit.kernels.cuda_graphs import MAX_ROWS, Capture, _Graphs, _Shape, cuda_capture


@dataclass(eq=False)
class _DraftSlot:
    """Buffers behind a GraphContext: the injected context's keys/values per layer, static inputs, graphs."""

    keys: list[Tensor]  # per layer [1, kv_heads, capacity, head_dim]
    values: list[Tensor]
    ids: Tensor  # [1, MAX_ROWS] long: the anchor, then mask ids
    pos: Tensor  # [1] long: the anchor's position
    length: Tensor  # [1] long: valid context rows
    first: Tensor  # [1] long: the first context row drafting attends to (the context window's start)
    rows: Tensor  # [MAX_ROWS] long: 0..MAX_ROWS-1
    key_positions: Tensor  # [capacity] long
    cos: Tensor  # [capacity + MAX_ROWS, head_dim]
    sin: Tensor  # signed
    shapes: dict[tuple, _Shape] = field(default_factory=dict)


class GraphContext(ContextCache):
    """A drafter :class:`ContextCache` of fixed capacity over a pooled slot (graphs recorded its buffers)."""

    def __init__(self, slot: _DraftSlot, window: int | None = None) -> None:
        super().__init__(len(slot.keys), slot.keys[0].shape[2], window)
        self.slot = slot
        self._buffers = list(zip(slot.keys, slot.values))

    def append(self, kvs: list, skipped: int = 0) -> None:
        n = skipped + kvs[0][0].shape[2]
        if self.length + n > self.capacity:
            raise InvalidInputError(f"{self.length + n} context rows do not fit this graph context of {self.capacity}")
        super().append(kvs, skipped)


class GraphedDrafts(_Graphs):
    """Runs a drafter's drafting steps (layers over the block + head over the draft vocabulary) from graphs.

    Same scheme as :class:`GraphedSteps`: pooled fixed-capacity contexts, one graph per block size (and head),
    the context's valid length and the anchor's position in tensors, the first two replays of a shape checked
    against the eager step. Appending verified features to the context stays eager (its row count varies).
    """

    def __init__(self, drafter: torch.nn.Module, capture: Capture | None = None, max_rows: int = MAX_ROWS) -> None:
        device = drafter.fc.weight.device
        if capture is None:
            if device.type != "cuda":
                raise InvalidInputError(f"CUDA graphs need a CUDA device, the drafter is on {device}")
            capture = cuda_capture
        super().__init__(capture, max_rows)
        self.drafter, self.device = drafter, device

    def _label(self, key: tuple) -> str:
        return f"drafting {key[0] - 1} tokens"

    def new_context(self, capacity: int, window: int | None = None) -> GraphContext:
        """An empty context for one generation of up to ``capacity`` positions (pooled like the target's caches);
        drafting attends to its last ``window`` rows only (None: all)."""
        return self._lend(capacity, lambda slot: GraphContext(slot, window))

    def _new_slot(self, capacity: int) -> _DraftSlot:
        d, device, rows = self.drafter, self.device, self.max_rows
        attn = d.layers[0].self_attn
        dtype = d.fc.weight.dtype
        shape = (1, attn.n_kv, capacity, attn.head_dim)
        cos, sin = d._fast_forward().rotary_tables(capacity + rows, dtype, device)
        return _DraftSlot(
            keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in d.layers],
            values=[torch.zeros(shape, dtype=dtype, device=device) for _ in d.layers],
            ids=torch.full((1, rows), d.config.mask_token_id, dtype=torch.long, device=device),
            pos=torch.zeros(1, dtype=torch.long, device=device),
            length=torch.zeros(1, dtype=torch.long, device=device),
            first=torch.zeros(1, dtype=torch.long, device=device),
            rows=torch.arange(rows, device=device),
            key_positions=torch.arange(capacity, device=device),
            cos=cos,
            sin=sin,
        )

    @torch.inference_mode()
    def __call__(
        self,
        context: ContextCache,
        anchor: int,
        pos: int,
        k: int,
        embed_tokens: torch.nn.Module,
        head: Callable[[Tensor], Tensor],
        fast: object,
        eager: Callable[[], tuple[Tensor, Tensor]],
    ) -> tuple[Tensor, Tensor]:
        """The draft scores [k, V'] of one step and the hidden rows [k, hidden] they are the head's products of:
        replayed from a graph where one applies, else ``eager()``."""
        s = k + 1
        key = (s, id(fast), id(embed_tokens), id(head))
        if (
            not isinstance(context, GraphContext)
            or context.length == 0
            or s > self.max_rows
            or pos + s > context.slot.cos.shape[0]
            or key in self.failed
        ):
            return eager()
        slot = context.slot
        slot.ids[0, 0].fill_(anchor)
        slot.pos.fill_(pos)
        slot.length.fill_(context.length)
        slot.first.fill_(context.first)
        shape = slot.shapes.get(key) or self._capture(key, slot, embed_tokens, head, fast)
        if shape is None:
            return eager()
        if shape.checks_left:  # the first replays are checked against the eager step
            expected = eager()
            shape.replay()
            if not self._agrees(key, slot.shapes, shape, expected[0]):
                return expected
        else:
            shape.replay()
        return shape.logits.clone(), shape.hidden.clone()

    def _capture(
        self,
        key: tuple,
        slot: _DraftSlot,
        embed_tokens: torch.nn.Module,
        head: Callable[[Tensor], Tensor],
        fast: object,
    ) -> _Shape | None:
        s = key[0]
        capacity = slot.key_positions.shape[0]
        group = self.drafter.layers[0].self_attn.n_heads // self.drafter.layers[0].self_attn.n_kv
        context = list(zip(slot.keys, slot.values))
        shape = _Shape()

        def step() -> None:
            # every tensor the step reads lives in the slot or the modules, or is made here: a graph keeps the
            # addresses, not this closure, so a tensor made beside the step would be freed and its memory reused
            embeddings = self.drafter.embed(slot.ids[:, :s], embed_tokens)  # [1, s, hidden]
            positions = slot.pos + slot.rows[:s]  # [s]
            in_context = (slot.key_positions < slot.length) & (slot.key_positions >= slot.first)  # [capacity]
            block_visible = torch.ones(s, dtype=torch.bool, device=self.device)
            visible = torch.cat((in_context, block_visible))  # [capacity + s]
            mask = torch.zeros(capacity + s, dtype=embeddings.dtype, device=self.device)
            mask = mask.masked_fill(~visible, float("-inf"))[None, None, None].expand(1, 1, group * s, capacity + s)
            hidden = fast.run(embeddings, slot.cos[positions], slot.sin[positions], context, mask)
            shape.hidden = hidden[0, 1:]  # [k, hidden]
            shape.logits = head(shape.hidden)  # [k, V']

        return self._record(key, slot.shapes, shape, step)
