"""Serving under concurrent clients: aggregate throughput and latency of `dflashkit serve` against llama-server.

    .venv/bin/python scripts/serve_concurrency.py [--concurrency 1,2,4] [--prompts 8] [--rounds 2] [--threads 2]
        [--max-batch 4]

Starts, on loopback, the dflashkit server (shipped drafter, the serve command's defaults: adaptive block size,
prompt lookup) with `--max-batch 1` (one generation at a time), the same server with no drafter, both again with
`--max-batch N` (N generations at once, their target passes batched; the serve default is 4), and llama-server on the
bf16 and Q4_1 GGUFs of the target with
as many slots as the largest concurrency (continuous batching: its slots decode together). For each concurrency C,
each round sends the same greedy requests to every server in turn (the order rotates per round): the prompts
(MT-Bench / HumanEval / MATH-500 questions through the chat template, as token ids, so every server gets the same
tokens), `max_tokens` each, from C client threads at once. Prints, per server and C, the completion tokens per
second of wall time over all requests (aggregate throughput) and the median request latency, medians over
rounds. With --max-batch 1 dflashkit decodes one sequence at a time, so its throughput cannot grow with C and its
latency grows with the queue; llama-server batches its slots, as dflashkit does with --max-batch N.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import threading
import time

import torch
import uvicorn
from http_clients import run_clients  # this script's folder is on the path when it runs

from dflashkit import SpeculativeGenerator
from dflashkit.bench.assets import target_bf16_gguf, target_gguf
from dflashkit.decoding.batching import ComputeThread
from dflashkit.interop.llama_server import LlamaServer, find_llama_server, free_port
from dflashkit.server import create_app
from dflashkit.training.evalsets import load_set


class InProcessServer:
    """A dflashkit app served by uvicorn in a thread on a free loopback port; its passes run in ``compute``."""

    def __init__(self, generator: SpeculativeGenerator, compute: ComputeThread, **settings) -> None:
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


CLIENTS = pathlib.Path(__file__).with_name("http_clients.py")


def run_batch(
    url: str, prompts: list[list[int]], concurrency: int, max_tokens: int, clients: str = "process"
) -> tuple[float, int, list[float]]:
    """All prompts from `concurrency` client threads: (wall seconds, completion tokens, latencies). The threads run in
    a process of their own (``clients="process"``, scripts/http_clients.py), or in this one (``"threads"``, where
    they share the interpreter lock with the in-process dflashkit servers)."""
    if clients == "process":
        job = {"url": url, "prompts": prompts, "concurrency": concurrency, "max_tokens": max_tokens}
        done = subprocess.run(
            [sys.executable, str(CLIENTS)], input=json.dumps(job), capture_output=True, text=True, check=True
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
        help="where the client threads run: a process of their own (default) or this one (before session "
        "29: they then share the interpreter lock with the in-process dflashkit servers)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = SpeculativeGenerator.load()
    plain = SpeculativeGenerator.load(drafter=None)
    spec.warmup()  # in this thread, as `dflashkit serve` does before it serves
    plain.warmup()
    compute = ComputeThread()
    done = threading.Event()

    def measure() -> None:
        try:
            run(args, spec, plain, compute)
        finally:
            done.set()
            compute.wake()

    thread = threading.Thread(target=measure, name="measure")
    thread.start()
    compute.serve(until=done.is_set)
    thread.join()


def run(
    args: argparse.Namespace, spec: SpeculativeGenerator, plain: SpeculativeGenerator, compute: ComputeThread
) -> None:
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
    binary = find_llama_server()
    for label, (gguf, why) in (("bf16", target_bf16_gguf(None)), ("Q4_1", target_gguf(None))):
        if binary is None or gguf is None:
            print(f"llama-server {label}: skipped ({why or 'no llama-server binary'})")
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
                    f"{statistics.median(t for t, _ in rows):.1f}, {statistics.median(l for _, l in rows):.2f} s"
                )
            print(f"| {name} | " + " | ".join(cells) + " |")
    finally:
        for close in closers:
            close()


if __name__ == "__main__":
    main()
