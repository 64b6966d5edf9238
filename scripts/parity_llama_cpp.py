"""τ parity: llama.cpp's DFlash with an exported drafter against dflashkit's own loop, on the same prompts.

    dflashkit export DRAFTER --format gguf --target-gguf --out OUT          # after scripts/get_llama_cpp.sh --build
    .venv/bin/python scripts/parity_llama_cpp.py --drafter DRAFTER --gguf-dir OUT [--per-set 4] [--max-tokens 96]

Starts `llama-server` on loopback with the target and drafter GGUFs (`--spec-type draft-dflash`), sends each
evaluation prompt greedily through its chat API and reads its own `timings` (predicted_n, draft_n_accepted):
τ = tokens / target passes = predicted / (predicted - accepted). Then decodes the same prompts with dflashkit
(block 16, bf16) and prints both τ and their ratio. Texts may part where the two engines' kernels round
differently (a bf16 tie), so the comparison is of τ, not of texts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

from dflashkit.evalsets import load_set
from dflashkit.export import DRAFTER_GGUF, TARGET_GGUF
from dflashkit.generator import SpeculativeGenerator
from dflashkit.models import cache_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_cpp_tau(server: Path, gguf_dir: Path, prompts: list[str], max_tokens: int, threads: int, block: int):
    port = free_port()
    log = open(gguf_dir / "llama-server.log", "w")
    proc = subprocess.Popen(
        [str(server), "-m", str(gguf_dir / TARGET_GGUF), "-md", str(gguf_dir / DRAFTER_GGUF), "--spec-type",
         "draft-dflash", "--spec-draft-n-max", str(block - 1), "-fa", "on", "--jinja", "-t", str(threads),
         "--host", "127.0.0.1", "--port", str(port), "-c", "4096", "-np", "1"],
        stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"llama-server did not start; see {gguf_dir / 'llama-server.log'}")
                time.sleep(1)
        predicted = accepted = 0
        for p in prompts:
            body = json.dumps({"messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                               "temperature": 0}).encode()
            request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            timings = json.load(urllib.request.urlopen(request))["timings"]
            predicted += timings["predicted_n"]
            accepted += timings.get("draft_n_accepted", 0)
        return predicted / max(1, predicted - accepted), predicted
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--gguf-dir", required=True, type=Path, help="output folder of `dflashkit export --format gguf --target-gguf`")
    ap.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("DFLASHKIT_LLAMA_CPP", cache_dir() / "llama.cpp")))
    ap.add_argument("--per-set", type=int, default=4, help="prompts per evaluation set (seeded subset)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    server = args.llama_cpp / "build" / "bin" / "llama-server"
    if not server.is_file():
        raise SystemExit(f"no llama-server at {server}: run `bash scripts/get_llama_cpp.sh --build`")
    prompts = [p for name in ("mt-bench", "humaneval", "math500") for p in load_set(name, limit=args.per_set)]
    torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load(drafter=args.drafter)
    block = gen.drafter.block_size
    tau_llama, tokens_llama = llama_cpp_tau(server, args.gguf_dir, prompts, args.max_tokens, args.threads, block)
    tokens = steps = accepted = 0
    for p in prompts:
        stats = gen.generate(p, max_new_tokens=args.max_tokens, block_size=block).stats
        tokens, steps, accepted = tokens + stats.new_tokens, steps + stats.steps, accepted + sum(stats.accepted_lengths)
    tau_ours = 1 + accepted / max(1, steps)
    print(f"{len(prompts)} prompts, greedy, block {block}, ≤{args.max_tokens} tokens each")
    print(f"llama.cpp DFlash: τ {tau_llama:.3f} over {tokens_llama} tokens")
    print(f"dflashkit:        τ {tau_ours:.3f} over {tokens} tokens")
    print(f"ratio llama.cpp / dflashkit: {tau_llama / tau_ours:.3f} (parity bar: within 10%)")


if __name__ == "__main__":
    main()
