"""Where the time of static-batch answer generation goes (the paths `dflashkit data` takes on a GPU), and which
is faster.

    python scripts/batch_data_profile.py --device cuda [--engines static,batches] [--prompts 2048]
        [--batch-size 1024] [--max-new-tokens 192] [--jsonl PROMPTS.jsonl] [--profile-steps 8]
        [--random-weights CONFIG_FOLDER]

On a lent GPU, session 28's `dflashkit data --device cuda --batch-size 1024` (transformers' decoder in static
batches, ``batchgen.generate_batch``) wrote ~8.2K response tokens/s: about 100 ms per decode step for a
135M-parameter target, far above what its arithmetic costs there. ``batchgen.generate_static`` runs the fast forward
in slots of one preallocated batch cache (an ended answer's slot taking the next prompt) with its decode step
replayed from a CUDA graph. This script times each engine on the same real prompts (chat template, up to 512 tokens,
sorted by length as `data` sorts a shard), in one process, the order alternating per round; compares their greedy
answers on the first batch (identical rows, and where the others first part); then profiles a few decode steps of
one batch per engine with torch.profiler (top operations by self time: device time on a GPU) and the prefill's
share. ``--random-weights`` takes a folder with the target's config.json and tokenizer (e.g. from
``save_pretrained``) and times a randomly initialised model of that shape (its answers rarely end early: every step
of every row runs). Prints what it measured; runs on a CPU too (small sizes) to check itself.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflashkit.target.fast import FastTargetForward
from dflashkit.target.loading import load_target
from dflashkit.text import encode_chat, eos_token_ids
from dflashkit.training import sources as data
from dflashkit.training.batchgen import generate_batch, generate_static


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def engine_runner(name: str, model, batch_size: int):
    """(prompts, max_new_tokens, eos, pad) -> answers in the prompts' order, as `data` runs that engine over a shard:
    static batches of `batch_size` one after another, or `batch_size` slots refilled as answers end."""
    if name == "batches":

        def run(prompts, n, eos, pad):
            return [
                a
                for i in range(0, len(prompts), batch_size)
                for a in generate_batch(model, prompts[i : i + batch_size], max_new_tokens=n, eos_ids=eos, pad_id=pad)
            ]

        return run
    if name == "static":
        forward = FastTargetForward(model)

        def run(prompts, n, eos, pad):
            got = dict(generate_static(forward, prompts, slots=batch_size, max_new_tokens=n, eos_ids=eos))
            return [got[i] for i in range(len(prompts))]

        return run
    raise SystemExit(f"unknown engine {name!r} (static, batches)")


def timed(run, prompts: list[list[int]], args, eos: list[int], pad: int, device) -> tuple[float, int]:
    """Seconds and response tokens of answering every prompt."""
    sync(device)
    start = time.perf_counter()
    tokens = sum(len(o) for o in run(prompts, args.max_new_tokens, eos, pad))
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
    ap.add_argument("--engines", default="static,batches", help="comma-separated: static, batches")
    ap.add_argument("--profile-steps", type=int, default=8, help="decode steps of one batch under torch.profiler")
    ap.add_argument(
        "--random-weights",
        default=None,
        metavar="FOLDER",
        help="a random model of the config.json in FOLDER (tokenizer from there too)",
    )
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.random_weights:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(args.random_weights)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(args.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.random_weights)
    else:
        model, tokenizer = load_target(device=args.device)
    device = next(model.parameters()).device
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    prompts = (
        list(data.jsonl_prompts(args.jsonl))
        if args.jsonl
        else data.collect_prompts(args.sources, n=args.prompts, seed=5).prompts
    )[: args.prompts]
    encoded = [ids for ids in (encode_chat(tokenizer, p) for p in prompts) if len(ids) <= args.max_prompt_tokens]
    lengths = sorted(len(ids) for ids in encoded)
    print(
        f"{device}: {len(encoded)} prompts of {lengths[0]}-{lengths[-1]} tokens (median {statistics.median(lengths)})"
        f", batches of {args.batch_size}, at most {args.max_new_tokens} new tokens"
    )
    ordered = sorted(encoded, key=len)  # as `data` orders a shard's prompts
    batches = [ordered[i : i + args.batch_size] for i in range(0, len(ordered), args.batch_size)]
    padding = sum(len(b) * max(map(len, b)) - sum(map(len, b)) for b in batches)
    engines = {name: engine_runner(name, model, args.batch_size) for name in args.engines.split(",")}
    answers = {}
    for name, run in engines.items():  # warm-up (kernels, allocator, graphs), and the first batch's answers
        run(batches[0][:8], 4, eos, pad)
        answers[name] = run(batches[0], args.max_new_tokens, eos, pad)
    first = next(iter(answers))
    for name in list(answers)[1:]:
        same = sum(a == b for a, b in zip(answers[first], answers[name]))
        parts = sorted(
            next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            for a, b in zip(answers[first], answers[name])
            if a != b
        )
        print(
            f"greedy answers of the first batch, {name} vs {first}: {same} of {len(batches[0])} identical"
            + (
                f"; the others part at token {parts[0]}..{parts[-1]} (median {statistics.median(parts)})"
                if parts
                else ""
            )
        )
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in list(engines) if r % 2 == 0 else list(reversed(engines)):
            seconds, tokens = timed(engines[name], ordered, args, eos, pad, device)
            rates[name].append(tokens / seconds)
            print(
                f"round {r}: {name:8s} {tokens} response tokens in {seconds:6.1f} s = {tokens / seconds:8.0f} "
                f"tok/s (batches / slots of {args.batch_size}; static batches' prompt padding {padding} tokens)"
            )
    for name, values in rates.items():
        print(f"median {name:8s} {statistics.median(values):8.0f} tok/s")

    from torch.profiler import ProfilerActivity, profile

    batch = batches[0]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name, run in engines.items():
        sync(device)
        t0 = time.perf_counter()
        run(batch, 1, [], pad)  # prefill + one token
        sync(device)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        run(batch, args.profile_steps, [], pad)
        sync(device)
        unprofiled = (time.perf_counter() - t0 - prefill) / max(1, args.profile_steps - 1)
        with profile(activities=activities) as prof:
            run(batch, args.profile_steps, [], pad)
            sync(device)
        print(
            f"{name}: one batch of {len(batch)}: prefill + 1 token {prefill * 1e3:.0f} ms; then ~"
            f"{unprofiled * 1e3:.1f} ms per decode step ({args.profile_steps} steps, not profiled)"
        )
        print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
