"""CUDA graphs for the fast target forward: each step shape is captured once, then replayed.

On a GPU a small target is not bound by its arithmetic but by the CPU launching its kernels one by one:
SmolLM2-135M's fast forward ran ~65 ms per step on an H100 (30 layers of small ops), while 450 tiny kernels
took 5.0 ms launched eagerly and 0.6 ms replayed from one CUDA graph (measured there, session 9). A graph
replays the exact kernels it recorded, on the same memory, so everything that changes between steps has to
live in tensors: :meth:`FastTargetForward.static_step` takes the position, the tokens and the block's
visibility as tensors, writes the KV cache with ``index_copy_`` and attends over the cache's whole capacity
with a mask built from those tensors.

:class:`GraphedSteps` keeps caches of fixed capacity (:class:`GraphCache`, capacity rounded up to a power of
two so that caches are reused across generations) and, per cache, one graph per step shape (rows, logits
rows, feature layers), captured the first time that shape runs. The first two replays of a shape are checked
against the eager fast forward on the same inputs: the second one runs at another position with other tokens,
so a recording that kept a value of its capture (the way graphs go wrong silently) disagrees there. A capture
that fails or disagrees turns graphs off for that shape (the eager fast forward runs it, with a warning).
Prefills (position 0: a new length per prompt) and steps longer than ``max_rows`` run eagerly on the same
cache.

The drafter's steps get the same treatment (:class:`GraphedDrafts`, :class:`GraphContext`): its three layers
and the head over the draft vocabulary are a few dozen more small kernels per step, which would otherwise cost
what the whole graphed target step costs. Appending verified features to its context stays eager.

The decode loop is unchanged: both plain and speculative decoding go through the same graphed forward, so
speculative greedy output still equals plain greedy output. A cache is lent to one generation at a time and
returns to the pool when that generation drops it.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflashkit.drafter.network import ContextCache
from dflashkit.errors import InvalidInputError
from dflashkit.target.fast import FastTargetForward, StaticKVCache, StepInputs
from dflashkit.kernels.int8 import Int8Linear

MIN_CAPACITY = 512
MAX_ROWS = 64  # steps of more rows (prefills) run eagerly
CHECKS = 2  # the first replays of a shape (at the capture's inputs, then at the next step's) are checked
CHECK_TOLERANCE = 0.1  # graph vs eager logits: max |difference| / max |logit| allowed (rounding, not bugs)

# A capture backend: records `step` (run it as a graph) and returns the function that replays it.
Capture = Callable[[Callable[[], None], object], Callable[[], None]]


def cuda_capture(step: Callable[[], None], pool: object) -> Callable[[], None]:
    """Record ``step`` as a CUDA graph (after warm-up runs on a side stream, as torch's docs prescribe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # cuBLAS handles and workspaces are created outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph.replay


def unsupported_reason(forward: FastTargetForward) -> str | None:
    """Why the fast forward cannot be replayed from graphs (None: it can)."""
    if forward.device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the target is on {forward.device}"
    if isinstance(forward.head, Int8Linear):
        return "weight-only int8 targets are not graphed"
    rope_type = getattr(forward.rotary, "rope_type", "default")
    if rope_type == "dynamic" or "dynamic" in str(rope_type):
        return f"rotary type {rope_type!r} changes with the sequence length"
    return None


@dataclass
class _Shape:
    """One recorded step: its replay, the checks still to make, and its static outputs (set by the step)."""

    replay: Callable[[], None] | None = None
    checks_left: int = CHECKS  # replays still compared with the eager forward
    logits: Tensor | None = None  # static outputs of the captured step
    features: Tensor | None = None
    hidden: Tensor | None = None  # a drafting step's hidden rows (their scores are `logits`)


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
            raise InvalidInputError(f"{end} positions do not fit this graph cache of {self.capacity}: ask "
                                    "new_cache for the capacity the generation needs")


class _Graphs:
    """What target and drafter graphs share: pooled slots of fixed capacity, recording a shape, and checking
    its first replays against the eager step. Subclasses make slots (``_new_slot``) and name a shape
    (``_label``)."""

    def __init__(self, capture: Capture, max_rows: int) -> None:
        self.capture, self.max_rows = capture, max_rows
        self.pool = torch.cuda.graph_pool_handle() if capture is cuda_capture else None
        self._free: dict[int, list] = {}  # capacity -> slots no generation holds
        self.failed: dict[tuple, str] = {}  # shape -> why it runs eagerly
        self.captures = 0

    def _lend(self, capacity: int, handle: Callable) -> object:
        """``handle(slot)`` over a free slot of at least ``capacity`` positions (a power of two, reused), which
        returns to the pool when the generation drops the handle."""
        size = max(MIN_CAPACITY, 1 << max(0, int(capacity) - 1).bit_length())
        free = self._free.setdefault(size, [])
        lent = handle(free.pop() if free else self._new_slot(size))
        weakref.finalize(lent, free.append, lent.slot)
        return lent

    def _new_slot(self, capacity: int):
        raise NotImplementedError

    def _label(self, key: tuple) -> str:
        raise NotImplementedError

    def _record(self, key: tuple, slots: dict[tuple, _Shape], shape: _Shape, step: Callable[[], None]) -> _Shape | None:
        """Record ``step`` (which sets ``shape``'s outputs) as this shape's graph; None if that fails."""
        try:
            shape.replay = self.capture(step, self.pool)
        except Exception as exc:  # noqa: BLE001 - any failure means: run this shape eagerly
            self._fail(key, f"capture failed: {type(exc).__name__}: {exc}")
            return None
        self.captures += 1
        slots[key] = shape
        return shape

    def _agrees(self, key: tuple, slots: dict[tuple, _Shape], shape: _Shape, expected: Tensor) -> bool:
        """After a checked replay: do its scores match the eager step's? If not, the shape is dropped."""
        scale = float(expected.float().abs().max()) or 1.0
        error = float((shape.logits.float() - expected.float()).abs().max()) / scale
        if not error <= CHECK_TOLERANCE:
            del slots[key]
            self._fail(key, f"its scores differ from the eager step's by {error:.3g} of the largest")
            return False
        shape.checks_left -= 1
        return True

    def _fail(self, key: tuple, why: str) -> None:
        self.failed[key] = why
        warnings.warn(f"CUDA graph for {self._label(key)} not used ({why}); it runs eagerly", RuntimeWarning,
                      stacklevel=4)


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
        return _Slot(keys=zeros(shape, dtype=f.dtype), values=zeros(shape, dtype=f.dtype),
                     ids=zeros(1, rows, dtype=torch.long), start=zeros(1, dtype=torch.long),
                     offsets=zeros(rows, dtype=torch.long), visible=zeros(rows, rows, dtype=torch.bool),
                     rows=torch.arange(rows, device=device),
                     chain=torch.ones(rows, rows, dtype=torch.bool, device=device).tril_(),
                     key_positions=torch.arange(capacity, device=device), cos=cos, sin=sin)

    # ---- steps ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def __call__(self, input_ids: Tensor, start: int, cache: GraphCache, logits_rows: int, feature_layers: list[int],
                 tree: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
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
        inputs = StepInputs(slot.ids[:, :n], slot.start, slot.offsets[:n], slot.rows[:n], slot.visible[:n, :n],
                            slot.key_positions, slot.cos, slot.sin)  # fmt: skip
        shape = _Shape()

        def step() -> None:
            shape.logits, shape.features = self.forward.static_step(inputs, slot.keys, slot.values, logits_rows,
                                                                    list(feature_layers))

        return self._record(key, slot.shapes, shape, step)


# ---- the drafter's steps -------------------------------------------------------------------------------------


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
        return _DraftSlot(keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in d.layers],
                          values=[torch.zeros(shape, dtype=dtype, device=device) for _ in d.layers],
                          ids=torch.full((1, rows), d.config.mask_token_id, dtype=torch.long, device=device),
                          pos=torch.zeros(1, dtype=torch.long, device=device),
                          length=torch.zeros(1, dtype=torch.long, device=device),
                          first=torch.zeros(1, dtype=torch.long, device=device),
                          rows=torch.arange(rows, device=device), key_positions=torch.arange(capacity, device=device),
                          cos=cos, sin=sin)

    @torch.inference_mode()
    def __call__(self, context: ContextCache, anchor: int, pos: int, k: int, embed_tokens: torch.nn.Module,
                 head: Callable[[Tensor], Tensor], fast: object,
                 eager: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """The draft scores [k, V'] of one step and the hidden rows [k, hidden] they are the head's products of:
        replayed from a graph where one applies, else ``eager()``."""
        s = k + 1
        key = (s, id(fast), id(embed_tokens), id(head))
        if not isinstance(context, GraphContext) or context.length == 0 or s > self.max_rows \
                or pos + s > context.slot.cos.shape[0] or key in self.failed:
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

    def _capture(self, key: tuple, slot: _DraftSlot, embed_tokens: torch.nn.Module, head: Callable[[Tensor], Tensor],
                 fast: object) -> _Shape | None:
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
