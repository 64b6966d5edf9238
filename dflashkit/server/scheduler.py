"""Generations off the event loop, first come first served, up to ``max_batch`` at a time.

Worker threads (``max_batch`` of them) take queued jobs in arrival order, each running one generation at a
time. With a :class:`~dflashkit.decoding.batching.ForwardBatcher`, the running generations are its members: their target
passes run as one batched pass per round in the batcher's compute thread (:mod:`dflashkit.decoding.batching`), each
generation's tokens unchanged; with ``max_batch`` 1 one generation runs at a time, all of it in the compute thread
(no handoffs between threads: they cost a lone generation ~2-3% on a 2-core CPU). Each job streams its deltas to
its own asyncio queue (outputs are never mixed), and is checked for cancellation between decode steps: a client that
disconnects or runs out of time stops its generation within one step. The waiting line is bounded: `submit`
raises `QueueFullError` when it is full. Every job ends with one terminal event (`Done`, or `Failed` when it fails or
is cancelled for any reason), so no listener waits forever.

Shutting down (:mod:`dflashkit.server.lifecycle`): `drain` refuses new jobs and fails the queued ones with
`ServerShuttingDown` while the running ones go on; `cut_off` cancels those still running, each at its next step.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dflashkit.decoding.batching import BatchMember, ForwardBatcher, member_thread
from dflashkit.generator import GenerationResult, GenerationStream, TextDelta

log = logging.getLogger("dflashkit.server")


@dataclass
class Delta:
    delta: TextDelta


@dataclass
class Done:
    result: GenerationResult


@dataclass
class Failed:
    error: BaseException


Event = Delta | Done | Failed


class QueueFullError(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the request queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class JobCancelled(Exception):
    """What a job cancelled before its end fails with (its listener, if any, is told so)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the generation was stopped ({reason})")
        self.reason = reason


SHUTDOWN_RETRY_AFTER = 5  # seconds a client refused by a draining server is told to wait (another replica, a restart)


class ServerShuttingDown(JobCancelled):
    """A queued job answered 503 because the server drains, or a running one cut off at the drain's timeout."""

    def __init__(self, started: bool = False, retry_after: int = SHUTDOWN_RETRY_AFTER) -> None:
        Exception.__init__(
            self,
            "The server is shutting down: "
            + ("the generation was stopped before its end" if started else "the request was not started")
            + f"; retry after {retry_after} s",
        )
        self.reason = "shutdown" if started else "drained"
        self.retry_after = retry_after


# outcomes (as the JobObserver is told them) of a job that ends because the server shuts down
DRAINED, SHUTDOWN = "drained", "shutdown"


class JobObserver(Protocol):
    """Told when a job starts, emits tokens, and ends (e.g. metrics)."""

    def job_started(self, job: Job) -> None: ...

    def job_finished(self, job: Job, outcome: str, result: GenerationResult | None) -> None: ...


Start = Callable[[BatchMember | None], GenerationStream]  # begins a generation (as a batch member, or alone)


class Job:
    """One queued generation; `start` (run in a worker thread) begins it and returns its stream."""

    def __init__(self, start: Start, loop: asyncio.AbstractEventLoop) -> None:
        self.start = start
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancel = threading.Event()
        self.cancel_reason: str | None = None
        self.enqueued_at = time.monotonic()
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.tokens = 0  # tokens streamed so far
        self.group = 0  # the request it belongs to (a request's n choices or prompts are jobs of one group)

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the worker to stop this job (before it starts, or at the next decode step)."""
        if not self._cancel.is_set():
            self.cancel_reason = reason
            self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def next_event(self) -> Event:
        return await self._events.get()

    def _emit(self, event: Event) -> None:  # worker thread
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            self.cancel()


class Scheduler:
    """A bounded FIFO of jobs and the worker threads that run up to ``max_batch`` of them at a time."""

    def __init__(
        self,
        max_queue: int = 16,
        observer: JobObserver | None = None,
        max_batch: int = 1,
        batcher: ForwardBatcher | None = None,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_queue, self.max_batch = max_queue, max_batch
        self.observer = observer
        self.batcher = batcher
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: set[Job] = set()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._mean_duration = 1.0  # seconds per job, a moving average (for Retry-After)
        self._groups = itertools.count()
        self._draining = False
        self._drain_ends: dict[int, set[str]] = {}  # request -> outcomes of its jobs that ended during the drain
        self._refused = 0  # requests refused because the server drains

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._threads:
                return
            self._stopping = False
            self._threads = [
                threading.Thread(target=self._work, name=f"dflashkit-scheduler-{i}", daemon=True)
                for i in range(self.max_batch)
            ]
            for thread in self._threads:
                thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything (the queued jobs fail at once, the running ones at their next step, all with
        ServerShuttingDown) and wait for the workers to finish their current step."""
        with self._cond:
            self._stopping = True
            queued = list(self._queue)
            self._queue.clear()
            for job in self._running:
                job.cancel(SHUTDOWN)
            self._cond.notify_all()
            threads, self._threads = self._threads, []
        for job in queued:
            job.cancel(DRAINED)
            self._end_cancelled(job)
        for thread in threads:
            thread.join(timeout)

    def drain(self) -> int:
        """Refuse new jobs and fail the queued ones, both with ServerShuttingDown (503); the running ones go on.
        Returns how many queued jobs were failed."""
        with self._cond:
            self._draining = True
            queued = list(self._queue)
            self._queue.clear()
        for job in queued:
            job.cancel(DRAINED)  # a no-op for a job whose client already left
            self._end_cancelled(job)
        return len(queued)

    def cut_off(self) -> int:
        """Drain, and cancel the running jobs: each stops at its next step and fails with ServerShuttingDown.
        Returns how many running jobs were cancelled."""
        self.drain()
        with self._cond:
            running = [job for job in self._running if not job.cancelled]
            for job in running:
                job.cancel(SHUTDOWN)
        return len(running)

    @property
    def draining(self) -> bool:
        return self._draining

    def drain_report(self) -> dict[str, int]:
        """Requests that ended since the drain began: ``finished`` (ran to their end), ``refused`` (answered 503
        before they started, or on arrival), ``cut_off`` (stopped at the drain's timeout) and ``other`` (their
        client left, they timed out or failed). A request of several jobs counts once, by its worst end."""
        report = {"finished": 0, "refused": self._refused, "cut_off": 0, "other": 0}
        with self._cond:
            ends = list(self._drain_ends.values())
        for outcomes in ends:
            if SHUTDOWN in outcomes:
                report["cut_off"] += 1
            elif DRAINED in outcomes:
                report["refused"] += 1
            elif outcomes & {"cancelled", "timeout", "error"}:
                report["other"] += 1
            else:
                report["finished"] += 1
        return report

    # ---- queue -------------------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Jobs waiting (those cancelled while waiting are not counted)."""
        return sum(not job.cancelled for job in list(self._queue))

    @property
    def running(self) -> int:
        return len(self._running)

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely free: one place frees when a running job ends,
        estimated as the mean job duration."""
        return max(1, min(3600, math.ceil(self._mean_duration)))

    def submit(self, start: Start, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a generation; raises QueueFullError when max_batch jobs run and max_queue jobs already wait."""
        return self.submit_all([start], loop)[0]

    def submit_all(self, starts: list[Start], loop: asyncio.AbstractEventLoop) -> list[Job]:
        """Queue several generations one after another (a request's n choices), all or none: QueueFullError
        when the running jobs and those waiting leave fewer than len(starts) of the max_queue + max_batch places."""
        jobs = [Job(start, loop) for start in starts]
        with self._cond:
            if self._draining:
                self._refused += 1
                raise ServerShuttingDown()
            if self._stopping or not self._threads:
                raise RuntimeError("the scheduler is not running")
            group = next(self._groups)
            for job in jobs:
                job.group = group
            held = self.queued + sum(not job.cancelled for job in self._running)
            if held + len(jobs) > self.max_queue + self.max_batch:
                raise QueueFullError(self.retry_after())
            self._queue.extend(jobs)
            self._cond.notify()
        return jobs

    # ---- worker ------------------------------------------------------------------------------------------

    def _work(self) -> None:
        batched = self.batcher is not None and self.max_batch > 1
        if batched:
            member_thread(self.batcher.compute)  # heavy work goes to the batcher's compute thread
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:  # stop() ended the queued jobs
                    return
                job = self._queue.popleft()
                self._running.add(job)
            try:
                if batched:
                    self._run(job, self.batcher)
                elif self.batcher is not None:  # one generation at a time: all of it in the compute thread, alone
                    self.batcher.compute.call(self._run, job, None)
                else:
                    self._run(job, None)
            finally:
                with self._cond:
                    self._running.discard(job)

    def _run(self, job: Job, batcher: ForwardBatcher | None) -> None:
        """Run `job` to its end (as a member of `batcher`'s batch, or alone)."""
        if job.cancelled:  # gave up while waiting
            self._end_cancelled(job)
            return
        job.started_at = time.monotonic()
        if self.observer:
            self.observer.job_started(job)
        member = batcher.join() if batcher is not None else None
        try:
            stream = job.start(member)
            deltas = iter(stream)
            try:
                for delta in deltas:
                    if job.first_token_at is None:
                        job.first_token_at = time.monotonic()
                    job.tokens += len(delta.token_ids)
                    job._emit(Delta(delta))
                    if job.cancelled:
                        break
            finally:
                close = getattr(deltas, "close", None)
                if close is not None:
                    close()  # ends the decode loop now, releasing its caches
        except Exception as exc:  # noqa: BLE001  (reported to the client; the worker keeps serving)
            job._emit(Failed(exc))
            self._finish(job, "error", None)
            return
        finally:
            if member is not None:
                batcher.leave(member)  # the others stop waiting for this one
        if job.cancelled or stream.result is None:
            self._end_cancelled(job)
            return
        job._emit(Done(stream.result))
        self._finish(job, stream.result.finish_reason or "length", stream.result)

    def _end_cancelled(self, job: Job) -> None:
        """End a cancelled job: its listener gets Failed (ServerShuttingDown for the server's shutdown: "drained"
        before it started, "shutdown" after), the observer its outcome."""
        reason = job.cancel_reason or "cancelled"
        shutdown = reason in (DRAINED, SHUTDOWN)
        error = ServerShuttingDown(job.started_at is not None) if shutdown else JobCancelled(reason)
        job._emit(Failed(error))
        self._finish(job, error.reason, None)

    def _finish(self, job: Job, outcome: str, result: GenerationResult | None) -> None:
        job.finished_at = time.monotonic()
        if self._draining:
            with self._cond:
                self._drain_ends.setdefault(job.group, set()).add(outcome)
        if job.started_at is not None:
            self._mean_duration = 0.8 * self._mean_duration + 0.2 * (job.finished_at - job.started_at)
        if self.observer:
            try:
                self.observer.job_finished(job, outcome, result)
            except Exception:
                log.exception("job observer failed")
