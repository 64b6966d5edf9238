"""The request guards (dflashkit.server.guards), the HTTP protocol `dflashkit serve` runs (dflashkit.server.http) and
the prompt's cheap length bound: what each refuses, in which shape, and before reading what."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import statistics
import threading
import time

import httpx
import pytest

from dflashkit.errors import InvalidInputError
from dflashkit.server import ServerSettings, create_app
from dflashkit.server.guards import HostGuard, KeyGuard, key_id
from dflashkit.server.http import uvicorn_options
from tests.live_server import LiveServer, tiny_generator

MODEL = "tiny-llama"
JSON = {"Content-Type": "application/json"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2, "temperature": 0}


def serve(**fields) -> LiveServer:
    """A live server of the tiny generator with these settings, run with the protocol `dflashkit serve` runs."""
    settings = ServerSettings(model_id=MODEL, **fields)
    return LiveServer(create_app(tiny_generator(), settings), **uvicorn_options(settings))


def port(live: LiveServer) -> int:
    return int(live.url.rsplit(":", 1)[1])


def exchange(live: LiveServer, data: bytes, wait: float = 10.0) -> tuple[int, dict, bytes, float]:
    """Send `data` on a new connection and read until the server closes it: (status, headers, body, seconds from
    sending to the close)."""
    with socket.create_connection(("127.0.0.1", port(live))) as sock:
        sock.settimeout(wait)
        start = time.monotonic()
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        elapsed = time.monotonic() - start
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), headers, body, elapsed


def head(path: str, *lines: str) -> bytes:
    return "\r\n".join([f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *lines, "", ""]).encode()


# ---- body limit -------------------------------------------------------------------------------------------------


def test_a_body_too_large_by_its_length_is_refused_before_it_is_sent_and_before_the_key() -> None:
    """Content-Length past --max-body-bytes: 413 on the headers alone (nothing of the body sent), before the API
    key is checked, and the connection closed; in Anthropic's shape on /v1/messages."""
    with serve(max_body_bytes=1000, api_key="sekret") as live:
        status, headers, body, _ = exchange(live, head("/v1/chat/completions", "Content-Length: 5000"))
        assert status == 413 and headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert error["code"] == "request_too_large" and "--max-body-bytes" in error["message"]
        status, _, body, _ = exchange(live, head("/v1/messages", "Content-Length: 5000", "x-api-key: sekret"))
        assert status == 413 and json.loads(body)["error"]["type"] == "request_too_large"
        # at the limit: read, then the key is checked
        r = httpx.post(live.url + "/v1/chat/completions", content=b"x" * 1000, timeout=30)
        assert r.status_code == 401


def test_a_chunked_body_is_counted_as_it_arrives() -> None:
    """A body sent in chunks (no Content-Length) is refused 413 once it passes the limit; the client, still
    sending, reads the answer (the server reads and drops the rest before closing) rather than a reset."""

    def chunks():
        for _ in range(40):
            yield b"x" * 100_000

    with serve(max_body_bytes=250_000) as live:
        r = httpx.post(live.url + "/v1/chat/completions", content=chunks(), timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = httpx.post(live.url + "/v1/messages", content=chunks(), timeout=30)
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        r = httpx.post(
            live.url + "/v1/chat/completions", content=iter([json.dumps(CHAT).encode()]), headers=JSON, timeout=60
        )
        assert r.status_code == 200, r.text  # under the limit, chunked: served


def test_a_body_that_does_not_arrive_in_time_is_answered_408() -> None:
    with serve(body_timeout=0.5) as live:
        status, headers, body, elapsed = exchange(live, head("/v1/chat/completions", "Content-Length: 100") + b'{"m')
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_timeout" and 0.4 < elapsed < 5
        status, _, body, _ = exchange(live, head("/v1/messages", "Content-Length: 100") + b'{"m')
        assert status == 408 and json.loads(body)["error"]["type"] == "timeout_error"


# ---- API keys ---------------------------------------------------------------------------------------------------


def test_the_key_is_checked_from_the_headers_before_the_body() -> None:
    """Without the key: 401 on the headers alone (the server does not wait for the body it announced), and for
    malformed JSON (401, not 400). Each of several keys is accepted, in either header; /v1/*, /docs, /redoc and
    /openapi.json need one, /health, /metrics and / do not."""
    with serve(api_key=["key-one", "key-two"]) as live:
        status, headers, body, elapsed = exchange(
            live, head("/v1/chat/completions", "Content-Length: 100", "Content-Type: application/json")
        )
        assert status == 401 and headers["connection"] == "close" and elapsed < 5
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        r = httpx.post(live.url + "/v1/chat/completions", content=b"{not json", timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(live.url + "/v1/messages", content=b"{not json", timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        for key in ("key-one", "key-two"):
            assert httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            assert httpx.get(live.url + "/v1/models", headers={"x-api-key": key}).status_code == 200
            r = httpx.post(
                live.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"}, timeout=60
            )
            assert r.status_code == 200, r.text
        assert httpx.get(live.url + "/v1/models", headers={"Authorization": "Bearer key-three"}).status_code == 401
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(live.url + path).status_code == 401, path
            assert httpx.get(live.url + path, headers={"x-api-key": "key-two"}).status_code == 200, path
        for path in ("/health", "/metrics", "/"):
            assert httpx.get(live.url + path).status_code == 200, path


def _state_after(guard_cls, scope_headers: dict[str, str], path: str = "/health", **kwargs) -> tuple[int, dict]:
    """Run `guard_cls` over a dummy app with a request of these headers: (status sent, the state the app saw)."""
    seen: dict = {}
    sent: list[dict] = []

    async def app(scope, receive, send) -> None:
        seen.update(scope["state"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in scope_headers.items()],
        "state": {},
    }
    asyncio.run(guard_cls(app, **kwargs)(scope, receive, send))
    return sent[0]["status"], seen


def test_the_key_guard_sets_the_tenant_and_whether_the_request_is_authenticated() -> None:
    """scope["state"]: tenant (the key's short sha256 id, never the key) and authenticated, on every request."""
    keys = {"keys": ["key-one", "key-two"]}
    assert _state_after(KeyGuard, {"authorization": "Bearer key-one"}, **keys) == (
        204,
        {"tenant": hashlib.sha256(b"key-one").hexdigest()[:16], "authenticated": True},
    )
    status, state = _state_after(KeyGuard, {"x-api-key": "key-two"}, **keys)
    assert status == 204 and state == {"tenant": key_id("key-two"), "authenticated": True}
    assert key_id("key-two") != key_id("key-one")
    assert "key-two" not in state["tenant"]
    assert _state_after(KeyGuard, {}, **keys) == (204, {"tenant": "", "authenticated": False})  # /health: open
    assert _state_after(KeyGuard, {"x-api-key": "nope"}, **keys) == (204, {"tenant": "", "authenticated": False})
    assert _state_after(KeyGuard, {}, path="/v1/models", **keys)[0] == 401
    assert _state_after(KeyGuard, {}, path="/v1/models") == (204, {"tenant": "", "authenticated": True})  # no keys


def test_api_key_settings_are_checked() -> None:
    assert ServerSettings(api_key="a").api_keys == ["a"] and ServerSettings(api_key=["a", "b"]).api_keys == ["a", "b"]
    for bad in ([], [" a"], ["a", ""]):
        with pytest.raises(InvalidInputError, match="api_key"):
            ServerSettings(api_key=bad)
    for name, value in (("max_body_bytes", 0), ("header_timeout", 0), ("body_timeout", -1), ("allowed_hosts", [])):
        with pytest.raises(InvalidInputError, match=name):
            ServerSettings(**{name: value})


# ---- Host and Origin --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "allowed,host,ok",
    [
        (None, "127.0.0.1:8000", True),
        (None, "localhost", True),
        (None, "[::1]:8000", True),
        (None, "LocalHost.:80", True),
        (None, "evil.example:8000", False),  # a DNS-rebinding page's own name
        (None, "127.0.0.1.evil.example", False),
        (None, "", False),
        (["api.example"], "api.example:8443", True),
        (["api.example"], "127.0.0.1:8000", False),
        (["*.example"], "api.example", True),
        (["*.example"], "example", False),
        (["*"], "anything.example", True),
    ],
)
def test_the_host_header_must_name_an_allowed_host(allowed, host, ok) -> None:
    status, _ = _state_after(HostGuard, {"host": host} if host else {}, allowed_hosts=allowed)
    assert status == (204 if ok else 400)


@pytest.mark.parametrize(
    "origin,allowed_origins,ok",
    [
        ("http://127.0.0.1:8000", [], True),  # the server's own page (same origin)
        ("http://127.0.0.1:8001", [], False),
        ("http://localhost:8000", [], False),  # another origin, though the same machine
        ("http://evil.example", [], False),
        ("null", [], False),
        ("http://ui.example", ["http://ui.example"], True),
        ("http://ui.example", ["*"], True),
    ],
)
def test_a_browser_origin_must_be_the_server_s_own_or_allowed(origin, allowed_origins, ok) -> None:
    status, _ = _state_after(HostGuard, {"host": "127.0.0.1:8000", "origin": origin}, allowed_origins=allowed_origins)
    assert status == (204 if ok else 403)


def test_host_and_origin_refusals_on_a_live_server() -> None:
    """A foreign Host: 400 host_not_allowed naming --allowed-hosts; a foreign Origin: 403; the server's own page,
    an allowed origin and its preflight: served."""
    with serve(allowed_origins=["http://ui.example"]) as live:
        r = httpx.get(live.url + "/health", headers={"Host": "evil.example"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
        assert "--allowed-hosts" in r.json()["error"]["message"]
        r = httpx.post(live.url + "/v1/chat/completions", json=CHAT, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        r = httpx.post(live.url + "/v1/messages", json=CHAT, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert httpx.get(live.url + "/health", headers={"Origin": live.url}).status_code == 200
        r = httpx.get(live.url + "/v1/models", headers={"Origin": "http://ui.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
        preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
        assert httpx.options(live.url + "/v1/chat/completions", headers=preflight).status_code == 200


# ---- the request head: size and time ----------------------------------------------------------------------------


def test_an_oversized_request_head_is_answered_431() -> None:
    """An 8 MB header: 431 (not a reset): the server reads and drops the rest of it before closing."""
    with serve() as live:
        big = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 8_000_000 + b"\r\n\r\n"
        status, headers, body, _ = exchange(live, big)
        assert status == 431 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
        assert httpx.get(live.url + "/health", headers={"X-Fine": "a" * 32_000}).status_code == 200


def test_a_head_too_large_is_refused_though_it_arrives_in_one_read() -> None:
    """h11 bounds only an incomplete head; a whole one read at once is bounded too."""
    import h11

    from dflashkit.server.http import _Connection

    for size, refused in ((60_000, False), (70_000, True)):
        conn = _Connection(64 * 2**10)
        conn.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
        if refused:
            with pytest.raises(h11.RemoteProtocolError):
                conn.next_event()
            assert conn.error_status == 431
        else:
            assert isinstance(conn.next_event(), h11.Request)


def test_a_slow_request_head_is_answered_408() -> None:
    """A head still incomplete after --header-timeout is answered 408 and closed, though bytes keep coming (the
    time counts from its first byte); a connection that sends nothing is closed then too."""
    with serve(header_timeout=0.5) as live:
        status, _, body, elapsed = exchange(live, b"GET /health HTTP/1.1\r\nHost: 127")
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout" and 0.4 < elapsed < 5

        with socket.create_connection(("127.0.0.1", port(live))) as sock:
            sock.settimeout(10)
            start = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            stop = threading.Event()
            dripping = threading.Thread(target=_drip, args=(sock, stop), daemon=True)
            dripping.start()
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            stop.set()
            dripping.join(5)
            assert answer.startswith(b"HTTP/1.1 408") and 0.4 < time.monotonic() - start < 3

        with socket.create_connection(("127.0.0.1", port(live))) as sock:
            sock.settimeout(10)
            start = time.monotonic()
            assert sock.recv(1) == b"" and 0.4 < time.monotonic() - start < 5  # closed, nothing said


def _drip(sock: socket.socket, stop: threading.Event, data: bytes = b"a", every: float = 0.05) -> None:
    """Send `data` on `sock` every `every` seconds until `stop` is set or the connection fails."""
    while not stop.wait(every):
        try:
            sock.send(data)
        except OSError:
            return


# ---- /health while one client sends too much and others too slowly ---------------------------------------------


def test_health_stays_fast_while_a_20_mb_body_is_refused_and_slow_clients_trickle() -> None:
    """The operator's view: one client sends a 20 MB body (a MB at a time; refused 413 from its length, the rest
    read and dropped) while 20 clients trickle request heads a byte at a time; /health, polled meanwhile, answers
    each of 20 polls in under 100 ms."""
    with serve() as live:
        stop, sending = threading.Event(), threading.Event()
        outcome: dict = {}

        def big() -> None:
            body = b'{"model": "tiny-llama", "prompt": "' + b"w5 " * 7_000_000 + b'"}'
            with socket.create_connection(("127.0.0.1", port(live))) as sock:
                sock.settimeout(30)
                sock.sendall(head("/v1/completions", f"Content-Length: {len(body)}"))
                sending.set()
                for i in range(0, len(body), 2**20):
                    sock.sendall(body[i : i + 2**20])
                    time.sleep(0.02)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
                outcome["answer"] = answer

        def trickle() -> None:
            with socket.create_connection(("127.0.0.1", port(live))) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                _drip(sock, stop)

        threads = [threading.Thread(target=trickle, daemon=True) for _ in range(20)]
        threads.append(threading.Thread(target=big, daemon=True))
        for t in threads:
            t.start()
        assert sending.wait(30)
        latencies = []
        with httpx.Client(base_url=live.url, timeout=10) as client:
            for _ in range(20):
                start = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.02)
        stop.set()
        threads[-1].join(30)
        assert outcome["answer"].startswith(b"HTTP/1.1 413")
        print(
            f"/health while a 20 MB body is refused: max {max(latencies) * 1000:.1f} ms, median "
            f"{statistics.median(latencies) * 1000:.1f} ms ({len(latencies)} polls)"
        )
        assert max(latencies) < 0.1, latencies


# ---- the prompt's cheap bound, tokenisation off the event loop --------------------------------------------------


def test_a_prompt_too_long_for_any_tokenisation_is_refused_without_tokenising() -> None:
    """More characters (whitespace aside) than the context's tokens times the longest token's characters: 400
    context_length_exceeded before the tokenizer sees it. Whitespace alone does not count (this tokenizer drops
    it): such a prompt is tokenised and served."""
    gen = tiny_generator()
    app = create_app(gen, model_id=MODEL)
    encode = gen.encode_prompt
    calls: list[int] = []

    def counting(prompt, *args, **kwargs):
        calls.append(1)
        return encode(prompt, *args, **kwargs)

    gen.encode_prompt = counting
    longest = max(map(len, gen.tokenizer.get_vocab()))
    too_long = "w5" * (gen.target.max_positions * longest // 2 + 1)
    with LiveServer(app) as live:
        for path, body in (
            ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": too_long}]}),
            ("/v1/completions", {"model": MODEL, "prompt": too_long, "max_tokens": 2}),
        ):
            r = httpx.post(live.url + path, json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert r.json()["error"]["param"] == ("messages" if "chat" in path else "prompt")
        r = httpx.post(
            live.url + "/v1/messages/count_tokens",
            json={"model": MODEL, "messages": [{"role": "user", "content": too_long}]},
            timeout=60,
        )
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
        assert calls == []
        spaced = "w5" + " " * (gen.target.max_positions * longest) + "w6"
        r = httpx.post(
            live.url + "/v1/chat/completions",
            json={**CHAT, "messages": [{"role": "user", "content": spaced}]},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert calls == [1]


def test_tokenisation_runs_off_the_event_loop() -> None:
    """While one request's prompt is being tokenised (held here), /health answers."""
    gen = tiny_generator()
    app = create_app(gen, model_id=MODEL)
    encode = gen.encode_prompt
    entered, release = threading.Event(), threading.Event()

    def held(prompt, *args, **kwargs):
        entered.set()
        assert release.wait(30)
        return encode(prompt, *args, **kwargs)

    gen.encode_prompt = held
    with LiveServer(app) as live:
        for path, body in (
            ("/v1/chat/completions", CHAT),
            ("/v1/messages/count_tokens", {"model": MODEL, "messages": CHAT["messages"]}),
        ):
            entered.clear()
            release.clear()
            result: dict = {}
            t = threading.Thread(
                target=lambda: result.update(r=httpx.post(live.url + path, json=body, timeout=60)), daemon=True
            )
            t.start()
            assert entered.wait(30)
            assert httpx.get(live.url + "/health", timeout=5).status_code == 200  # the loop is free
            release.set()
            t.join(60)
            assert result["r"].status_code == 200, result["r"].text
