"""Concurrent completion requests from their own process (used by serve_concurrency.py).

    echo '{"url": ..., "prompts": [[ids], ...], "concurrency": C, "max_tokens": N}' | python scripts/http_clients.py

Sends every prompt (token ids) to URL's /v1/completions, greedy, from C threads at once, and prints one JSON line:
{"wall": seconds from the first request to the last answer, "tokens": completion tokens, "latencies": [...]}.
It runs apart from the servers measured, so that its threads do not share a Python interpreter (and its lock) with
a server that runs in the measuring process; only httpx is imported.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def main() -> None:
    job = json.loads(sys.stdin.read())
    url = job["url"]
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

    def ask(ids: list[int]) -> tuple[int, float]:
        start = time.perf_counter()
        r = httpx.post(url + "/v1/completions", timeout=900,
                       json={"model": model, "prompt": ids, "max_tokens": job["max_tokens"], "temperature": 0})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(job["concurrency"]) as pool:
        answers = list(pool.map(ask, job["prompts"]))
    wall = time.perf_counter() - start
    print(json.dumps({"wall": wall, "tokens": sum(n for n, _ in answers), "latencies": [t for _, t in answers]}))


if __name__ == "__main__":
    main()
