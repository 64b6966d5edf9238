"""Package a trained drafter for shipping: copy its files into a drafter folder and write its model card.

Everything in the card comes from files the commands wrote: the data folders' meta.json (how each was made, what it
holds), the run's run_config.json or checkpoint (training settings) and train_log.jsonl (steps, wall time, held-out
figures), the n-gram store already built into --out by `dflashkit ngram-store`, and a `dflashkit bench` results.json
(τ and speedups per data set, divergences, machine). Refuses a drafter whose files pass 40 MB.

    python scripts/model_card.py --run ~/.cache/dflashkit/runs/RUN --bench BENCH/results.json \
        --out dflashkit/drafters/smollm2-135m-instruct [--previous-card OLD/README.md]
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
from pathlib import Path

MAX_BYTES = 40_000_000  # the shipped drafter, n-gram store included, at most 40 MB
DRAFTER_FILES = ("config.json", "model.safetensors", "mask_embedding.pt")
TRAIN_FLAGS = {  # TrainConfig field -> `dflashkit train` flag (fields at their CLI default are still shown)
    "data_dir": "--data", "out_dir": "--out", "num_layers": "--layers", "block_size": "--block-size",
    "gamma": "--gamma", "loss_weighting": "--loss-weighting", "dpace_alpha": "--dpace-alpha",
    "target_layer_ids": "--target-layers", "mask_token_id": "--mask-token-id",
    "init_drafter": "--init", "anchors_per_seq": "--anchors", "seqs_per_step": "--seqs-per-step",
    "grad_accum": "--grad-accum", "steps": "--steps", "lr": "--lr", "warmup_ratio": "--warmup",
    "max_seq_len": "--max-seq-len", "draft_vocab_size": "--draft-vocab", "eval_every": "--eval-every",
    "checkpoint_every": "--checkpoint-every", "seed": "--seed", "distill_topk": "--distill-topk",
    "distill_weight": "--distill-weight", "device": "--device", "time_budget_s": "--time-budget",
}  # fmt: skip


def data_command(folder: Path, meta: dict) -> str:
    collection = meta.get("extra", {}).get("collection", {})
    settings = meta["settings"]
    args = [
        "dflashkit",
        "data",
        "--sources",
        collection.get("sources", "?"),
        "--num-prompts",
        str(collection.get("num_prompts", meta.get("num_prompts"))),
        "--max-new-tokens",
        str(settings["max_new_tokens"]),
        "--max-prompt-tokens",
        str(settings["max_prompt_tokens"]),
        "--temperature",
        str(settings["temperature"]),
        "--seed",
        str(settings["seed"]),
        "--out",
        str(folder),
    ]
    return shlex.join(args)


def train_command(config: dict) -> str:
    args = ["dflashkit", "train"]
    for field, flag in TRAIN_FLAGS.items():
        value = config.get(field)
        if value is None or (field == "init_drafter" and not value):
            continue
        if field.startswith("distill") and not config.get("distill_topk"):  # no distillation: the flags are moot
            continue
        if field == "dpace_alpha" and config.get("loss_weighting", "decay") != "dpace":  # moot
            continue
        if field == "device" and value == "cpu":  # the default
            continue
        args += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    if not config.get("init_from_target", True):
        args.append("--random-init")
    return shlex.join(args)


def wall_minutes(log: list[dict]) -> float:
    """Training wall time over every process of a resumed run: `elapsed_s` restarts at 0 in each process."""
    total, last = 0.0, 0.0
    for r in log:
        if r["elapsed_s"] < last:  # a new process
            total += last
        last = r["elapsed_s"]
    return (total + last) / 60


def run_config(run: Path) -> dict | None:
    """The run's TrainConfig as a dict: from run_config.json (written by the trainer at start; a run copied from
    another machine may bring only that, the drafter and the log), else from its checkpoint; None if neither."""
    import torch

    if (run / "run_config.json").is_file():
        return json.loads((run / "run_config.json").read_text())["config"]
    state_file = run / "checkpoint" / "trainer_state.pt"
    return torch.load(state_file, map_location="cpu", weights_only=False)["config"] if state_file.is_file() else None


def lineage(config: dict) -> list[str]:
    """Lines for the runs this one started from (`--init` of a run's drafter folder), oldest first."""
    init = config.get("init_drafter")
    if not init:
        return []
    parent = Path(init).expanduser().parent
    config = run_config(parent)
    if config is None:
        return [f"- Initialised from `{init}` (not a run folder of this machine: its history is not recorded here)."]
    log = [json.loads(line) for line in (parent / "train_log.jsonl").read_text().splitlines() if line]
    evals = [r for r in log if "tau" in r]
    last_eval = f"; its last held-out τ {evals[-1]['tau']:.2f}" if evals else ""
    return [
        *lineage(config),
        f"- `{train_command(config)}`: {log[-1]['step']} steps, {wall_minutes(log):.0f} min{last_eval}.",
    ]


def card_sections(lines: list[str], names: tuple[str, ...]) -> list[str]:
    """The lines of a card's named ``## `` sections (headings included), in order."""
    kept, inside = [], False
    for line in lines:
        if line.startswith("## "):
            inside = line.strip() in names
        if inside:
            kept.append(line)
    return kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--run", required=True, type=Path, help="training run folder (drafter/, checkpoint/, train_log.jsonl)"
    )
    ap.add_argument("--bench", required=True, type=Path, help="results.json of a `dflashkit bench` run of this drafter")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--data-note", action="append", default=[], help="a line on how the data was made that no file "
                    "records (e.g. where a prompt file came from); repeatable, shown as written")  # fmt: skip
    ap.add_argument("--training-note", action="append", default=[], help="a line on the training that no file "
                    "records (e.g. a trainer bug found after the run); repeatable, shown as written")  # fmt: skip
    ap.add_argument("--store-note", action="append", default=[], help="a line on the n-gram store in OUT (the "
                    "`dflashkit ngram-store` command that made it); repeatable, shown as written")  # fmt: skip
    ap.add_argument(
        "--previous-card",
        type=Path,
        default=None,
        help="the card of the drafter this run started from "
        "(--init): its Data and Training sections are kept, as written, as this drafter's history",
    )
    ap.add_argument("--previous-name", default=None, help="how the card names that drafter's card (default: the path)")
    args = ap.parse_args()
    from dflashkit.drafter.ngram_store import FILENAME as NGRAM_STORE
    from dflashkit.drafter.ngram_store import NgramStore
    from dflashkit.training.dataset import load_shards

    run = args.run.expanduser()

    config = run_config(run)
    if config is None:
        raise SystemExit(f"{run}: no run_config.json or checkpoint/trainer_state.pt: not a training run folder")
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines() if line]
    bench = json.loads(args.bench.expanduser().read_text())
    drafter_cfg = json.loads((run / "drafter" / "config.json").read_text())

    size = sum((run / "drafter" / f).stat().st_size for f in DRAFTER_FILES if (run / "drafter" / f).exists())
    store_file = args.out / NGRAM_STORE  # built into OUT by `dflashkit ngram-store`, shipped with the drafter
    store = NgramStore.load(store_file) if store_file.is_file() else None
    size += store_file.stat().st_size if store is not None else 0
    if size > MAX_BYTES:
        raise SystemExit(
            f"the drafter is {size / 1e6:.1f} MB ({size / 2**20:.1f} MiB), over the 40 MB limit for the repository"
        )

    lines = ["# DFlash drafter for SmolLM2-135M-Instruct", ""]
    dflash = drafter_cfg["dflash_config"]
    ours = drafter_cfg.get("dflashkit", {})
    vocab = ours.get("draft_vocab")
    mask = "learned mask embedding" if ours.get("learned_mask_embedding") else f"mask token {dflash['mask_token_id']}"
    lines += [
        f"- Architecture: {drafter_cfg['num_hidden_layers']} Qwen3-style layers, hidden {drafter_cfg['hidden_size']}, "
        f"block size {dflash['block_size']}, target feature layers {dflash['target_layer_ids']} (0-based), {mask}, "
        f"draft vocabulary {len(vocab) if vocab else 'full'} tokens; files {size / 2**20:.1f} MiB (bf16).",
        "",
        "## Data",
        "",
    ]
    used_file = run / "data_used.json"
    used = {u["folder"]: u for u in json.loads(used_file.read_text())} if used_file.exists() else {}
    for folder in str(config["data_dir"]).split(","):
        folder = Path(folder).expanduser()
        if not (folder / "meta.json").is_file():  # e.g. made on another machine and left there
            lines += [f"- `{folder}`: not on this machine, so nothing about it is read from files here (see below)."]
            continue
        meta = json.loads((folder / "meta.json").read_text())
        shards = meta.get("shards", {}).values()
        gen_min = sum(s.get("seconds", 0) for s in shards) / 60
        if str(folder) in used:
            what = (
                f"{used[str(folder)]['sequences']} answers, {used[str(folder)]['response_tokens']} response tokens used"
            )
        else:  # a shard cut mid-way (a data phase's time limit) holds answers too, and training read them
            answers = len(load_shards(folder, include_partial=True))
            what = f"(not recorded by this run; the folder now holds {answers} answers)"
        timing = (
            f"the folder's generation time {gen_min:.0f} min ({len(shards)}/{meta['num_shards']} shards complete)"
            if shards
            else f"no shard complete of {meta['num_shards']}, so no generation time recorded"
        )
        lines += [f"- `{data_command(folder, meta)}`: {what}; {timing}."]
    lines += [f"- {note}" for note in args.data_note]
    last = log[-1]
    evals = [r for r in log if "tau" in r]
    earlier = [] if args.previous_card else lineage(config)
    lines += ["", "## Training", ""]
    if earlier:
        lines += ["Earlier stages (each continued from the previous one's drafter with `--init`):", "", *earlier, "",
                  "Last stage:", ""]  # fmt: skip
    lines += [
        f"`{train_command(config)}` (threads as the machine allowed; resumable). {last['step']} steps, "
        f"{wall_minutes(log):.1f} min of wall time over all its processes.",
    ]
    if evals:
        lines += ["", "| step | held-out τ (decode loop) | held-out top-1 by block position 1, 2, 3 | "
                  "training top-1, 1, 2, 3 |", "|---:|---:|---|---|"]  # fmt: skip
    else:
        lines += ["", "No held-out evaluation ran during training (`--eval-every 0`)."]
    lines += [
        f"| {r['step']} | {r['tau']:.2f} | {', '.join(f'{a:.2f}' for a in r.get('heldout_acc', [])[:3])} | "
        f"{', '.join(f'{a:.2f}' for a in r['acc'][:3])} |"
        for r in evals
    ]
    if args.training_note:
        lines += ["", *[f"- {note}" for note in args.training_note]]
    lines += ["", "## Evaluation", "", f"`{bench['command']}`", "",
              f"Machine: {bench['machine'].get('cpu')}, {bench['machine'].get('cores')} cores, "
              f"{bench['machine'].get('torch_threads')} torch threads; dflashkit commit "
              f"{(bench.get('commit') or {}).get('sha', '?')[:10]}.", "",
              "| temperature | data set | method | τ | tok/s | speedup (TPOT) | speedup (tok/s) |",
              "|---:|---|---|---:|---:|---:|---:|"]  # fmt: skip

    def fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
        return "–" if value is None else f"{value:{spec}}{unit}"

    for row in bench["summary"]:
        if row["family"] == "dflashkit":
            lines.append(f"| {row['temperature']:g} | {row['dataset']} | {row['method']} | {fmt(row['tau'])} | "
                         f"{fmt(row['tokens_per_s'], '.1f')} | {fmt(row['speedup_tpot'], '.2f', 'x')} | "
                         f"{fmt(row['speedup_tokens_per_s'], '.2f', 'x')} |")  # fmt: skip
    names = {row["method"] for row in bench["summary"]}
    if any(n.startswith("dflash-lookup") or n == "lookup" for n in names):
        lines += [
            "",
            "`dflash-lookup-*`: this drafter plus prompt lookup (steps whose text ends with a repeated "
            "2-4-gram copy its continuation instead of drafting; their tokens count in τ); `lookup`: prompt "
            "lookup alone, no drafter. The drafter's own τ is that of the `dflash-*` rows.",
        ]
    if store is not None:
        lines += ["", "## N-gram store", "",
                  f"`{NGRAM_STORE}`: the most frequent next token after {len(store)} {store.n}-grams "
                  + (f"(each seen at least {store.min_count} times) " if store.min_count else "")
                  + f"of the target's regenerated answers, proposing up to {store.max_draft} tokens where the "
                  f"text has no repeat of its own ({store_file.stat().st_size / 2**20:.1f} MiB; used with prompt "
                  "lookup, so in the `dflash-lookup-*` rows above; `--no-ngram-store` turns it off).",
                  *[f"- {note}" for note in args.store_note]]  # fmt: skip
    lines += [
        "",
        f"Greedy divergences from plain decoding: {len(bench['divergences'])}, of which not a bf16 tie: "
        f"{bench['non_tie_divergences_in_dflashkit']}.",
        "",
    ]
    if args.previous_card:
        kept = card_sections(args.previous_card.expanduser().read_text().splitlines(), ("## Data", "## Training"))
        lines += [
            "## History: the drafter this one started from",
            "",
            f"From that drafter's card ({args.previous_name or f'`{args.previous_card}`'}), its Data and Training "
            "sections as written:",
            "",
            *["#" + line if line.startswith("## ") else line for line in kept],
            "",
        ]

    args.out.mkdir(parents=True, exist_ok=True)
    for f in DRAFTER_FILES:
        if (run / "drafter" / f).exists():
            shutil.copy2(run / "drafter" / f, args.out / f)
    (args.out / "README.md").write_text("\n".join(lines))
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB of drafter files + README.md)")


if __name__ == "__main__":
    main()
