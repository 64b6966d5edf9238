"""On a CUDA machine: decoding through real CUDA graphs is lossless, and the graphs really replay.

Tiny random targets (llama, qwen2, qwen3 layouts) and drafters in fp32 on the GPU. For each prompt and block size,
speculative greedy decoding with the target's and the drafter's steps replayed from CUDA graphs must equal plain
greedy decoding on transformers' eager forward, token for token: fixed blocks, the adaptive block size (several
verify shapes), and greedy token trees with prompt lookup; T=1 sampling (chains and sampled trees) with graphs must
equal the fast path without graphs for the same seed. Then the data path's fixed-shape batch
(training.batchgen.generate_static: 8 slots refilled as answers end, its decode step a CUDA graph) must give the same
greedy answers to 24 prompts as transformers' decoder in static batches (generate_batch). Prints what ran, the graphs
captured and any shape that fell back to eager; exits 1 on a mismatch or fallback, 2 without a GPU. CI has no GPU, so
run it after changing the decode path, on any CUDA machine (scripts/gpu_train.sh check runs it); `--cpu` runs the
script itself on a CPU with a stand-in capture that records nothing. It needs the repository's tests/ folder.

    python scripts/gpu_check.py [--cpu]
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import time
import warnings

import torch

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"  # conftest's tiny models
PROMPTS = [[5, 9, 14, 3, 22], [7] * 12, list(range(3, 40)), [11, 4]]


def tokens(target, drafter, prompt, policy=None, **kw) -> list[int]:
    from dflashkit import DecodeOptions, decode

    options = DecodeOptions(**{"max_new_tokens": 48, **kw})
    return [t for s in decode(target, drafter, prompt, options, None, block_policy=policy) for t in s.tokens]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run on a CPU with a stand-in capture (checks the script)")
    cpu = ap.parse_args().cpu
    if not cpu and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--cpu runs the script with a stand-in capture)")
        return 2
    sys.path.insert(0, str(TESTS))
    from conftest import ReplayCapture, tiny_drafter, tiny_target

    from dflashkit.decoding.adaptive import AdaptiveBlockSize
    from dflashkit.decoding.sampling import SamplingParams
    from dflashkit.target.adapter import TargetAdapter
    from dflashkit.target.fast import FastTargetForward
    from dflashkit.training.batchgen import generate_batch, generate_static

    device, failures = torch.device("cpu" if cpu else "cuda"), []
    print(f"torch {torch.__version__} on {'a CPU, stand-in capture' if cpu else torch.cuda.get_device_name()}")
    for arch in ("llama", "qwen2", "qwen3"):
        for block in (4, 8, 16):
            model = tiny_target(arch).to(device)
            drafter = tiny_drafter(model, block_size=block).to(device)
            layers = drafter.config.target_layer_ids
            eager = TargetAdapter(copy.deepcopy(model), layers, fast=False, cuda_graphs=False)
            fast = TargetAdapter(copy.deepcopy(model), layers, cuda_graphs=False)
            graphed = TargetAdapter(model, layers)
            if cpu:
                graphed.use_step_graphs(ReplayCapture())
            assert graphed.graphs is not None, "the fast forward on CUDA should replay graphs"
            plain_drafter = copy.deepcopy(drafter)
            plain_drafter.use_fast_path(True)
            drafter.use_fast_path(True)
            drafter.use_step_graphs(ReplayCapture() if cpu else None)
            t0 = time.perf_counter()
            for i, prompt in enumerate(PROMPTS):
                plain = tokens(eager, None, prompt)
                checks = {
                    "graphs, plain": tokens(graphed, None, prompt),
                    "graphs, speculative": tokens(graphed, drafter, prompt),
                    "graphs, adaptive": tokens(graphed, drafter, prompt, AdaptiveBlockSize(block, explore_every=3)),
                    # greedy token trees, copied steps' trees holding the copy and the drafter's candidates
                    "graphs, trees with copies": tokens(graphed, drafter, prompt + prompt, tree=5, lookup=True),
                }
                plain_twice = tokens(eager, None, prompt + prompt)
                for name, got in checks.items():
                    want = plain_twice if "copies" in name else plain
                    if got != want:
                        at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                        failures.append(f"{arch} b{block} prompt {i} {name}: parts from plain greedy at token {at}")
                sampling = SamplingParams(temperature=1.0)
                with_graphs = tokens(graphed, drafter, prompt, sampling=sampling, seed=7)
                without = tokens(fast, plain_drafter, prompt, sampling=sampling, seed=7)
                if with_graphs != without:
                    failures.append(f"{arch} b{block} prompt {i} T=1: graphs and no graphs sample differently")
                # sampled token trees (candidates drawn on the device, recursive rejection sampling)
                if tokens(graphed, drafter, prompt, sampling=sampling, seed=7, tree=5) != tokens(
                    fast, plain_drafter, prompt, sampling=sampling, seed=7, tree=5
                ):
                    failures.append(f"{arch} b{block} prompt {i} T=1 trees: graphs and no graphs sample differently")
            if not cpu:
                torch.cuda.synchronize()
            fell_back = {**graphed.graphs.failed, **drafter.graphs.failed}
            failures += [f"{arch} b{block} fell back to eager: {k} {v}" for k, v in fell_back.items()]
            print(
                f"{arch:6s} block {block:2d}: {len(PROMPTS)} prompts x 6 checks in {time.perf_counter() - t0:5.1f} s; "
                f"target graphs captured {graphed.graphs.captures}, drafter graphs {drafter.graphs.captures}, "
                f"fallbacks {len(fell_back)}"
            )
    for arch in ("llama", "qwen2", "qwen3"):  # the data path: one fixed-shape batch, its step a graph
        model = tiny_target(arch, tie_word_embeddings=False).to(device)
        g = torch.Generator().manual_seed(1)
        prompts = [
            torch.randint(4, 96, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (24,), generator=g)
        ]
        expected = generate_batch(model, prompts, max_new_tokens=24, eos_ids=[2], pad_id=0, compact_fraction=1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            answers = dict(
                generate_static(
                    FastTargetForward(model),
                    prompts,
                    slots=8,
                    max_new_tokens=24,
                    eos_ids=[2],
                    graph=ReplayCapture() if cpu else "auto",
                )
            )
            got = [answers[i] for i in range(len(prompts))]
        differ = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
        failures += [f"{arch} static batch: answer {i} parts from generate_batch" for i in differ]
        failures += [f"{arch} static batch: {w.message}" for w in caught if issubclass(w.category, RuntimeWarning)]
        print(f"{arch:6s} static slots: {len(prompts) - len(differ)} of {len(prompts)} answers identical")
    for f in failures:
        print("FAIL", f)
    print("all identical, no fallback" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
