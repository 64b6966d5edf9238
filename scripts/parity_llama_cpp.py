"""τ parity: llama.cpp's DFlash with an exported drafter against dflashkit's own loop, on the same prompts.

Starts llama-server on loopback with the target and drafter GGUFs (`--spec-type draft-dflash`, see
dflashkit.interop.llama_server), sends each evaluation prompt greedily as the token ids dflashkit decodes (its chat
template) and reads the server's own timings: τ = predicted tokens / target passes. Then decodes the same prompts with
dflashkit (the drafter's block size, bf16) and prints both τ and their ratio; the parity bar is 10%. Texts may part
where the two engines round a bf16 tie differently, so τ is compared, not texts. Needs a llama-server build
(`bash scripts/get_llama_cpp.sh --build`) and the GGUFs of `dflashkit export`:

    dflashkit export DRAFTER --format gguf --target-gguf --out OUT
    python scripts/parity_llama_cpp.py --drafter DRAFTER --gguf-dir OUT [--per-set 4] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def llama_cpp_tau(server: Path, gguf_dir: Path, prompts: list[list[int]], max_tokens: int, threads: int, block: int):
    from dflashkit.interop.export import DRAFTER_GGUF, TARGET_GGUF
    from dflashkit.interop.llama_server import LlamaServer

    with LlamaServer(server, gguf_dir / TARGET_GGUF, drafter=gguf_dir / DRAFTER_GGUF, block_size=block,
                     threads=threads, log_path=gguf_dir / "llama-server.log") as llama:  # fmt: skip
        completions = [llama.complete(ids, max_tokens) for ids in prompts]
    predicted = sum(c.predicted_n for c in completions)
    return predicted / max(1, sum(c.target_passes for c in completions)), predicted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument(
        "--gguf-dir", required=True, type=Path, help="output folder of `dflashkit export --format gguf --target-gguf`"
    )
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: as `dflashkit bench` finds it)")
    ap.add_argument("--per-set", type=int, default=4, help="prompts per evaluation set (seeded subset)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from dflashkit.generator import SpeculativeGenerator
    from dflashkit.interop.llama_server import find_llama_server
    from dflashkit.text import encode_chat
    from dflashkit.training.evalsets import load_set

    server = find_llama_server(args.llama_server)
    if server is None:
        raise SystemExit("no llama-server: run `bash scripts/get_llama_cpp.sh --build` or pass --llama-server PATH")
    texts = [p for name in ("mt-bench", "humaneval", "math500") for p in load_set(name, limit=args.per_set)]
    torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load(drafter=args.drafter)
    block = gen.drafter.block_size
    prompts = [encode_chat(gen.tokenizer, t) for t in texts]
    tau_llama, tokens_llama = llama_cpp_tau(server, args.gguf_dir, prompts, args.max_tokens, args.threads, block)
    tokens = steps = accepted = 0
    for ids in prompts:
        stats = gen.generate(ids, max_new_tokens=args.max_tokens, block_size=block).stats
        tokens, steps, accepted = tokens + stats.new_tokens, steps + stats.steps, accepted + sum(stats.accepted_lengths)
    tau_ours = 1 + accepted / max(1, steps)
    print(f"{len(prompts)} prompts, greedy, block {block}, ≤{args.max_tokens} tokens each")
    print(f"llama.cpp DFlash: τ {tau_llama:.3f} over {tokens_llama} tokens")
    print(f"dflashkit:        τ {tau_ours:.3f} over {tokens} tokens")
    print(f"ratio llama.cpp / dflashkit: {tau_llama / tau_ours:.3f} (parity bar: within 10%)")


if __name__ == "__main__":
    main()
