"""An operator's check of `dflashkit serve`: many clients at once, a refused 20 MB body, and a SIGTERM mid-traffic.

Starts `dflashkit serve` (the embedded target and its drafter, or `--target` / `--drafter`) on a free loopback port
and, from client threads in this process:

1. **Load**: `--clients` requests at once (chat, half of them streamed; greedy ones and seeded sampled ones), with
   `--max-queue` places, then `--extra` more while those run. Every request must be answered: 200, or 429 with
   `Retry-After`; a client that got no answer is *lost*. Each 200's text must equal what the same request gets when
   sent alone afterwards (*mixed* otherwise), and a streamed answer must equal the non-streamed one.
2. **Bounded work**: one client sends a 20 MB body while `/health` is polled; prints the polls' median and largest
   latency and the status the large request got (413 expected).
3. **Drain**: `--in-flight` streamed and non-streamed requests, then SIGTERM: prints what each got (finished, 503,
   cut off) and the process's exit status and summary line.

    python scripts/serve_check.py [--clients 64] [--max-queue 64] [--extra 16] [--in-flight 8] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

TOPICS = ["the sea", "a cat", "autumn", "trains", "bread", "the moon", "rain", "chess", "bees", "a lighthouse"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_body(i: int, max_tokens: int, stream: bool) -> dict:
    """Request i: its own prompt; greedy, or every third one sampled with its own seed (both reproducible)."""
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": f"Write two sentences about {TOPICS[i % len(TOPICS)]} (note {i})."}],
        "max_tokens": max_tokens,
        "stream": stream,
        "temperature": 0,  # greedy (the OpenAI APIs' default temperature is 1)
    }
    if i % 3 == 2:
        body.update(temperature=0.8, seed=i)
    return body


def send(url: str, body: dict, timeout: float = 600) -> tuple[int, str, dict]:
    """(status, text, headers); a stream's text is its deltas joined, and it must end with [DONE]."""
    with httpx.Client(timeout=timeout) as client:
        if not body.get("stream"):
            r = client.post(url + "/v1/chat/completions", json=body)
            text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
            return r.status_code, text, dict(r.headers)
        with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, r.text, dict(r.headers)
            parts, done, error = [], False, None
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                    continue
                parts.extend(c["delta"].get("content") or "" for c in event["choices"])
            if error is not None:
                return -1, json.dumps(error), {"done": str(done)}
            if not done:
                return -2, "".join(parts), {}
            return 200, "".join(parts), {}


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dflashkit", "serve", "--port", str(port), "--max-queue", str(args.max_queue)]
    cmd += ["--max-batch", str(args.max_batch), "--threads", str(args.threads), "--log-level", "warning"]
    cmd += [*(["--target", args.target] if args.target else []), *(["--drafter", args.drafter] if args.drafter else [])]
    cmd += shlex.split(args.serve_args)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    sys.exit("the server did not start")


def load(url: str, args: argparse.Namespace) -> None:
    n = args.clients + args.extra
    bodies = [request_body(i, args.max_tokens, stream=i % 2 == 0) for i in range(n)]
    results: list[tuple[int, str, dict] | None] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = send(url, bodies[i])
        except Exception as e:  # noqa: BLE001  (a lost request, counted)
            results[i] = (0, repr(e), {})

    t0 = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        for i in range(args.clients):
            pool.submit(run, i)
        time.sleep(1.0)  # the first wave is queued or running: the extra ones find the queue full
        for i in range(args.clients, n):
            pool.submit(run, i)
    wall = time.monotonic() - t0
    answered = [i for i in range(n) if results[i] and results[i][0] == 200]
    shed = [i for i in range(n) if results[i] and results[i][0] == 429]
    shed_ok = sum("retry-after" in {k.lower() for k in results[i][2]} for i in shed)
    lost = [i for i in range(n) if i not in answered and i not in shed]
    mixed, stream_differs, parted = 0, 0, []
    for i in answered:  # alone, one at a time: the same text; the other form (streamed or not) too
        alone = send(url, bodies[i])
        other = send(url, {**bodies[i], "stream": not bodies[i]["stream"]})
        mixed += alone[1] != results[i][1]
        stream_differs += other[1] != results[i][1]
        if alone[1] != results[i][1]:
            parted.append((i, alone[1], results[i][1]))
    print(
        f"load: {n} requests ({args.clients} at once, then {args.extra} more) in {wall:.1f} s: "
        f"{len(answered)} answered 200, {len(shed)} shed 429 ({shed_ok} with Retry-After), {len(lost)} lost; "
        f"{mixed} mixed (text other than "
        f"the same request alone), {stream_differs} where streamed != non-streamed"
    )
    for i in lost[:5]:
        print(f"  lost #{i}: {results[i]}")
    for i, alone, concurrent in parted:  # where they part, and the top two log-probabilities there (alone)
        print(f"  #{i} parts from its run alone: {tie_margin(url, request_body(i, args.max_tokens, False), alone)}")
        print(f"    alone:      {alone!r}\n    concurrent: {concurrent!r}")


def tie_margin(url: str, body: dict, alone: str) -> str:
    """The log-probability margin between the two likeliest tokens at each position of the run alone, smallest
    first: a bf16 verify and a one-token step may pick either of two tokens whose logits are that close."""
    r = httpx.post(url + "/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 2}, timeout=600)
    content = r.json()["choices"][0]["logprobs"]["content"]
    margins = sorted(
        (c["top_logprobs"][0]["logprob"] - c["top_logprobs"][1]["logprob"], k)
        for k, c in enumerate(content)
        if len(c["top_logprobs"]) > 1
    )
    return "smallest top-2 margins (nats, at token k): " + ", ".join(f"{m:.3f}@{k}" for m, k in margins[:3])


def bounded(url: str) -> None:
    status: list[int] = []

    def big() -> None:
        body = b'{"model": "smollm2-135m-instruct", "prompt": "' + b"x" * (20 * 2**20) + b'"}'
        try:
            r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
            status.append(r.status_code)
        except httpx.TransportError as e:
            status.append(0)
            print(f"  20 MB request: {e!r}")

    thread = threading.Thread(target=big)
    thread.start()
    times = []
    with httpx.Client() as client:
        for _ in range(20):
            t = time.perf_counter()
            client.get(url + "/health")
            times.append((time.perf_counter() - t) * 1000)
            time.sleep(0.05)
    thread.join()
    print(
        f"bounded: 20 MB body answered {status[0]}; /health over 20 polls meanwhile: median "
        f"{statistics.median(times):.1f} ms, max {max(times):.1f} ms"
    )


def drain(url: str, proc: subprocess.Popen, args: argparse.Namespace) -> None:
    n = args.in_flight
    bodies = [request_body(i, 4 * args.max_tokens, stream=i % 2 == 0) for i in range(n)]
    results: list[tuple[int, str, dict] | None] = [None] * n
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(send, url, b) for b in bodies]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until every request is running or queued
            health = httpx.get(url + "/health").json()
            if health["running"] + health["queued"] >= n:
                break
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for i, f in enumerate(futures):
            try:
                results[i] = f.result(timeout=120)
            except Exception as e:  # noqa: BLE001
                results[i] = (0, repr(e), {})
        answered_s = time.monotonic() - t0
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    exit_s = time.monotonic() - t0
    kinds = {"finished": 0, "503": 0, "cut off cleanly": 0, "other": 0}
    for r in results:
        code = r[0] if r else 0
        kind = {200: "finished", 503: "503", -1: "cut off cleanly"}.get(code, "other")
        kinds[kind] += 1
    summary = next((line for line in err.splitlines() if line.startswith("Drained")), "(no summary line)")
    print(
        f"drain: SIGTERM with {n} in flight (--max-batch {args.max_batch}): {kinds}; every client answered "
        f"{answered_s:.1f} s after the signal; exit status {proc.returncode} after {exit_s:.1f} s; {summary!r}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64, help="requests sent at once (default: %(default)s)")
    ap.add_argument("--extra", type=int, default=16, help="more sent while they run (default: %(default)s)")
    ap.add_argument("--max-queue", type=int, default=64, help="the server's --max-queue (default: %(default)s)")
    ap.add_argument("--max-batch", type=int, default=4, help="the server's --max-batch (default: %(default)s)")
    ap.add_argument("--in-flight", type=int, default=8, help="requests running or queued at SIGTERM (default: 8)")
    ap.add_argument("--max-tokens", type=int, default=48, help="per request (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="the server's --threads (default: %(default)s)")
    ap.add_argument("--target", default=None, help="the server's --target (default: the embedded one)")
    ap.add_argument("--drafter", default=None, help="the server's --drafter (default: the shipped one)")
    ap.add_argument(
        "--serve-args", default="", help="more `dflashkit serve` options, e.g. '--prefix-cache-mb 0' (default: none)"
    )
    args = ap.parse_args()
    port = free_port()
    proc = start_server(args, port)
    url = f"http://127.0.0.1:{port}"
    try:
        load(url, args)
        bounded(url)
        drain(url, proc, args)
    finally:
        if proc.poll() is None:
            proc.kill()


if __name__ == "__main__":
    main()
