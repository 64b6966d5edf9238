"""Shutting down without dropping anyone: a drain, begun by SIGTERM or Ctrl-C (SIGINT).

:meth:`Lifecycle.begin_drain` answers new generation requests and the queued ones 503 (``shutting_down``, with
``Retry-After``) and lets the running generations go on for up to ``settings.shutdown_timeout`` seconds; at that
timeout the rest are cut off, each ending with an error (a stream: its error event, then ``[DONE]`` or the API's
closing event; otherwise a 503). The scheduler's threads are never interrupted: a cut-off generation stops at its
next decode step (:mod:`dflashkit.server.scheduler`).

Signals. :func:`serve` (what ``dflashkit serve`` runs) serves HTTP from a thread and computes in the main thread, so
it handles SIGTERM and SIGINT there itself: the first begins the drain and has uvicorn exit (it stops accepting,
waits for the open connections, which the drain bounds, and runs the lifespan's shutdown); a second cuts off at
once; a third stops without waiting. When uvicorn (or gunicorn's uvicorn worker) runs the app in the main thread,
the app's lifespan chains the same handling in front of the server's own handlers: the drain begins, then uvicorn's
handler runs as usual.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from dflashkit.decoding.batching import ComputeThread
from dflashkit.server.scheduler import Scheduler

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("dflashkit.server")

SIGNALS = (signal.SIGTERM, signal.SIGINT)

Handler = Callable[[int, FrameType | None], Any]


class Lifecycle:
    """The app's shutdown: its drain (``app.state.lifecycle``) and the signals that begin it.

    Every change runs in the event loop's thread (handed there with ``call_soon_threadsafe``, the one call that is
    safe in a signal handler, which may interrupt a thread that holds the scheduler's or the metrics' locks)."""

    def __init__(self, scheduler: Scheduler, timeout: float) -> None:
        self.scheduler, self.timeout = scheduler, timeout
        self.notify: Callable[[str], None] = log.info  # where the drain's progress is told
        self.drain_started: float | None = None  # time.monotonic() when the drain began
        self._loop: asyncio.AbstractEventLoop | None = None
        self._served = False  # attached to a loop once (and maybe detached since)
        self._reported = False  # the drain's summary told
        self._timer: asyncio.TimerHandle | None = None
        self._signals = 0
        self._chained: dict[int, Handler] = {}  # signal -> our handler, in front of the one it replaced
        self._previous: dict[int, Handler] = {}

    @property
    def draining(self) -> bool:
        return self.drain_started is not None

    # ---- the drain ---------------------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Begin the drain (from any thread; a no-op once begun): new and queued generation requests are answered
        503, running generations may go on for ``timeout`` seconds, then :meth:`cut_off` ends the rest."""
        self._in_loop(self._begin_drain)

    def cut_off(self) -> None:
        """End the drain now (from any thread): every generation still running stops at its next step with an
        error (a 503, or an error event on a stream)."""
        self._in_loop(self._cut_off)

    def _begin_drain(self) -> None:
        if self.drain_started is not None:
            return
        self.drain_started = time.monotonic()
        refused = self.scheduler.drain()
        running = self.scheduler.running
        self.notify(
            f"Shutting down: {refused} queued request(s) answered 503; {running} running may finish within "
            f"{self.timeout:g} s (signal again to cut them off now)"
        )
        self._start_timer()

    def _start_timer(self) -> None:
        if self._loop is not None and self._timer is None and self.drain_started is not None:
            remaining = self.drain_started + self.timeout - time.monotonic()
            self._timer = self._loop.call_later(max(0.0, remaining), self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        cut = self.scheduler.cut_off()
        if cut:
            self.notify(f"Shutdown timeout ({self.timeout:g} s): cutting off {cut} generation(s)")

    def _cut_off(self) -> None:
        self._begin_drain()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        cut = self.scheduler.cut_off()
        if cut:
            self.notify(f"Cutting off {cut} generation(s)")

    def summary(self) -> str:
        """What the drain did, in a line: requests finished, answered 503, cut off (and ended otherwise)."""
        r = self.scheduler.drain_report()
        seconds = time.monotonic() - self.drain_started if self.drain_started is not None else 0.0
        line = (
            f"Drained in {seconds:.1f} s: {r['finished']} request(s) finished, {r['refused']} answered 503, "
            f"{r['cut_off']} cut off"
        )
        return line + (f", {r['other']} ended otherwise (client gone, timeout, error)" if r["other"] else "")

    def _in_loop(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:  # the loop has closed: the app serves no more, there is nothing to end
                pass
        elif not self._served:  # not serving yet: nothing runs that could hold a lock
            fn()

    # ---- signals -----------------------------------------------------------------------------------------

    def on_signal(self, sig: int) -> int:
        """A shutdown signal (safe in a signal handler): the first begins the drain, the second cuts off. Returns
        how many have come."""
        self._signals += 1
        if self._signals == 1:
            self.begin_drain()
        elif self._signals == 2:
            self.cut_off()
        return self._signals

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The app starts serving in ``loop`` (its lifespan's startup). In the main thread, where a server that
        runs the app (uvicorn, gunicorn's uvicorn worker) has installed its own SIGTERM and SIGINT handlers, put
        ours in front of them: the drain begins, then the server's handler stops it as usual (the second signal,
        which cuts off, is not passed on: a second Ctrl-C would have uvicorn drop the streams at once)."""
        self._loop, self._served = loop, True
        self._start_timer()  # a drain begun before the app served
        if threading.current_thread() is not threading.main_thread():
            return  # signals are the main thread's (`serve` handles them there)
        for sig in SIGNALS:
            previous = signal.getsignal(sig)
            if not callable(previous):  # the default or ignored: no server of ours to stop after the drain
                continue

            def handler(signum: int, frame: FrameType | None, previous: Handler = previous) -> None:
                if self.on_signal(signum) != 2:
                    previous(signum, frame)

            signal.signal(sig, handler)
            self._chained[sig], self._previous[sig] = handler, previous

    def detach(self) -> None:
        """The app stops serving (its lifespan's shutdown): our signal handlers give way to those they were put in
        front of, and a drain's summary is told."""
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._chained.items():
                if signal.getsignal(sig) is handler:
                    signal.signal(sig, self._previous[sig])
        self._chained.clear()
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop = None
        self.report()

    def report(self) -> None:
        """Tell the drain's summary (once; nothing when no drain began)."""
        if self.draining and not self._reported:
            self._reported = True
            self.notify(self.summary())


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def serve(
    app: FastAPI,
    compute: ComputeThread,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    **options: Any,
) -> int:
    """Serve ``app`` (made by :func:`~dflashkit.server.create_app` with ``compute``) with uvicorn until SIGTERM or
    Ctrl-C, then drain (module docstring); returns 0, the exit status. HTTP runs in a thread of its own, every pass
    of the models in this thread (``compute``), which must be the main thread for the signals to be handled; the
    drain's progress and summary go to stderr. ``options``: more ``uvicorn.Config`` keyword arguments."""
    import uvicorn

    lifecycle: Lifecycle = app.state.lifecycle
    lifecycle.notify = _to_stderr
    # no timeout_graceful_shutdown: uvicorn waits for the open connections, which the drain bounds
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, **options))

    def run_server() -> None:  # the HTTP side in a thread of its own; the main thread computes
        try:
            server.run()
        finally:
            compute.wake()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if lifecycle.on_signal(signum) >= 3:
            server.force_exit = True  # a third signal: stop without waiting for the connections
        server.should_exit = True

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():  # before the server starts: no KeyboardInterrupt
        previous = {sig: signal.signal(sig, on_signal) for sig in SIGNALS}
    thread = threading.Thread(target=run_server, name="dflashkit-http", daemon=True)
    thread.start()
    try:
        compute.serve(until=lambda: not thread.is_alive())
    except BaseException:
        server.force_exit = True  # nothing computes any more: the running generations cannot end
        raise
    finally:
        server.should_exit = True
        thread.join(10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    lifecycle.report()  # when uvicorn stopped without the lifespan's shutdown (a third signal)
    return 0
