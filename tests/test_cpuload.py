"""The busy-machine hint: CPU load from /proc/stat, and when it suggests fewer threads."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest

from dflashkit import cpuload
from dflashkit.cpuload import busy_cores, threads_hint


def write_stat(path, busy: int, idle: int) -> None:
    # cpu user nice system idle iowait irq softirq steal guest guest_nice
    path.write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")


def test_busy_cores_is_the_busy_share_of_the_interval_times_the_cores(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    write_stat(stat, busy=1000, idle=5000)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)

    clock = {"wall": 0.0, "own": 0.0}

    def later(seconds):  # between the two reads: 300 busy and 100 idle jiffies more (3 of 4 cores busy), a quarter
        write_stat(stat, busy=1300, idle=5100)  # of a core of it this process's own
        clock["wall"] += seconds
        clock["own"] += 0.25 * seconds

    monkeypatch.setattr(
        cpuload,
        "time",
        SimpleNamespace(sleep=later, monotonic=lambda: clock["wall"], process_time=lambda: clock["own"]),
    )
    assert abs(busy_cores(0.1, stat) - 2.75) < 1e-9  # other processes' share only
    assert busy_cores(0.1, tmp_path / "absent") is None  # not Linux: no figure, no hint
    stat.write_text("intr 1 2 3\n")
    assert busy_cores(0.1, stat) is None


def test_busy_cores_sees_other_processes_and_not_this_one(monkeypatch):
    """Checked against the machine's own figures over the same window, so that other load (a parallel test
    worker) cannot tip it: a spinning thread here is subtracted, a spinning process elsewhere is counted."""
    import subprocess
    import sys

    if not cpuload.PROC_STAT.exists():
        pytest.skip("no /proc/stat here")
    reads = []
    real = cpuload._cpu_times

    def spy(stat):
        reads.append(real(stat))
        return reads[-1]

    monkeypatch.setattr(cpuload, "_cpu_times", spy)

    def raw() -> float:  # the whole machine's busy cores over the window busy_cores just read
        (b0, t0), (b1, t1) = reads[-2:]
        return (os.cpu_count() or 1) * (b1 - b0) / (t1 - t0)

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)  # this process's own work (a server's threads): not another's load
    worker.start()
    try:
        mine = busy_cores(0.3)
        machine = raw()
    finally:
        stop.set()
        worker.join()
    assert machine - mine >= 0.3  # the spinning thread's time was taken off the machine's (at least ~0.5 core)
    other = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        theirs = busy_cores(0.3)
    finally:
        other.kill()
        other.wait()
    assert theirs >= 0.5  # the other process holds a core


def test_threads_hint_only_where_other_load_leaves_fewer_cores_than_threads(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert threads_hint(2, None) is None and threads_hint(2, 0.2) is None  # idle enough
    hint = threads_hint(2, 1.0)
    assert hint is not None and "--threads 1" in hint and "~1.0 of this machine's 2 cores" in hint
    assert threads_hint(1, 1.0) is None  # already within the free core
    assert "--threads 1" in threads_hint(2, 1.9)  # never fewer than one


def test_apply_threads_sets_torch_threads_or_notes_a_busy_cpu(monkeypatch, capsys):
    import torch

    from dflashkit.cpuload import apply_threads
    from dflashkit.errors import InvalidInputError

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(cpuload, "busy_cores", lambda interval=0.1: 1.2)
    apply_threads(None)  # a CPU run without --threads on a busy machine: the note
    assert "--threads 1" in capsys.readouterr().err
    apply_threads(None, "cuda")  # a GPU run: no note
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(cpuload, "busy_cores", lambda interval=0.1: 0.1)
    apply_threads(None)  # idle: no note
    assert capsys.readouterr().err == ""
    with pytest.raises(InvalidInputError, match="at least 1"):
        apply_threads(0)
    monkeypatch.undo()
    try:
        apply_threads(1)  # --threads: set, no note
        assert torch.get_num_threads() == 1 and capsys.readouterr().err == ""
    finally:
        torch.set_num_threads(before)


def test_load_watcher_samples_until_stopped():
    from dflashkit.cpuload import LoadWatcher

    seen = []
    done = threading.Event()

    def on_sample(busy):
        seen.append(busy)
        if len(seen) == 3:
            done.set()

    watcher = LoadWatcher(on_sample, period=0.01, interval=0.0, sample=lambda interval: 1.5)
    watcher.start()
    assert done.wait(5)
    watcher.stop()
    watcher._thread.join(5)
    assert not watcher._thread.is_alive() and seen[:3] == [1.5, 1.5, 1.5]


def test_server_reports_other_load_as_a_gauge_and_warns_once_per_busy_spell(monkeypatch, caplog):
    import logging

    import torch

    from dflashkit.server.app import busy_load_reporter
    from dflashkit.server.metrics import ServerMetrics

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    metrics = ServerMetrics()
    report = busy_load_reporter(metrics)
    with caplog.at_level(logging.INFO, logger="dflashkit.server"):
        for busy in (0.1, None, 1.1, 1.2, 0.2, 1.0):
            report(busy)
    assert metrics.registry.get_sample_value("dflashkit_other_cpu_load_cores") == 1.0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("--threads 1" in r.getMessage() for r in warnings)  # busy, quiet, busy again
    assert any("dropped to ~0.2 cores" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
