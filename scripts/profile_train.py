"""Where a training step's time goes: `dflashkit train`'s settings, a few steps timed by phase, then profiled.

Builds the trainer as `dflashkit train --init DRAFTER --distill-topk 32 --distill-weight 0.5` does (the default target
in bf16; features computed every step on a GPU, cached on a CPU), runs the warm-up steps, times --steps steps by phase
(the target's features and soft labels, the drafter's forward, the LM head and losses, backward and optimizer; each
phase synchronised on a GPU), and profiles --profile-steps more with torch.profiler: the operators by self device time
(CPU time on a CPU) and the operator calls per step. The timed steps rerun batches the warm-up ran, so that a GPU's
per-shape setup (cuDNN plans) is not timed. It says whether a step is bound by launching operations, by the drafter,
or by the target's pass over the sequences.

    python scripts/profile_train.py --data DATA[,DATA2] [--device cuda] [--seqs-per-step 128] [--steps 4]
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

SHIPPED = Path(__file__).resolve().parents[1] / "dflashkit" / "drafters" / "smollm2-135m-instruct"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="data folder(s) of `dflashkit data`, comma-separated")
    ap.add_argument("--init", default=str(SHIPPED), help="the drafter to continue (default: the shipped one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seqs-per-step", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from dflashkit.target.loading import load_target
    from dflashkit.training.dataset import batches
    from dflashkit.training.trainer import TrainConfig, Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    out_dir = tempfile.mkdtemp(prefix="dflashkit-profile-train-")  # the trainer's files (a feature cache on a CPU)
    atexit.register(shutil.rmtree, out_dir, True)
    cfg = TrainConfig(
        data_dir=args.data,
        out_dir=out_dir,
        init_drafter=args.init,
        seqs_per_step=args.seqs_per_step,
        steps=10_000,
        lr=6e-4,
        eval_every=0,
        checkpoint_every=10**9,
        distill_topk=32,
        distill_weight=0.5,
        device=str(device),
        cache_features=device.type == "cpu",
    )
    model, tokenizer = load_target(dtype=torch.bfloat16, device=str(device))
    trainer = Trainer(cfg, model, tokenizer, log=print)
    # the timed and profiled steps cycle over --steps batches that the warm-up has run once each: a GPU builds
    # cuDNN's attention plans per sequence length, so steps on lengths new to it would time plan building (on an
    # H100 over twice a warm step's time)
    fixed = list(itertools.islice(batches(trainer.train_seqs, cfg.seqs_per_step, cfg.seed), args.steps))
    step_batches = itertools.cycle(fixed)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def run(*a, **k):
            sync()
            began = time.perf_counter()
            out = fn(*a, **k)
            sync()
            spent[name] += time.perf_counter() - began
            return out

        return run

    for _ in range(max(args.warmup, len(fixed))):  # compiling, caches, allocator, each batch's shapes
        trainer.train_step(step_batches)
    sync()
    began = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step(step_batches)
    sync()
    plain = (time.perf_counter() - began) / args.steps
    print(
        f"{args.steps} steps of {cfg.seqs_per_step} sequences: {plain * 1e3:.1f} ms a step, "
        f"{cfg.seqs_per_step / plain:.0f} sequences/s ({device}, unsynchronised)"
    )

    trainer.batch_features = timed("target features (and soft labels)", trainer.batch_features)
    # the decoder's pass alone (its features and last hidden states): the rest of the phase is the soft labels
    trainer.target._decoder_pass = timed("target decoder pass", trainer.target._decoder_pass)
    trainer.forwards = {k: timed("drafter forward", f) for k, f in trainer.forwards.items()}
    trainer.loss_on = timed("forward in all", trainer.loss_on)
    trainer.train_step = timed("step", trainer.train_step)
    for _ in range(args.steps):
        trainer.train_step(step_batches)
    rest = spent["forward in all"] - spent["target features (and soft labels)"] - spent["drafter forward"]
    phases = {"target features (and soft labels)": spent["target features (and soft labels)"],
              "  of which the target's decoder pass": spent["target decoder pass"],
              "drafter forward": spent["drafter forward"], "LM head, losses, figures": rest,
              "backward and optimizer": spent["step"] - spent["forward in all"]}  # fmt: skip
    for name, seconds in phases.items():
        print(f"  {name:38s} {seconds / args.steps * 1e3:8.1f} ms  ({seconds / spent['step']:.0%})")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            trainer.train_step(step_batches)
        sync()
    averages = prof.key_averages()
    calls = sum(e.count for e in averages if e.key.startswith("aten::"))
    print(f"aten operator calls per step (nested included): {calls / args.profile_steps:.0f}")
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(averages.table(sort_by=sort, row_limit=20))


if __name__ == "__main__":
    main()
