"""Where the time of static-batch answer generation goes (the path `dflashkit data` takes on a GPU).

    python scripts/batch_data_profile.py --device cuda [--prompts 2048] [--batch-size 1024] [--max-new-tokens 192]
        [--jsonl PROMPTS.jsonl] [--sources sharegpt-turns:0.5,code:0.3,math:0.2] [--profile-steps 8]

On a lent GPU, session 28's `dflashkit data --device cuda --batch-size 1024` wrote ~8.2K response tokens/s: about
100 ms per decode step for a 135M-parameter target, far above what its arithmetic costs there. This script times
`batchgen.generate_batch` on the same kind of prompts (real prompts, chat template, up to 512 tokens) two ways, in
one process, the order alternating per round: batches in the prompts' own order (as `data` fills a shard of one
batch) and batches of prompts sorted by length (less padding). Then it profiles a few decode steps of one batch
with torch.profiler and prints the top operations by self time (device time on a GPU), and the prefill's share.
Prints what it measured; runs on a CPU too (small sizes) to check itself.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflashkit import data
from dflashkit.batchgen import generate_batch
from dflashkit.models import load_target
from dflashkit.text import encode_chat, eos_token_ids


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(model, batches: list[list[list[int]]], args, eos: list[int], pad: int) -> tuple[float, int]:
    """Seconds and response tokens of generating every batch."""
    device = next(model.parameters()).device
    sync(device)
    start, tokens = time.perf_counter(), 0
    for batch in batches:
        out = generate_batch(model, batch, max_new_tokens=args.max_new_tokens, eos_ids=eos, pad_id=pad)
        tokens += sum(len(o) for o in out)
    sync(device)
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--jsonl", default=None, help="prompts from this file (default: --sources)")
    ap.add_argument("--sources", default="sharegpt-turns:0.5,sharegpt:0.2,math:0.3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=8, help="decode steps of one batch under torch.profiler")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_target(device=args.device)
    device = next(model.parameters()).device
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    prompts = (list(data.jsonl_prompts(args.jsonl)) if args.jsonl
               else data.collect_prompts(args.sources, n=args.prompts, seed=5).prompts)[: args.prompts]
    encoded = [ids for ids in (encode_chat(tokenizer, p) for p in prompts) if len(ids) <= args.max_prompt_tokens]
    lengths = sorted(len(ids) for ids in encoded)
    print(f"{device}: {len(encoded)} prompts of {lengths[0]}-{lengths[-1]} tokens (median {statistics.median(lengths)})"
          f", batches of {args.batch_size}, at most {args.max_new_tokens} new tokens")
    def batches(ids: list[list[int]]) -> list[list[list[int]]]:
        return [ids[i : i + args.batch_size] for i in range(0, len(ids), args.batch_size)]

    ways = {"as given": batches(encoded), "sorted by length": batches(sorted(encoded, key=len))}
    for batches in ways.values():  # warm-up: kernels, allocator, one small batch
        generate_batch(model, batches[0][:8], max_new_tokens=4, eos_ids=eos, pad_id=pad)
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            seconds, tokens = timed(model, ways[name], args, eos, pad)
            rates[name].append(tokens / seconds)
            padding = sum(len(b) * max(map(len, b)) - sum(map(len, b)) for b in ways[name])
            print(f"round {r}: {name:17s} {tokens} response tokens in {seconds:6.1f} s = {tokens / seconds:8.0f} tok/s "
                  f"(prompt padding {padding} tokens)")
    for name, values in rates.items():
        print(f"median {name:17s} {statistics.median(values):8.0f} tok/s")

    from torch.profiler import ProfilerActivity, profile

    batch = ways["as given"][0]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    generate_batch(model, batch, max_new_tokens=1, eos_ids=[], pad_id=pad)  # prefill + one step
    sync(device)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        generate_batch(model, batch, max_new_tokens=args.profile_steps, eos_ids=[], pad_id=pad)
        sync(device)
    total = time.perf_counter() - t0
    step = (total - prefill) / max(1, args.profile_steps - 1)
    print(f"one batch of {len(batch)}: prefill + 1 token {prefill * 1e3:.0f} ms; then ~{step * 1e3:.1f} ms per decode "
          f"step ({args.profile_steps} steps profiled, profiler overhead included)")
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
