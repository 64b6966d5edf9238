"""How busy the CPU is before a run starts, for the ``--threads`` hint on busy machines.

torch's OpenMP threads wait for each other at the end of every parallel region, spinning a while before they sleep.
When another process holds a core, a decoding step's many short regions stall on the thread that lost its core:
on a 2-core AMD EPYC Zen 4 with one core kept busy by a Python busy loop, speculative decoding with 2 threads ran at
about a third of its speed with ``--threads 1`` (docs/performance.md#threads-and-busy-machines). The CLI therefore
samples the CPU's load for a moment before loading the model and, where other processes hold cores and no
``--threads`` was given, says how many threads to use instead.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

PROC_STAT = Path("/proc/stat")
BUSY_CORES_HINT = 0.5  # other processes holding at least this many cores' worth of time: suggest fewer threads


def _cpu_times(stat: Path) -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs together from /proc/stat's first line, or None where it cannot be read."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    values = [int(v) for v in fields[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values[:8]) - idle, sum(values[:8])  # user..steal (guest time is already counted in user)


def busy_cores(interval: float = 0.15, stat: Path = PROC_STAT) -> float | None:
    """Cores' worth of CPU time other processes spent over the next ``interval`` seconds: the whole machine's busy
    time (/proc/stat) less this process's own (all its threads, e.g. a server's); None where /proc/stat is not
    available (not Linux)."""
    first, own, t0 = _cpu_times(stat), time.process_time(), time.monotonic()
    if first is None:
        return None
    time.sleep(interval)
    second = _cpu_times(stat)
    own, wall = time.process_time() - own, time.monotonic() - t0
    if second is None or second[1] <= first[1] or wall <= 0:
        return None
    cores = os.cpu_count() or 1
    return max(0.0, cores * (second[0] - first[0]) / (second[1] - first[1]) - own / wall)


def threads_hint(threads: int, busy: float | None) -> str | None:
    """A one-line suggestion when other processes hold cores that ``threads`` torch threads would contend for."""
    if busy is None or busy < BUSY_CORES_HINT:
        return None
    cores = os.cpu_count() or 1
    free = max(1, round(cores - busy))
    if free >= threads:
        return None
    return (
        f"other processes are keeping ~{busy:.1f} of this machine's {cores} cores busy; with {threads} "
        f"threads, decoding steps stall on the shared cores (often several times slower): --threads {free} "
        "is likely faster here (docs/performance.md#threads-and-busy-machines)"
    )


def on_cpu(device: object) -> bool:
    """Whether a ``--device`` value (None: the default, the CPU) or a torch.device runs on the CPU."""
    return device is None or str(device).startswith("cpu")


def apply_threads(threads: int | None, device: str | None = None, busy: float | None = None) -> None:
    """``--threads`` for torch; without it, on a CPU run, the note of :func:`threads_hint` on standard error
    (``busy``: a load already measured, else it is measured here)."""
    import sys

    import torch

    from dflashkit.errors import InvalidInputError

    if threads is not None:
        if threads < 1:
            raise InvalidInputError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    elif on_cpu(device):
        hint = threads_hint(torch.get_num_threads(), busy if busy is not None else busy_cores(0.1))
        if hint:
            print(f"note: {hint}", file=sys.stderr)


class LoadWatcher:
    """Other processes' CPU load sampled every ``period`` seconds in a daemon thread, for a long-running process whose
    machine may get busy after it started (``dflashkit serve``): ``on_sample(busy)`` gets each figure (cores, or
    None off Linux). Sampling sleeps, it costs no CPU."""

    def __init__(
        self,
        on_sample: Callable[[float | None], None],
        period: float = 30.0,
        interval: float = 0.5,
        sample: Callable[[float], float | None] | None = None,
    ) -> None:
        self.on_sample, self.period, self.interval = on_sample, period, interval
        self.sample = sample if sample is not None else busy_cores
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dflashkit-load-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread after its sample in progress (not waited for: a server's shutdown does not wait on it)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.on_sample(self.sample(self.interval))
            self._stop.wait(self.period)
