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


def run_clients(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """Every prompt from ``concurrency`` threads: {"wall", "tokens", "latencies"} as described above."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

    def ask(ids: list[int]) -> tuple[int, float]:
        start = time.perf_counter()
        r = httpx.post(
            url + "/v1/completions",
            timeout=900,
            json={"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0},
        )
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(ask, prompts))
    wall = time.perf_counter() - start
    return {"wall": wall, "tokens": sum(n for n, _ in answers), "latencies": [t for _, t in answers]}


def main() -> None:
    job = json.loads(sys.stdin.read())
    print(json.dumps(run_clients(job["url"], job["prompts"], job["concurrency"], job["max_tokens"])))


if __name__ == "__main__":
    main()
