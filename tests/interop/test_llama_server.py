"""llama-server driver and the benchmark's llama-server peers, against a stand-in server (tests/fakes)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from dflashkit.bench.command import llama_server_methods
from dflashkit.bench.methods import KERNELS, OTHER_WEIGHTS, Request
from dflashkit.bench.metrics import RunRow, summarize
from dflashkit.bench.peers import LlamaServerPeer
from dflashkit.interop.llama_server import Completion, LlamaServer, LlamaServerError, find_llama_server

FAKE = Path(__file__).parents[1] / "fakes" / "fake_llama_server.py"


@pytest.fixture
def ggufs(tmp_path: Path) -> tuple[Path, Path]:
    target, drafter = tmp_path / "target.gguf", tmp_path / "drafter.gguf"
    target.write_bytes(b"GGUF")
    drafter.write_bytes(b"GGUF")
    return target, drafter


@pytest.fixture
def binary(tmp_path: Path) -> Path:
    """The stand-in as an executable run by this interpreter (its shebang may name another Python)."""
    exe = tmp_path / "llama-server"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    exe.chmod(0o755)
    return exe


def test_server_starts_completes_and_stops(binary, ggufs, tmp_path) -> None:
    log = tmp_path / "server.log"
    with LlamaServer(binary, ggufs[0], threads=2, log_path=log) as server:
        proc = server.proc
        c = server.complete([7, 8, 9], 5)
        assert c.tokens == [10, 11, 12, 13, 14]
        assert (c.prompt_ms, c.predicted_ms, c.predicted_n) == (10.0, 25.0, 5)
        assert c.draft_n == 0 and c.target_passes == 5  # plain decoding: one pass per token
        stopped = server.complete([40], 30)
        assert stopped.tokens[-1] == 2 and len(stopped.tokens) == 12  # an end-of-generation token is kept
    assert proc.poll() is not None  # stopped on exit
    assert "-t 2" in " ".join(server.command(1)) and "fake llama-server" in log.read_text()


def test_a_forgotten_server_is_stopped_when_collected(binary, ggufs, tmp_path) -> None:
    import gc

    server = LlamaServer(binary, ggufs[0], log_path=tmp_path / "server.log").start()
    proc, log_file = server.proc, server._log_file
    del server
    gc.collect()
    assert proc.poll() is not None and log_file.closed


def test_speculative_server_reports_drafts(binary, ggufs) -> None:
    server = LlamaServer(binary, ggufs[0], drafter=ggufs[1], block_size=8)
    cmd = server.command(1234)
    assert cmd[cmd.index("--spec-type") + 1] == "draft-dflash" and cmd[cmd.index("--spec-draft-n-max") + 1] == "7"
    with server:
        c = server.complete([20], 10)
    assert (c.draft_n, c.draft_n_accepted, c.target_passes) == (40, 5, 5)


def test_slots_share_out_the_context(binary, ggufs) -> None:
    cmd = LlamaServer(binary, ggufs[0], context=1024, parallel=4).command(1234)
    assert cmd[cmd.index("-np") + 1] == "4" and cmd[cmd.index("-c") + 1] == "4096"  # 1024 tokens per slot
    cmd = LlamaServer(binary, ggufs[0]).command(1234)
    assert cmd[cmd.index("-np") + 1] == "1" and cmd[cmd.index("-c") + 1] == "4096"


def test_extra_request_fields_reach_the_server(binary, ggufs) -> None:
    with LlamaServer(binary, ggufs[0]) as server:
        c = server.complete([20], 3, extra={"json_schema": {"type": "object"}})
        assert c.timings["json_schema"] == {"type": "object"}
        assert "json_schema" not in server.complete([20], 3).timings


def test_a_server_that_dies_while_starting_is_a_clear_error(binary, ggufs, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_LLAMA_SERVER_EXIT", "1")
    with pytest.raises(LlamaServerError, match="(?s)exited with code 1.*failed to load model"):
        LlamaServer(binary, ggufs[0], start_timeout_s=30).start()


def test_missing_files_and_bad_answers_are_clear_errors(binary, ggufs, tmp_path) -> None:
    with pytest.raises(LlamaServerError, match="does not exist"):
        LlamaServer(binary, tmp_path / "nope.gguf").start()
    with pytest.raises(LlamaServerError, match="unexpected llama-server answer"):
        Completion.from_response({"content": "hi"})
    with pytest.raises(ValueError, match="block size"):
        LlamaServer(binary, ggufs[0], drafter=ggufs[1], block_size=1)
    with LlamaServer(binary, ggufs[0]) as server, pytest.raises(ValueError, match="empty prompt"):
        server.complete([], 4)


def test_find_llama_server_order(tmp_path, monkeypatch, binary) -> None:
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DFLASHKIT_LLAMA_CPP", raising=False)
    monkeypatch.delenv("DFLASHKIT_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_llama_server() is None
    built = tmp_path / "cache" / "llama.cpp" / "build" / "bin" / "llama-server"
    built.parent.mkdir(parents=True)
    built.write_text("")
    assert find_llama_server() == built
    monkeypatch.setenv("DFLASHKIT_LLAMA_SERVER", str(binary))
    assert find_llama_server() == binary
    with pytest.raises(LlamaServerError, match="does not exist"):
        find_llama_server(tmp_path / "missing")


def test_peer_records_the_servers_own_timings(binary, ggufs, tmp_path) -> None:
    request = Request([3, 4], 6, 0.0, seed=0, stop_token_ids=frozenset({2}))
    plain = LlamaServerPeer("llama-server-bf16", binary, ggufs[0], threads=1, comparable=KERNELS, log_dir=tmp_path)
    spec = LlamaServerPeer(
        "llama-server-dflash-b8", binary, ggufs[0], drafter_gguf=ggufs[1], block_size=8, threads=1, comparable=KERNELS
    )
    try:
        assert plain.unavailable() is None and spec.unavailable() is None
        rec = plain.generate(request)
        assert rec.tokens == [5, 6, 7, 8, 9, 10]
        assert rec.ttft_s == pytest.approx(0.010) and rec.total_s == pytest.approx(0.040)
        assert rec.steps_total is None and rec.block_size == 1
        rec = spec.generate(request)
        assert (rec.steps_total, rec.accepted_total, rec.block_size) == (3, 3, 8)
    finally:
        plain.close()
        spec.close()
    assert (tmp_path / "llama-server-bf16.log").is_file()
    gone = LlamaServerPeer("x", binary, ggufs[0].with_name("gone.gguf"), threads=1, comparable=OTHER_WEIGHTS)
    assert "does not exist" in gone.unavailable()


def test_tau_from_totals_pools_passes() -> None:
    def row(method, n, **kw):
        return RunRow(method, "set", "q", 0, 0.0, 4, n, 0.01, 0.01 + 0.01 * n, **kw)

    base = [row("ar", 10), row("ar", 10)]
    rows = [
        row("ls", 10, steps_total=4, accepted_total=6, block_size=8),
        row("ls", 10, steps_total=6, accepted_total=4, block_size=8),
    ]
    s = summarize(rows, base)
    assert s["tau"] == pytest.approx(1 + 10 / 10) and s["steps"] == 10 and s["block_size"] == 8
    assert s["accepted_histogram"] is None and s["acceptance_per_position"] is None  # not known per step
    assert summarize(base, base)["tau"] == 1.0


def test_bench_lists_llama_server_peers_as_skipped_without_a_binary(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("DFLASHKIT_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("DFLASHKIT_LLAMA_CPP", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    args = argparse.Namespace(llama_server=None, target=None, gguf=None)
    methods = llama_server_methods(args, None, "no drafter", 16, 1, None)
    assert [m.name for m in methods] == ["llama-server-bf16", "llama-server-q", "llama-server-dflash-b16"]
    assert all("get_llama_cpp.sh --build" in m.unavailable() for m in methods)


def test_bench_dflash_peer_is_skipped_without_a_drafter_whatever_else_runs(binary, ggufs, monkeypatch) -> None:
    """--drafter none must leave llama-server's DFlash skipped even when other peers are built first
    (a shared variable once let it run as plain decoding under the DFlash name)."""
    import dflashkit.bench.assets as assets
    import dflashkit.interop.llama_server as ls
    from dflashkit.bench.command import bench_parser, build_methods, settings_from

    monkeypatch.setattr(ls, "find_llama_server", lambda explicit=None: binary)
    monkeypatch.setattr(assets, "target_bf16_gguf", lambda target, llama_cpp=None: (ggufs[0], ""))
    monkeypatch.setattr(assets, "target_gguf", lambda target: (ggufs[0], ""))
    args = bench_parser().parse_args(["--drafter", "none", "--methods", "ar,llama.cpp,llama-server"])

    class Session:  # what build_methods reads of the target session
        model = None

        class adapter:
            vocab_size = 100

    methods, _ = build_methods(Session(), settings_from(args), args, "t", 1)
    reasons = {m.name: m.unavailable() for m in methods}
    assert reasons["llama-server-bf16"] is None
    assert "disabled" in reasons["llama-server-dflash-b16"]
