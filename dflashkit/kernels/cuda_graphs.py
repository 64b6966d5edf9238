"""CUDA graphs for the fast target forward: each step shape is captured once, then replayed.

On a GPU a small target is not bound by its arithmetic but by the CPU launching its kernels one by one:
SmolLM2-135M's fast forward ran ~65 ms per step on an H100 (30 layers of small ops), while 450 tiny kernels
took 5.0 ms launched eagerly and 0.6 ms replayed from one CUDA graph (measured on an H100). A graph
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

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

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


@dataclass
class _Shape:
    """One recorded step: its replay, the checks still to make, and its static outputs (set by the step)."""

    replay: Callable[[], None] | None = None
    checks_left: int = CHECKS  # replays still compared with the eager forward
    logits: Tensor | None = None  # static outputs of the captured step
    features: Tensor | None = None
    hidden: Tensor | None = None  # a drafting step's hidden rows (their scores are `logits`)


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
        warnings.warn(
            f"CUDA graph for {self._label(key)} not used ({why}); it runs eagerly", RuntimeWarning, stacklevel=4
        )


# ---- the drafter's steps -------------------------------------------------------------------------------------
