"""Serving under concurrent clients: aggregate throughput and latency of `dflashkit serve` against llama-server.

Starts on loopback the dflashkit server (shipped drafter, the serve defaults: adaptive block size, prompt lookup) and
the same server with no drafter, each with `--max-batch 1` (one generation at a time) and with `--max-batch N` (N
generations whose target passes are batched; the serve default is 4), and, where a llama-server build is found,
llama-server on the target's bf16 and Q4_1 GGUFs with as many slots as the largest concurrency. For each concurrency
C, each round sends the same greedy requests to every server in turn (the order rotates per round): MT-Bench /
HumanEval / MATH-500 questions through the chat template, as token ids so that every server gets the same tokens,
from C client threads at once. The clients run in a process of their own, apart from the in-process servers'
interpreter lock. Prints per server and C the completion tokens per second of wall time (aggregate throughput) and
the median request latency, medians over rounds.

    python scripts/serve_concurrency.py [--concurrency 1,2,4] [--prompts 8] [--rounds 2] [--max-batch 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflashkit import SpeculativeGenerator
    from dflashkit.decoding.batching import ComputeThread


def run_clients(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """Every prompt (token ids) to URL's /v1/completions, greedy, from ``concurrency`` threads at once:
    {"wall": seconds from the first request to the last answer, "tokens": completion tokens, "latencies": [...]}."""
    import httpx

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


class InProcessServer:
    """A dflashkit app served by uvicorn in a thread on a free loopback port; its passes run in ``compute``."""

    def __init__(self, generator: SpeculativeGenerator, compute: ComputeThread, **settings) -> None:
        import uvicorn

        from dflashkit.interop.llama_server import free_port
        from dflashkit.server import create_app

        self.app = create_app(generator, max_queue=64, timeout=None, compute=compute, **settings)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, port=self.port, log_level="warning", log_config=None))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> InProcessServer:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def run_batch(
    url: str, prompts: list[list[int]], concurrency: int, max_tokens: int, clients: str = "process"
) -> tuple[float, int, list[float]]:
    """All prompts from `concurrency` client threads: (wall seconds, completion tokens, latencies). The threads run in
    a process of their own (``clients="process"``: this script with --client-job), or in this one (``"threads"``,
    where they share the interpreter lock with the in-process dflashkit servers)."""
    if clients == "process":
        job = {"url": url, "prompts": prompts, "concurrency": concurrency, "max_tokens": max_tokens}
        done = subprocess.run(
            [sys.executable, __file__, "--client-job"],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            check=True,
        )
        out = json.loads(done.stdout)
    else:
        out = run_clients(url, prompts, concurrency, max_tokens)
    return out["wall"], out["tokens"], out["latencies"]


def main() -> None:
    """The models load and every server's passes run in this (the main) thread, as `dflashkit serve` runs them;
    the servers and their clients run in others."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--prompts", type=int, default=8, help="requests per batch (split over the three sets)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=4, help="the batched dflashkit servers' --max-batch (1: none)")
    ap.add_argument(
        "--clients",
        choices=["process", "threads"],
        default="process",
        help="where the client threads run: a process of their own (default) or this one (where they share the "
        "interpreter lock with the in-process dflashkit servers and slow them down)",
    )
    ap.add_argument("--no-llama-server", action="store_true", help="the dflashkit servers only")
    ap.add_argument("--client-job", action="store_true", help=argparse.SUPPRESS)  # the clients' own process
    args = ap.parse_args()
    if args.client_job:  # a JSON job on stdin, one JSON line of results out
        job = json.loads(sys.stdin.read())
        print(json.dumps(run_clients(job["url"], job["prompts"], job["concurrency"], job["max_tokens"])))
        return
    import torch

    from dflashkit import SpeculativeGenerator
    from dflashkit.decoding.batching import ComputeThread

    torch.set_num_threads(args.threads)
    spec = SpeculativeGenerator.load()
    plain = SpeculativeGenerator.load(drafter=None)
    spec.warmup()  # in this thread, as `dflashkit serve` does before it serves
    plain.warmup()
    compute = ComputeThread()
    done = threading.Event()
    failed: list[BaseException] = []

    def measure() -> None:
        try:
            run(args, spec, plain, compute)
        except BaseException as exc:  # raised again in the main thread, so that the script fails
            failed.append(exc)
        finally:
            done.set()
            compute.wake()

    thread = threading.Thread(target=measure, name="measure")
    thread.start()
    compute.serve(until=done.is_set)
    thread.join()
    if failed:
        raise failed[0]


def run(
    args: argparse.Namespace, spec: SpeculativeGenerator, plain: SpeculativeGenerator, compute: ComputeThread
) -> None:
    from dflashkit.bench.assets import target_bf16_gguf, target_gguf
    from dflashkit.interop.llama_server import LlamaServer, find_llama_server
    from dflashkit.training.evalsets import load_set

    levels = [int(c) for c in args.concurrency.split(",")]
    per_set = -(-args.prompts // 3)
    texts = [t for name in ("mt-bench", "humaneval", "math500") for t in load_set(name, limit=per_set)][: args.prompts]
    prompts = [spec.encode_prompt(t) for t in texts]

    servers: dict[str, str] = {}
    closers = []
    variants = [
        (
            "dflashkit (drafter + lookup, auto block), --max-batch 1",
            spec,
            {"block_size": "auto", "lookup": True, "max_batch": 1},
        ),
        ("dflashkit, no drafter, --max-batch 1", plain, {"max_batch": 1}),
    ]
    if args.max_batch > 1:  # the same generators: one server is asked at a time
        variants += [
            (
                name.replace("--max-batch 1", f"--max-batch {args.max_batch}"),
                gen,
                {**settings, "max_batch": args.max_batch},
            )
            for name, gen, settings in variants
        ]
    for name, gen, settings in variants:
        s = InProcessServer(gen, compute, **settings).start()
        servers[name], closers = s.url, [*closers, s.close]
    binary = None if args.no_llama_server else find_llama_server()
    if binary is None:
        print("llama-server: skipped (" + ("--no-llama-server" if args.no_llama_server else "no binary") + ")")
    for label, find in (("bf16", target_bf16_gguf), ("Q4_1", target_gguf)) if binary is not None else ():
        gguf, why = find(None)
        if gguf is None:
            print(f"llama-server {label}: skipped ({why})")
            continue
        ls = LlamaServer(binary, gguf, threads=args.threads, parallel=max(levels), context=2048).start()
        servers[f"llama-server {label}, {max(levels)} slots"] = ls.url
        closers.append(ls.close)

    try:
        for url in servers.values():  # warm-up
            run_batch(url, prompts[:1], 1, 8, args.clients)
        results: dict[tuple[str, int], list[tuple[float, float]]] = {}
        names = list(servers)
        for c in levels:
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    wall, tokens, latencies = run_batch(servers[name], prompts, c, args.max_tokens, args.clients)
                    results.setdefault((name, c), []).append((tokens / wall, statistics.median(latencies)))
                    print(
                        f"  C={c} round {r} {name}: {tokens / wall:.1f} tok/s, median latency "
                        f"{statistics.median(latencies):.2f} s",
                        flush=True,
                    )
        print(
            f"\n{len(prompts)} greedy requests of at most {args.max_tokens} tokens per batch, {args.rounds} rounds, "
            f"{args.threads} threads per server, clients in "
            f"{'their own process' if args.clients == 'process' else 'this process'}; medians over rounds"
        )
        print("| server | " + " | ".join(f"C={c}: tok/s, latency" for c in levels) + " |")
        print("|---|" + "---:|" * len(levels))
        for name in names:
            cells = []
            for c in levels:
                rows = results[(name, c)]
                cells.append(
                    f"{statistics.median(t for t, _ in rows):.1f}, {statistics.median(lat for _, lat in rows):.2f} s"
                )
            print(f"| {name} | " + " | ".join(cells) + " |")
    finally:
        for close in closers:
            close()


if __name__ == "__main__":
    main()
