"""Several generations at once: their target passes run together, one batched pass per round.

A decoding step of a small model on a CPU streams every weight from memory for a few rows of arithmetic, so a
pass over the rows of four sequences costs little more than a pass over one (the products run once over all
rows; each sequence attends over its own cache): batching is how a server turns idle arithmetic into throughput.

Each generation keeps its own decode loop (:func:`dflashkit.decoding.loop.decode`, unchanged) in its own thread. Its
target calls go to a :class:`ForwardBatcher`, which holds them until every member generation has made one, then
runs them all as one pass (:meth:`TargetAdapter.forward_batch`) and hands each its result: a rendezvous per
round. A member that is drafting, detokenizing or ending is waited for; one that ends leaves the batch. Drafting
has a rendezvous of its own: a member's drafting call waits until every member is drafting or waiting for the
pass, and the calls then run as one drafting round (:meth:`DFlashDrafter.draft_scores_batch`: their new context
rows and blocks in one call of the drafter's kernels, their drafts through the head in one product), each
sequence's scores bitwise those of its call alone.

All heavy computation of the batch (the batched passes, the drafter's forwards) runs in one thread, its
:class:`ComputeThread`, with torch's threads; the member threads run their own small tensor ops (sampling, the
acceptance test) on one thread each. The reason is libgomp (the OpenMP runtime torch's CPU kernels use): every
thread that runs a parallel region keeps a team of its own, and once the process holds more OpenMP threads than
CPUs, all of them stop spinning between regions and sleep, so each of the hundreds of regions of a step pays a
wake-up (on a 2-core AMD Zen 1, plain decoding in a second thread while the main thread held a team ran ~10%
slower than in one thread). Handing the work between threads is not free either: a batch of one decodes ~2-3%
slower than the same generation in one thread, so ``generate_batch`` runs a single prompt directly, and the server
with ``max_batch`` 1 runs each generation whole in the compute thread.

The adaptive block size (:mod:`dflashkit.decoding.adaptive`) of a member judges a step by its cost to the batch, not
by its wall time (which holds the other members' drafting and rows): its own drafting and bookkeeping plus its
share of the pass, in proportion to its rows. With every member choosing that way the batch's tokens per
second are maximal; where the pass is compute-bound (an AVX2 CPU: 4 sequences x 1 row cost ~1.9x one row, 4 x 4
rows ~6x), that means short blocks or plain steps as the batch fills up.

Exactness: the fast forward computes every row on its own (:mod:`dflashkit.kernels.row_kernels`), so each member's
logits and features are bitwise those of its call alone; where a pass cannot be batched (other kernels, a GPU,
too many rows) the calls run one after another. Either way a generation's tokens are exactly those it gives
alone, greedy or sampled with its seed (tests check both).
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dflashkit.decoding.adaptive import AdaptiveBlockSize
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.target.adapter import TargetAdapter
from dflashkit.target.fast import ForwardCall


@dataclass
class _Pending:
    call: ForwardCall
    result: tuple[Tensor, Tensor | None] | None = None
    error: BaseException | None = None
    share: float = 0.0  # seconds of the pass that were this call's (in proportion to its rows)

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass
class _DraftPending:
    drafter: DFlashDrafter
    args: tuple  # DFlashDrafter.draft_scores's arguments
    result: tuple[Tensor, Tensor | None] | None = None
    error: BaseException | None = None
    share: float = 0.0  # seconds of the drafting round that were this call's (in proportion to its drafts)

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass
class _Task:
    fn: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None
    done: bool = False


class ComputeThread:
    """Runs the closures handed to it (:meth:`call`, from any thread) one at a time in a single thread: the
    thread that calls :meth:`serve`, or a background one (:meth:`start`). Calls from that thread run at once."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads if threads is not None else torch.get_num_threads()  # torch threads it computes with
        self._cond = threading.Condition()
        self._tasks: collections.deque[_Task] = collections.deque()
        self._owner: int | None = None  # the serving thread's ident
        self._thread: threading.Thread | None = None
        self._stop = False

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` run in the compute thread; returns its result (or raises its error) here."""
        if threading.get_ident() == self._owner:
            return fn(*args, **kwargs)
        task = _Task(functools.partial(fn, *args, **kwargs))
        with self._cond:  # queued until a thread serves (serve() may begin after the first calls)
            self._tasks.append(task)
            self._cond.notify_all()
            while not task.done:
                self._cond.wait()
        if task.error is not None:
            raise task.error
        return task.result

    def serve(self, until: Callable[[], bool]) -> None:
        """Run tasks in the calling thread until ``until()`` holds and none is left (checked whenever a task ends
        and on :meth:`wake`)."""
        torch.set_num_threads(self.threads)
        with self._cond:
            self._owner = threading.get_ident()
            try:
                while True:
                    while not self._tasks and not until():
                        self._cond.wait()
                    if not self._tasks:
                        return
                    task = self._tasks.popleft()
                    self._cond.release()
                    try:
                        task.result = task.fn()
                    except BaseException as exc:
                        task.error = exc
                        if not isinstance(exc, Exception):  # Ctrl-C, exit: here too
                            raise
                    finally:
                        self._cond.acquire()
                        task.done = True
                        self._cond.notify_all()
            finally:
                self._owner = None

    def wake(self) -> None:
        """Have :meth:`serve` check its ``until`` again (call after changing what it reads)."""
        with self._cond:
            self._cond.notify_all()

    def start(self) -> ComputeThread:
        """Serve in a background thread until :meth:`stop`."""
        with self._cond:
            if self._thread is None:
                self._stop = False
                self._thread = threading.Thread(
                    target=self.serve, args=(lambda: self._stop,), name="dflashkit-compute", daemon=True
                )
                self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)


def member_thread(compute: ComputeThread) -> None:
    """Set up the calling thread to decode as a batch member: its own tensor ops on one torch thread (the heavy
    ones run in ``compute``).

    ``torch.set_num_threads`` sets the calling thread's OpenMP threads and also the process default, which every
    thread reads once, lazily, per library (torch's own, each C++ extension's) at its first parallel loop there.
    Left at 1, that default would put the compute thread's first row-kernel pass, and every one after it, on one
    thread (a server with ``--max-batch 4`` then decoded at about 60% of its speed with one client). So this
    thread takes its own lazy setting first (it cannot undo the 1 afterwards), and the compute thread sets the
    default back (its own setting again, too, should a pass of its have read the 1 meanwhile)."""
    torch.get_num_threads()  # torch's lazy per-thread setting, taken now
    torch.set_num_threads(1)
    compute.call(torch.set_num_threads, compute.threads)


class ForwardBatcher:
    """The rendezvous of the member generations' target passes (see the module docstring)."""

    def __init__(self, target: TargetAdapter, compute: ComputeThread) -> None:
        self.target, self.compute = target, compute
        self._cond = threading.Condition()
        self._members = 0
        self._waiting: list[_Pending] = []
        self._drafting: list[_DraftPending] = []
        self._running = False
        self.passes = 0  # batched rounds run (for stats and tests)
        self.calls = 0  # member calls served
        self.draft_rounds = 0  # drafting rounds run
        self.drafts = 0  # member drafting calls served

    def join(self) -> BatchMember:
        """A new member generation (``gen.stream(..., batch=member)``); it must :meth:`leave` when it ends, or the
        others wait for it."""
        with self._cond:
            self._members += 1
        return BatchMember(self)

    def leave(self, member: BatchMember) -> None:
        with self._cond:
            if member.left:
                return
            member.left = True
            self._members -= 1
            self._cond.notify_all()  # those waiting may now be everyone

    @property
    def members(self) -> int:
        """Generations joined and not yet left."""
        return self._members

    def forward(self, call: ForwardCall) -> tuple[tuple[Tensor, Tensor | None], float]:
        """One member's target call: returns, once the round it joined has run (as its leader or not), the call's
        result and its share of the pass in seconds."""
        pending = _Pending(call)
        self._rendezvous(pending, self._waiting, lambda: len(self._waiting) >= self._members, self._run)
        return pending.result, pending.share

    def draft(self, drafter: DFlashDrafter, args: tuple) -> tuple[tuple[Tensor, Tensor | None], float]:
        """One member's drafting call (``drafter.draft_scores(*args)``): held until every member is drafting or
        waiting for the target pass, then run with the others' in one drafting round
        (:meth:`DFlashDrafter.draft_scores_batch`). Returns the scores and its share of the round in seconds."""
        pending = _DraftPending(drafter, args)
        self._rendezvous(
            pending,
            self._drafting,  # the round runs when nobody else will draft in it
            lambda: len(self._waiting) + len(self._drafting) >= self._members,
            self._run_drafts,
        )
        return pending.result, pending.share

    def _rendezvous(
        self, pending: _Pending | _DraftPending, queue: list, ready: Callable[[], bool], run: Callable[[list], None]
    ) -> None:
        """Queue a call and return once it is done: the member that finds ``ready()`` (under the lock, no round
        running) takes the whole queue and runs it as one round, the others wait. Raises the call's error."""
        with self._cond:
            queue.append(pending)
            self._cond.notify_all()
            while not pending.done:
                if not self._running and queue and ready():
                    batch = queue[:]
                    queue.clear()
                    self._running = True
                    self._cond.release()
                    try:
                        run(batch)
                    finally:
                        self._cond.acquire()
                        self._running = False
                        self._cond.notify_all()
                else:
                    self._cond.wait()
        if pending.error is not None:
            raise pending.error

    def _run_drafts(self, batch: list[_DraftPending]) -> None:
        self.draft_rounds += 1
        self.drafts += len(batch)
        start = time.perf_counter()
        groups: dict[int, list[_DraftPending]] = {}
        for p in batch:
            groups.setdefault(id(p.drafter), []).append(p)
        for group in groups.values():
            try:
                results = self.compute.call(group[0].drafter.draft_scores_batch, [p.args for p in group])
                for p, result in zip(group, results):
                    p.result = result
            except Exception:  # noqa: BLE001  (one bad call: run them one by one, each gets its own result or error)
                for p in group:
                    try:
                        p.result = self.compute.call(p.drafter.draft_scores, *p.args)
                    except Exception as exc:  # noqa: BLE001
                        p.error = exc
        seconds = time.perf_counter() - start
        drafts = sum(p.args[5] for p in batch)  # k of each call
        for p in batch:
            p.share = seconds * p.args[5] / drafts if drafts else seconds / len(batch)

    def _run(self, batch: list[_Pending]) -> None:
        self.passes += 1
        self.calls += len(batch)
        start = time.perf_counter()
        try:
            results = self.compute.call(self.target.forward_batch, [p.call for p in batch])
        except Exception:  # noqa: BLE001  (one bad call: run them one by one, each gets its own result or error)
            for p in batch:
                try:
                    p.result = self.compute.call(self.target.forward_call, p.call)
                except Exception as exc:  # noqa: BLE001
                    p.error = exc
            results = None
        seconds = time.perf_counter() - start
        rows = sum(p.call.input_ids.shape[1] for p in batch)
        for i, p in enumerate(batch):
            p.share = seconds * p.call.input_ids.shape[1] / rows
            if results is not None:
                p.result = results[i]


class BatchMember:
    """One generation's view of a :class:`ForwardBatcher`: the target and drafter its decode loop uses."""

    def __init__(self, batcher: ForwardBatcher) -> None:
        self.batcher = batcher
        self.left = False
        self._waits: list[tuple[float, float, float]] = []  # (ended at, seconds waited, own share of them) since
        # the last step was observed: waits on the other members (their rows in a pass, their drafting)

    def target(self, target: TargetAdapter) -> Any:
        """The target the member's decode loop calls (its forwards go through the batcher)."""
        if target is not self.batcher.target:
            raise ValueError("a batch member decodes with its batcher's target")
        return _BatchedTarget(target, self)

    def drafter(self, drafter: DFlashDrafter | None) -> Any:
        """The drafter the member's decode loop calls (its drafting steps run in rounds with the other members')."""
        return _ComputedDrafter(drafter, self) if drafter is not None else None

    def compute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run other heavy work (a pass over the prompt for its log-probabilities) in the batch's compute thread."""
        return self.batcher.compute.call(fn, *args, **kwargs)

    def policy(self, policy: AdaptiveBlockSize | None) -> Any:
        """The block-size policy the member's decode loop consults (it observes steps at their cost to the batch)."""
        return _FairSharePolicy(policy, self) if policy is not None else None

    def waited(self, started: float, share: float = 0.0) -> None:
        """Record a wait that began at ``started`` (perf_counter) and ends now, ``share`` seconds of it its own."""
        now = time.perf_counter()
        self._waits.append((now, now - started, share))

    def step_cost(self, seconds: float) -> float:
        """The wall time of a step that ends now -> its cost to the batch: the waits in it (those that ended within
        its last ``seconds``: not the prefill's, before it) replaced by its own share of them."""
        since = time.perf_counter() - seconds
        inside = [(w, s) for end, w, s in self._waits if end >= since]
        self._waits.clear()
        return max(0.0, seconds - sum(w for w, _ in inside)) + sum(s for _, s in inside)


class _BatchedTarget:
    """A TargetAdapter whose ``forward`` goes through the batcher (everything else is the adapter's)."""

    def __init__(self, target: TargetAdapter, member: BatchMember) -> None:
        self._target, self._member = target, member

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)

    def forward(
        self, input_ids: Tensor, start: int, cache: Any, logits_rows: int, tree: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor | None]:
        started = time.perf_counter()
        result, share = self._member.batcher.forward(ForwardCall(input_ids, start, cache, logits_rows, tree))
        self._member.waited(started, share)
        return result


class _ComputedDrafter:
    """A drafter whose forwards run in the batch's compute thread, the members' drafting steps of a round together
    (:meth:`ForwardBatcher.draft`)."""

    def __init__(self, drafter: DFlashDrafter, member: BatchMember) -> None:
        self._drafter, self._member = drafter, member

    def __getattr__(self, name: str) -> Any:
        return getattr(self._drafter, name)

    def draft_scores(self, *args: Any) -> Any:
        queued = time.perf_counter()
        scores, share = self._member.batcher.draft(self._drafter, args)
        # the wait for the others (their drafting, a pass) is not its cost; its share of the drafting round is
        self._member.waited(queued, share=share)
        return scores


class _FairSharePolicy:
    """An adaptive block-size policy observing a member's steps at their cost to the batch (its own time and its
    share of the passes), not their wall time; its copy policy likewise."""

    def __init__(self, policy: AdaptiveBlockSize, member: BatchMember) -> None:
        self._policy, self._member = policy, member
        self.copies = _FairSharePolicy(policy.copies, member) if policy.copies is not None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def observe(self, block: int, drafted: int, accepted: int, seconds: float) -> None:
        self._policy.observe(block, drafted, accepted, self._member.step_cost(seconds))
