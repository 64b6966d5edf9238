"""Generations off the event loop, first come first served, up to ``max_batch`` at a time.

Worker threads (``max_batch`` of them) take queued jobs in arrival order, each running one generation at a
time. With a :class:`~dflashkit.decoding.batching.ForwardBatcher`, the running generations are its members: their target
passes run as one batched pass per round in the batcher's compute thread (:mod:`dflashkit.decoding.batching`), each
generation's tokens unchanged; with ``max_batch`` 1 one generation runs at a time, all of it in the compute thread
(no handoffs between threads: they cost a lone generation ~2-3% on a 2-core CPU). Each job streams its deltas to
its own asyncio queue (outputs are never mixed), and is checked for cancellation between decode steps: a client that
disconnects or runs out of time stops its generation within one step. The waiting line is bounded: `submit`
raises `QueueFullError` when it is full.
"""

from __future__ import annotations

import asyncio
import collections
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
        """Cancel everything and wait for the workers to finish their current step."""
        with self._cond:
            self._stopping = True
            for job in self._queue:
                job.cancel("shutdown")
            for job in self._running:
                job.cancel("shutdown")
            self._cond.notify_all()
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join(timeout)

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
            if self._stopping or not self._threads:
                raise RuntimeError("the scheduler is not running")
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
                if self._stopping:
                    for job in self._queue:
                        self._finish(job, "shutdown", None)
                    self._queue.clear()
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
            self._finish(job, job.cancel_reason or "cancelled", None)
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
            self._finish(job, job.cancel_reason or "cancelled", None)
            return
        job._emit(Done(stream.result))
        self._finish(job, stream.result.finish_reason or "length", stream.result)

    def _finish(self, job: Job, outcome: str, result: GenerationResult | None) -> None:
        job.finished_at = time.monotonic()
        if job.started_at is not None:
            self._mean_duration = 0.8 * self._mean_duration + 0.2 * (job.finished_at - job.started_at)
        if self.observer:
            try:
                self.observer.job_finished(job, outcome, result)
            except Exception:
                log.exception("job observer failed")
