"""Write a drafter's model card (its README.md) in the Hugging Face model-card shape.

The card starts with a YAML header that the Hub reads (license, base_model, library_name, pipeline_tag, tags,
datasets, and model-index with τ and the speedup over plain decoding per evaluation set, greedy and sampled) and
that keeps, under its `dflashkit:` key, the record of how the drafter was made: data folders and their commands,
the training command, hardware, wall time and hyperparameters, the n-gram store, the earlier stages. The sections
below the header are written from that record, the drafter's own files and a `dflashkit bench` results.json.

Package a new drafter from a training run (copies run/drafter's files into OUT; the n-gram store must already be
in OUT, built there by `dflashkit ngram-store`):

    python scripts/model_card.py --run RUN --bench BENCH/results.json --out DRAFTER \\
        [--previous-card OLD/README.md] [--rename DATA_FOLDER=data/greedy ...]

Refresh the card of a drafter that already ships (its run folders gone): the record is read from the card's own
header, the evaluation from a new bench run:

    python scripts/model_card.py --refresh dflashkit/drafters/smollm2-135m-instruct \\
        --bench docs/benchmarks/DATE-CPU/results.json

Refuses a drafter whose files pass 40 MB.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

MAX_BYTES = 40_000_000  # the shipped drafter, n-gram store included, at most 40 MB
DRAFTER_FILES = ("config.json", "model.safetensors", "mask_embedding.pt")
NGRAM_STORE = "ngram_store.safetensors"  # dflashkit.drafter.ngram_store.FILENAME
DEFAULT_TARGET = "smollm2-135m-instruct"  # dflashkit.target.loading.DEFAULT_TARGET
HUB_IDS = {DEFAULT_TARGET: "HuggingFaceTB/SmolLM2-135M-Instruct"}  # dflashkit target name -> Hub id
TAGS = ["speculative-decoding", "dflash", "block-diffusion", "drafter", "dflashkit"]
EVAL_SETS = {  # bench data set -> (display name, Hub data set holding the same questions)
    "mt-bench": ("MT-Bench", "HuggingFaceH4/mt_bench_prompts"),
    "humaneval": ("HumanEval", "openai/openai_humaneval"),
    "math500": ("MATH-500", "HuggingFaceH4/MATH-500"),
}
SOURCE_DATASETS = {  # `dflashkit data --sources` kind -> Hub data set its prompts come from
    "sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered",
    "sharegpt-turns": "anon8231489123/ShareGPT_Vicuna_unfiltered",
}
PREFERRED_METHODS = ("dflash-lookup-auto", "dflash-auto", "dflash-lookup-b16", "dflash-b16")  # the default first
PAPER_TAU = 6.5  # the DFlash paper's acceptance length with 8B targets
TRAIN_FLAGS = {  # TrainConfig field -> `dflashkit train` flag (fields at their CLI default are still shown)
    "data_dir": "--data", "out_dir": "--out", "target": "--target", "num_layers": "--layers",
    "block_size": "--block-size", "gamma": "--gamma", "loss_weighting": "--loss-weighting",
    "dpace_alpha": "--dpace-alpha", "target_layer_ids": "--target-layers", "mask_token_id": "--mask-token-id",
    "init_drafter": "--init", "anchors_per_seq": "--anchors", "seqs_per_step": "--seqs-per-step",
    "grad_accum": "--grad-accum", "steps": "--steps", "lr": "--lr", "warmup_ratio": "--warmup",
    "max_seq_len": "--max-seq-len", "draft_vocab_size": "--draft-vocab", "eval_every": "--eval-every",
    "checkpoint_every": "--checkpoint-every", "seed": "--seed", "distill_topk": "--distill-topk",
    "distill_weight": "--distill-weight", "device": "--device", "precision": "--precision",
    "time_budget_s": "--time-budget",
}  # fmt: skip
HYPERPARAMETERS = {  # TrainConfig field -> name in the card's hyperparameter table
    "num_layers": "layers", "block_size": "block size", "gamma": "loss decay γ", "loss_weighting": "loss weighting",
    "anchors_per_seq": "anchors (blocks) per sequence", "seqs_per_step": "sequences per step",
    "grad_accum": "gradient accumulation", "lr": "learning rate", "warmup_ratio": "warmup (share of steps)",
    "max_seq_len": "max sequence length", "draft_vocab_size": "draft vocabulary", "distill_topk": "distillation top-K",
    "distill_weight": "distillation weight", "time_budget_s": "time budget (s)", "seed": "seed",
}  # fmt: skip


# ---- paths as a reader can reproduce them ---------------------------------------------------------------------


class Paths:
    """Paths as the card shows them: renamed as asked (--rename OLD=NEW), else relative to the working directory
    or ~, else the folder's own name (a path of one machine means nothing to a reader)."""

    def __init__(self, renames: list[str]) -> None:
        self.renames = []
        for item in renames:
            old, sep, new = item.partition("=")
            if not sep or not old or not new:
                raise SystemExit(f"--rename {item!r}: expected OLD=NEW")
            self.renames.append((old.rstrip("/"), new.rstrip("/")))
        self.renames.sort(key=lambda r: -len(r[0]))  # the longest match first
        self.shortened: set[str] = set()

    def __call__(self, path: str | os.PathLike) -> str:
        text = str(path)
        for old, new in self.renames:
            if text == old or text.startswith(old + "/"):
                return new + text[len(old) :]
        p = Path(text).expanduser()
        if not p.is_absolute():
            return text
        for base, prefix in ((Path.cwd(), ""), (Path.home(), "~/")):
            rel = os.path.relpath(p, base)
            if not rel.startswith(".."):
                return prefix + rel if rel != "." else (prefix.rstrip("/") or ".")
        self.shortened.add(text)
        return p.name

    def sources(self, spec: str) -> str:
        """A `--sources` value with its jsonl:PATH[:W] paths shown as above."""
        out = []
        for item in spec.split(","):
            if item.startswith("jsonl:"):
                rest = item.removeprefix("jsonl:")
                path, sep, weight = rest.rpartition(":")
                if not sep or not _is_number(weight):
                    path, weight = rest, ""
                item = "jsonl:" + self(path) + (f":{weight}" if weight else "")
            out.append(item)
        return ",".join(out)

    def command(self, command: str) -> str:
        """A recorded command line with its absolute paths shown as above."""
        words = []
        for word in shlex.split(command):
            flag, eq, value = word.partition("=")
            if eq and flag.startswith("--") and value.startswith(("/", "~")):
                word = f"{flag}={self(value)}"
            elif word.startswith(("/", "~")):
                word = self(word)
            words.append(word)
        return shlex.join(words)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ---- the card file: YAML header and Markdown body ---------------------------------------------------------------


def split_card(text: str) -> tuple[dict[str, Any], str]:
    """(YAML header, body) of a model card; an empty header where the card has none."""
    import yaml

    if not text.startswith("---\n"):
        return {}, text
    end = text.find("\n---\n", 4)
    if end < 0:
        raise SystemExit("the card's YAML header has no closing '---' line")
    return yaml.safe_load(text[4:end]) or {}, text[end + 5 :]


def join_card(header: dict[str, Any], body: str) -> str:
    import yaml

    return "---\n" + yaml.safe_dump(header, sort_keys=False, allow_unicode=True, width=120) + "---\n\n" + body


# ---- facts read from a training run -------------------------------------------------------------------------------


def run_config(run: Path) -> dict | None:
    """run_config.json of a run (the trainer writes it at start), else its TrainConfig from the checkpoint (with no
    machine recorded); None if neither."""
    if (run / "run_config.json").is_file():
        return json.loads((run / "run_config.json").read_text())
    state_file = run / "checkpoint" / "trainer_state.pt"
    if not state_file.is_file():
        return None
    import torch

    return {"config": torch.load(state_file, map_location="cpu", weights_only=False)["config"]}


def read_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines() if line.strip()]


def wall_minutes(log: list[dict]) -> float:
    """Training wall time over every process of a resumed run: `elapsed_s` restarts at 0 in each process."""
    total, last = 0.0, 0.0
    for r in log:
        if r["elapsed_s"] < last:  # a new process
            total += last
        last = r["elapsed_s"]
    return (total + last) / 60


def data_command(folder: str, meta: dict, paths: Paths) -> str:
    collection = meta.get("extra", {}).get("collection", {})
    settings = meta["settings"]
    args = ["dflashkit", "data", "--sources", paths.sources(str(collection.get("sources", "?")))]
    args += ["--num-prompts", str(collection.get("num_prompts", meta.get("num_prompts")))]
    for key, flag in (
        ("max_new_tokens", "--max-new-tokens"),
        ("max_prompt_tokens", "--max-prompt-tokens"),
        ("temperature", "--temperature"),
        ("seed", "--seed"),
    ):
        if settings.get(key) is not None:
            args += [flag, str(settings[key])]
    if collection.get("exclude_eval") is False:
        args.append("--no-eval-exclusion")
    return shlex.join([*args, "--out", folder])


def train_command(config: dict, paths: Paths) -> str:
    args = ["dflashkit", "train"]
    for field, flag in TRAIN_FLAGS.items():
        value = config.get(field)
        if value is None or (field == "init_drafter" and not value):
            continue
        if field.startswith("distill") and not config.get("distill_topk"):  # no distillation: the flags are moot
            continue
        if field == "dpace_alpha" and config.get("loss_weighting", "decay") != "dpace":  # moot
            continue
        if (field, value) in (("device", "cpu"), ("precision", "bf16")):  # the defaults
            continue
        if field == "data_dir":
            value = ",".join(paths(p) for p in str(value).split(","))
        elif field in ("out_dir", "init_drafter"):
            value = paths(value)
        args += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    if not config.get("init_from_target", True):
        args.append("--random-init")
    return shlex.join(args)


def hyperparameters(config: dict) -> dict[str, Any]:
    out = {}
    for field, name in HYPERPARAMETERS.items():
        value = config.get(field)
        if value is None or (field.startswith("distill") and not config.get("distill_topk")):
            continue
        out[name] = value
    return out


def data_entries(config: dict, run: Path, paths: Paths) -> list[dict[str, Any]]:
    """One entry per data folder of the run: its command, what it gave the run, how long it took to make."""
    used_file = run / "data_used.json"
    used = {u["folder"]: u for u in json.loads(used_file.read_text())} if used_file.exists() else {}
    entries = []
    for name in str(config["data_dir"]).split(","):
        folder = Path(name).expanduser()
        entry: dict[str, Any] = {"folder": paths(name)}
        if not (folder / "meta.json").is_file():  # e.g. made on another machine and left there
            entry["note"] = "not on the machine that wrote this card: nothing about it was read from files"
            entries.append(entry)
            continue
        meta = json.loads((folder / "meta.json").read_text())
        entry["command"] = data_command(entry["folder"], meta, paths)
        entry["sources"] = paths.sources(str(meta.get("extra", {}).get("collection", {}).get("sources", "?")))
        entry["temperature"] = meta["settings"].get("temperature")
        if name in used or str(folder) in used:
            u = used.get(name) or used[str(folder)]
            entry["answers"], entry["response_tokens"] = u["sequences"], u["response_tokens"]
        else:  # a shard cut mid-way (a time limit) holds answers too, and training read them
            from dflashkit.training.dataset import load_shards

            entry["answers"] = len(load_shards(folder, include_partial=True))
        shards = meta.get("shards", {}).values()
        if shards:
            seconds = sum(s.get("seconds", 0) for s in shards)
            entry["note"] = f"generated in {seconds / 60:.1f} min ({len(shards)}/{meta['num_shards']} shards complete)"
        entries.append(entry)
    return entries


def lineage(config: dict, paths: Paths) -> list[dict[str, Any]]:
    """Stages of the runs this one started from (`--init` of a run's drafter folder) that are still on this
    machine, oldest first."""
    init = config.get("init_drafter")
    if not init:
        return []
    parent = Path(init).expanduser().parent
    recorded = run_config(parent)
    if recorded is None or not (parent / "train_log.jsonl").is_file():
        return []
    parent_config = recorded["config"]
    log = read_log(parent)
    return [*lineage(parent_config, paths), stage_of(parent_config, recorded, log, paths, name=paths(parent))]


def stage_of(config: dict, recorded: dict, log: list[dict], paths: Paths, name: str) -> dict[str, Any]:
    init = config.get("init_drafter")
    return {
        "stage": name,
        "hardware": recorded.get("machine"),
        "init": paths(init) if init else "the target's last layers",
        "data": ", ".join(paths(p) for p in str(config["data_dir"]).split(",")),
        "steps": log[-1]["step"] if log else None,
        "sequences_per_step": config.get("seqs_per_step"),
        "wall_minutes": round(wall_minutes(log), 1) if log else None,
        "command": train_command(config, paths),
    }


def record_from_run(args: argparse.Namespace, paths: Paths) -> tuple[dict[str, Any], list[str]]:
    """(the `dflashkit:` record, the Hub data sets of its prompt sources) of a training run."""
    run = args.run.expanduser()
    recorded = run_config(run)
    if recorded is None:
        raise SystemExit(f"{run}: no run_config.json or checkpoint/trainer_state.pt: not a training run folder")
    config = recorded["config"]
    log = read_log(run)
    evals = [r for r in log if "tau" in r]
    date = args.date or dt.datetime.fromtimestamp((run / "train_log.jsonl").stat().st_mtime, dt.timezone.utc)
    procedure: dict[str, Any] = {
        "command": train_command(config, paths),
        "hardware": args.hardware or recorded.get("machine"),
        "software": f"torch {recorded['torch']}" if recorded.get("torch") else None,
        "processes": recorded.get("processes"),
        "date": str(date)[:10],
        "steps": log[-1]["step"] if log else None,
        "sequences_per_step": config.get("seqs_per_step"),
        "wall_minutes": round(wall_minutes(log), 1) if log else None,
        "hyperparameters": hyperparameters(config),
        "heldout": [
            {"step": r["step"], "tau": round(r["tau"], 3), "top1": [round(a, 3) for a in r.get("heldout_acc", [])[:3]]}
            for r in evals
        ],
        "notes": list(args.training_note),
    }
    store: dict[str, Any] = {"notes": list(args.store_note)}
    if args.store_command:
        store["command"] = args.store_command
    entries = data_entries(config, run, paths)
    stages: list[dict[str, Any]] = []
    if args.previous_card:
        previous, _ = split_card(args.previous_card.expanduser().read_text())
        before = previous.get("dflashkit")
        if not before or "training" not in before:
            raise SystemExit(f"{args.previous_card}: no `dflashkit:` record in its header (not a card of this script)")
        stages = [*before["training"].get("stages", []), summary_stage(before)]
    else:
        stages = lineage(config, paths)
    record = {
        "version": args.drafter_version,
        "target": config.get("target") or DEFAULT_TARGET,
        "training": {
            "data": entries,
            "data_notes": list(args.data_note),
            "procedure": {k: v for k, v in procedure.items() if v not in (None, [], {})},
            "ngram_store": {k: v for k, v in store.items() if v},
            "notes": [],
            "stages": stages,
        },
        "notes": notes_by_section(args.note),
    }
    datasets = sorted({d for e in entries for d in source_datasets(e.get("sources", ""))} | set(args.dataset))
    return record, datasets


def summary_stage(record: dict[str, Any]) -> dict[str, Any]:
    """One row of the stage table for the drafter a record describes (its last stage)."""
    training = record["training"]
    procedure = training.get("procedure", {})
    answers = [e.get("answers") for e in training.get("data", [])]
    init = shlex.split(procedure.get("command", "")) if procedure.get("command") else []
    return {
        "stage": record.get("version") or "previous",
        "date": procedure.get("date"),
        "hardware": procedure.get("hardware"),
        "init": procedure.get("init")
        or (init[init.index("--init") + 1] if "--init" in init[:-1] else "the target's last layers"),
        "data": f"{sum(answers):,} answers" if answers and None not in answers else None,
        "steps": procedure.get("steps"),
        "sequences_per_step": procedure.get("sequences_per_step"),
        "wall_minutes": procedure.get("wall_minutes"),
    }


def notes_by_section(items: list[str]) -> dict[str, list[str]]:
    """--note "SECTION: text" items grouped by section (usage, limitations, evaluation, details)."""
    out: dict[str, list[str]] = {}
    for item in items:
        section, sep, text = item.partition(":")
        if not sep or section.strip() not in NOTE_SECTIONS:
            raise SystemExit(f"--note {item!r}: expected one of {', '.join(NOTE_SECTIONS)}, a colon, then the text")
        out.setdefault(section.strip(), []).append(text.strip())
    return out


NOTE_SECTIONS = ("details", "usage", "evaluation", "limitations")


def source_datasets(sources: str) -> list[str]:
    out = []
    for item in sources.split(","):
        kind = item.split(":", 1)[0]
        if kind in SOURCE_DATASETS:
            out.append(SOURCE_DATASETS[kind])
        elif kind == "hf":
            out.append(item.split(":")[1])
    return out


# ---- the drafter's own files --------------------------------------------------------------------------------------


def safetensors_parameters(path: Path) -> int:
    """Number of parameters in a safetensors file, from its header alone (no tensor is read)."""
    from safetensors import safe_open

    with safe_open(path, "np") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def drafter_facts(folder: Path) -> dict[str, Any]:
    config = json.loads((folder / "config.json").read_text())
    files = {f: (folder / f).stat().st_size for f in (*DRAFTER_FILES, NGRAM_STORE) if (folder / f).is_file()}
    facts: dict[str, Any] = {"config": config, "files": files, "store": None}
    if (folder / "model.safetensors").is_file():
        facts["parameters"] = safetensors_parameters(folder / "model.safetensors")
    if NGRAM_STORE in files:
        from dflashkit.drafter.ngram_store import NgramStore

        store = NgramStore.load(folder / NGRAM_STORE)
        facts["store"] = {
            "entries": len(store),
            "n": store.n,
            "min_count": store.min_count,
            "max_draft": store.max_draft,
        }
    return facts


# ---- evaluation: a `dflashkit bench` results.json -----------------------------------------------------------------


def chosen_method(bench: dict[str, Any], method: str | None) -> str:
    names = [r["method"] for r in bench["summary"] if r["family"] == "dflashkit" and r["method"] != bench["baseline"]]
    if method:
        if method not in names:
            raise SystemExit(
                f"--method {method}: not among the bench's dflashkit methods ({', '.join(dict.fromkeys(names))})"
            )
        return method
    for name in PREFERRED_METHODS:
        if name in names:
            return name
    if not names:
        raise SystemExit("the bench results hold no speculative dflashkit method")
    return names[0]


def temperature_label(t: float) -> str:
    return "greedy" if t == 0 else f"T={t:g}"


def rows_of(bench: dict[str, Any], method: str) -> dict[tuple[str, float], dict[str, Any]]:
    return {(r["dataset"], r["temperature"]): r for r in bench["summary"] if r["method"] == method}


def model_index(name: str, bench: dict[str, Any], method: str) -> list[dict[str, Any]]:
    """The Hub's model-index: per data set, τ and the speedup (TPOT) over plain decoding at each temperature."""
    rows = rows_of(bench, method)
    temps = list(dict.fromkeys(r["temperature"] for r in bench["summary"]))
    results = []
    for dataset, questions in bench["datasets"].items():
        display, hub = EVAL_SETS.get(dataset, (dataset, dataset))
        metrics = []
        for t in temps:
            row = rows.get((dataset, t))
            if row is None:
                continue
            label = temperature_label(t)
            kinds = (
                ("acceptance_length", "tau", f"acceptance length τ ({label})"),
                ("speedup", "speedup_tpot", f"speedup over plain decoding, TPOT ({label})"),
            )
            for kind, field, title in kinds:
                if row.get(field) is not None:  # a fresh args dict each: no YAML anchors in the header
                    args = {"temperature": t, "method": method, "baseline": bench["baseline"]}
                    metrics.append({"type": kind, "name": title, "value": round(row[field], 3), "args": args})
        if metrics:
            settings = bench.get("settings", {})
            results.append(
                {
                    "task": {"type": "text-generation", "name": "Speculative decoding"},
                    "dataset": {
                        "name": display,
                        "type": hub,
                        "args": {
                            "questions": questions,
                            "max_new_tokens": settings.get("max_new_tokens"),
                            "max_turns": settings.get("max_turns"),
                        },
                    },
                    "metrics": metrics,
                }
            )
    return [{"name": name, "results": results}]


def file_size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


# ---- the card -----------------------------------------------------------------------------------------------------


def render(
    header: dict[str, Any], folder: Path, bench: dict[str, Any], method: str, paths: Paths, shipped: bool
) -> str:
    record = header["dflashkit"]
    training = record["training"]
    facts = drafter_facts(folder)
    cfg = facts["config"]
    dflash = cfg.get("dflash_config", {})
    ours = cfg.get("dflashkit", {})
    block = dflash.get("block_size", cfg.get("block_size"))
    base = header.get("base_model")
    target = record.get("target") or DEFAULT_TARGET
    target_name = base.split("/")[-1] if base else target
    notes = record.get("notes", {})
    drafter_arg = "DRAFTER"
    lines = [f"# DFlash drafter for {target_name}", ""]
    version = f" ({record['version']})" if record.get("version") else ""
    lines += [
        f"A [DFlash](https://arxiv.org/abs/2602.06036) block-diffusion drafter{version} for speculative decoding of "
        + (f"[{base}](https://huggingface.co/{base})" if base else f"`{target}`")
        + f", made with dflashkit. Given the target's hidden states, it proposes up to {block - 1} tokens in one "
        "forward pass; the target checks them all in one pass and keeps the longest accepted prefix plus one token "
        "it computes itself, so the output is the target's: identical to plain greedy decoding, or drawn from the "
        "target's own distribution when sampling. It does not generate text by itself.",
        "",
    ]

    # Model details
    vocab = ours.get("draft_vocab")
    size = sum(facts["files"].values())
    mask = (
        f"learned mask embedding (`mask_embedding.pt`, in place of token {dflash.get('mask_token_id')})"
        if ours.get("learned_mask_embedding")
        else f"token {dflash.get('mask_token_id')}"
    )
    details = [
        ("Target", (f"[{base}](https://huggingface.co/{base})" if base else "–") + f"; dflashkit name `{target}`"),
        (
            "Architecture",
            f"DFlash drafter, {cfg['num_hidden_layers']} Qwen3-style decoder layers: hidden size "
            f"{cfg['hidden_size']}, intermediate size {cfg.get('intermediate_size', '–')}, "
            f"{cfg.get('num_attention_heads', '–')} attention heads ({cfg.get('num_key_value_heads', '–')} key-value), "
            f"head dimension {cfg.get('head_dim', '–')}",
        ),
        ("Block size", f"{block} (up to {block - 1} drafted tokens per step)"),
        (
            "Target feature layers",
            f"{dflash.get('target_layer_ids')} (0-based) of the target's {cfg.get('num_target_layers', '–')}",
        ),
        ("Mask", mask),
        (
            "Draft vocabulary",
            f"{len(vocab):,} tokens (the most frequent in its training answers) of {cfg.get('vocab_size', 0):,}"
            if vocab
            else f"the target's full vocabulary ({cfg.get('vocab_size', 0):,})",
        ),
        ("Embedding and LM head", "the target's own (not stored here)"),
    ]
    if facts.get("parameters"):
        details.append(("Parameters", f"{facts['parameters'] / 1e6:.1f} M ({cfg.get('torch_dtype', 'bf16')})"))
    if ours.get("context_window"):
        details.append(
            (
                "Context window",
                f"{ours['context_window']} latest tokens (`dflashkit.context_window`; `--draft-window` overrides it)",
            )
        )
    if ours.get("proposal_temperature"):
        details.append(
            (
                "Proposal temperature",
                f"{ours['proposal_temperature']:g} × the request's temperature "
                "(`dflashkit.proposal_temperature`; sampled drafts only, exact at any value)",
            )
        )
    store = facts["store"]
    if store:
        details.append(
            (
                "N-gram store",
                f"`{NGRAM_STORE}`: the most frequent next token after {store['entries']:,} "
                f"{store['n']}-grams of the target's answers"
                + (f" (each seen at least {store['min_count']} times)" if store["min_count"] else "")
                + f", drafting up to {store['max_draft']} tokens where the text has no repeat of its own "
                f"({file_size(facts['files'][NGRAM_STORE])}; dflashkit only: exports leave it out)",
            )
        )
    sizes = ", ".join(f"`{f}` {file_size(n)}" for f, n in facts["files"].items())
    details.append(("Size on disk", f"{sizes}; {file_size(size)} in all"))
    lines += ["## Model details", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in details]]
    lines += [*[f"\n{n}" for n in notes.get("details", [])], ""]

    # Intended use
    lines += [
        "## Intended use",
        "",
        f"Faster decoding of {target_name} with the same output: as dflashkit's drafter for this target (CPU or "
        "GPU; `dflashkit generate`, `dflashkit serve`, the Python API), or exported to vLLM, SGLang or llama.cpp. "
        "Speculative decoding with it is lossless: greedy output is the target's own greedy output, and a sampled "
        "request draws from the target's distribution.",
        "",
        "Out of scope: any other target, including fine-tunes of this one or other tokenizers (the drafter reads "
        "this target's hidden states and borrows its embedding and LM head; dflashkit refuses a drafter whose "
        "target does not match); text generation on its own; any use where its drafts would be shown without the "
        "target checking them.",
        "",
    ]

    # How to use
    default_target = target == DEFAULT_TARGET
    target_flag = "" if default_target else f" --target {shlex.quote(base or target)}"
    serve_target = base or target
    n_spec = block - 1
    spec = json.dumps({"method": "dflash", "model": "drafter-hf", "num_speculative_tokens": n_spec})
    lines += ["## How to use", "", "### dflashkit", ""]
    if shipped:
        lines += [
            "This drafter ships inside the dflashkit package and is used by default for its target "
            f"({'the embedded SmolLM2-135M-Instruct' if default_target else serve_target}); "
            f"`--drafter {drafter_arg}` names a copy of this folder elsewhere, `--drafter none` turns drafting off. "
            f'Below, `{drafter_arg}` is this folder; in an installed dflashkit, `python -c "from '
            'dflashkit.drafter.registry import shipped_drafter; print(shipped_drafter(None))"` prints where it is.',
            "",
            "```bash",
            f'dflashkit generate "Explain speculative decoding in two sentences."{target_flag} --max-new-tokens 64 '
            "--compare-ar",
            f"dflashkit serve{target_flag} --port 8000",
            "```",
        ]
    else:
        lines += [
            f"`{drafter_arg}` is this folder.",
            "",
            "```bash",
            f'dflashkit generate "Explain speculative decoding in two sentences."{target_flag} '
            f"--drafter {drafter_arg} --max-new-tokens 64 --compare-ar",
            f"dflashkit serve{target_flag} --drafter {drafter_arg} --port 8000",
            "```",
        ]
    load_args = ("" if default_target else f"target={serve_target!r}") + ("" if shipped else ", drafter='DRAFTER'")
    lines += [
        "",
        "```python",
        "from dflashkit import SpeculativeGenerator",
        "",
        f"gen = SpeculativeGenerator.load({load_args.lstrip(', ')})"
        + ("  # the target and its shipped drafter" if shipped else ""),
        'result = gen.generate("Explain speculative decoding in two sentences.", max_new_tokens=64)',
        "print(result.text)",
        "print(result.stats.tau)  # tokens per target pass",
        "```",
        "",
        "### vLLM and SGLang",
        "",
        "Export the drafter to the published DFlash layout first (the export checks it against the target):",
        "",
        "```bash",
        f"dflashkit export {drafter_arg}{target_flag} --format hf --out drafter-hf",
        f"vllm serve {shlex.quote(serve_target)} --speculative-config {shlex.quote(spec)}",
        f"python -m sglang.launch_server --model-path {shlex.quote(serve_target)} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path drafter-hf --speculative-num-draft-tokens {block} --dtype bfloat16",
        "```",
        "",
    ]
    if ours.get("learned_mask_embedding"):
        lines += [
            "vLLM loads the learned mask vector as dflashkit does; SGLang ignores it and drafts masks with the "
            "target's own row of the mask id, so its drafts differ and are accepted less often (outputs stay exact).",
            "",
        ]
    if vocab:
        lines += ["vLLM drafts over the draft vocabulary as dflashkit does; SGLang drafts over the full head.", ""]
    lines += [
        "### llama.cpp",
        "",
        "```bash",
        "bash scripts/get_llama_cpp.sh --build",
        f"dflashkit export {drafter_arg}{target_flag} --format gguf --target-gguf --out drafter-gguf",
        "llama-server -m drafter-gguf/target-bf16.gguf -md drafter-gguf/drafter-bf16.gguf "
        f"--spec-type draft-dflash --spec-draft-n-max {n_spec} -fa on --jinja",
        "```",
        "",
        "`scripts/get_llama_cpp.sh` is in dflashkit's source tree; it fetches a llama.cpp with DFlash support "
        "(its converter writes the GGUF) and, with `--build`, builds `llama-server`.",
        "",
        *[line for n in notes.get("usage", []) for line in (n, "")],
    ]

    # Training data
    entries = training.get("data", [])
    lines += ["## Training data", ""]
    if header.get("datasets"):
        lines += [
            "Prompt sources on the Hub: "
            + ", ".join(f"[{d}](https://huggingface.co/datasets/{d})" for d in header["datasets"])
            + ".",
            "",
        ]
    lines += [
        "Every answer was written by the target itself (regenerated), so the drafter learns the target's own "
        "continuations; prompts that match an evaluation prompt are excluded.",
        "",
        "| folder | prompt sources | temperature | answers | response tokens | note |",
        "|---|---|---:|---:|---:|---|",
    ]
    for e in entries:
        tokens = f"{e['response_tokens']:,}" if e.get("response_tokens") is not None else "–"
        answers = f"{e['answers']:,}" if e.get("answers") is not None else "–"
        temp = f"{e['temperature']:g}" if e.get("temperature") is not None else "–"
        lines.append(
            f"| `{e['folder']}` | `{e.get('sources', '–')}` | {temp} | {answers} | {tokens} | {e.get('note', '')} |"
        )
    lines.append("")
    if training.get("data_notes"):
        lines += [*[f"- {n}" for n in training["data_notes"]], ""]

    # Training procedure
    procedure = training.get("procedure", {})
    store_record = training.get("ngram_store", {})
    commands = [e["command"] for e in entries if e.get("command")]
    commands += [c for c in (procedure.get("command"), store_record.get("command")) if c]
    lines += ["## Training procedure", ""]
    if commands:
        lines += ["```bash", *commands, "```", ""]
    facts_lines = []
    if procedure.get("hardware"):
        software = f" ({procedure['software']})" if procedure.get("software") else ""
        facts_lines.append(f"- Hardware: {procedure['hardware']}{software}")
    if procedure.get("date"):
        facts_lines.append(f"- Date: {procedure['date']}")
    if procedure.get("steps") is not None:
        steps = f"- Steps: {procedure['steps']:,}"
        if procedure.get("sequences_per_step"):
            steps += f" × {procedure['sequences_per_step']} sequences"
        if procedure.get("wall_minutes") is not None:
            steps += f", {procedure['wall_minutes']:g} min of training wall time"
        facts_lines.append(steps)
    if facts_lines:
        stage = f" ({record['version']})" if record.get("version") else ""
        lines += [f"This drafter's stage{stage}:", "", *facts_lines, ""]
    hyper = procedure.get("hyperparameters", {})
    if hyper:
        lines += ["| hyperparameter | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in hyper.items()], ""]
    heldout = procedure.get("heldout", [])
    if heldout:
        lines += ["| step | held-out τ (decode loop) | held-out top-1 at block positions 1, 2, 3 |", "|---:|---:|---|"]
        lines += [
            f"| {h['step']} | {h['tau']:.2f} | {', '.join(f'{a:.2f}' for a in h.get('top1', []))} |" for h in heldout
        ]
        lines.append("")
    lines += [*[f"- {n}" for n in procedure.get("notes", [])]]
    if procedure.get("notes"):
        lines.append("")
    if store_record.get("notes"):
        lines += ["N-gram store:", "", *[f"- {n}" for n in store_record["notes"]], ""]
    stages = training.get("stages", [])
    if stages:
        this = summary_stage(record)
        this["stage"] = (record.get("version") or "this drafter") + " (this drafter)"
        lines += [
            "Stages, each continuing the previous one's drafter (`dflashkit train --init`):",
            "",
            "| stage | date | hardware | started from | data | steps × sequences | wall time |",
            "|---|---|---|---|---|---:|---:|",
        ]
        for s in [*stages, this]:
            steps = f"{s['steps']:,}" if s.get("steps") is not None else "–"
            if s.get("sequences_per_step"):
                steps += f" × {s['sequences_per_step']}"
            wall = f"{s['wall_minutes']:g} min" if s.get("wall_minutes") is not None else "–"
            lines.append(
                f"| {s['stage']} | {s.get('date') or '–'} | {s.get('hardware') or '–'} | "
                f"{s.get('init') or '–'} | {s.get('data') or '–'} | {steps} | {wall} |"
            )
        lines.append("")
    lines += [*[f"- {n}" for n in training.get("notes", [])]]
    if training.get("notes"):
        lines.append("")

    # Evaluation
    lines += evaluation_section(bench, method, notes.get("evaluation", []), paths)

    # Limitations
    lines += limitations_section(bench, method, notes.get("limitations", []))
    return "\n".join(lines).rstrip("\n") + "\n"


def evaluation_section(bench: dict[str, Any], method: str, extra: list[str], paths: Paths) -> list[str]:
    m, st, v = bench["machine"], bench.get("settings", {}), bench.get("versions", {})
    commit = bench.get("commit") or {}
    sha = (commit.get("sha") or "")[:10] or "unknown"
    if commit.get("dirty"):
        sha += " (with uncommitted changes)"
    temps = list(dict.fromkeys(r["temperature"] for r in bench["summary"]))
    rows = rows_of(bench, method)
    machine = f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('torch_threads')} torch threads"
    if m.get("cpu_kernels"):
        machine += f", dflashkit's CPU kernels {m['cpu_kernels']}"
    if m.get("gpu") and st.get("device", "cpu") != "cpu":
        machine += f", GPU {m['gpu']}"
    load = st.get("other_load_cores") or {}
    if load.get("start") is not None:
        machine += f"; other processes kept {load['start']:.1f} cores busy as the run started"
    lines = [
        "## Evaluation",
        "",
        f"`{paths.command(bench['command'])}`" if bench.get("command") else "(a `dflashkit bench` run from Python)",
        "",
        f"- Date: {str(bench.get('created', '?'))[:10]}; dflashkit {v.get('dflashkit', '?')} at commit {sha}, "
        f"torch {v.get('torch', '?')}, transformers {v.get('transformers', '?')}",
        f"- Machine: {machine}",
        f"- Questions: {', '.join(f'{EVAL_SETS.get(k, (k,))[0]} {n}' for k, n in bench['datasets'].items())} "
        f"(first turns{'' if st.get('max_turns') == 1 else ' and later ones'}), at most {st.get('max_new_tokens')} "
        f"new tokens each; target {st.get('target', '?')} in {st.get('dtype', '?')}",
        f"- Method `{method}` against `{bench['baseline']}` (plain decoding in the same loop); speedup = plain "
        "decoding's time per output token over this method's (TPOT, prefill excluded: the DFlash paper's "
        "definition); τ = tokens per target pass",
        "",
    ]
    header = "| data set |" + "".join(
        f" τ ({temperature_label(t)}) | speedup ({temperature_label(t)}) |" for t in temps
    )
    lines += [header, "|---|" + "---:|---:|" * len(temps)]
    for dataset in bench["datasets"]:
        cells = []
        for t in temps:
            row = rows.get((dataset, t), {})
            cells += [fmt(row.get("tau")), fmt(row.get("speedup_tpot"), ".2f", "×")]
        lines.append(f"| {EVAL_SETS.get(dataset, (dataset,))[0]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Every dflashkit method of the run:",
        "",
        "| temperature | data set | method | τ | tok/s | speedup (TPOT) | speedup (tok/s) |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for row in bench["summary"]:
        if row["family"] == "dflashkit":
            lines.append(
                f"| {row['temperature']:g} | {row['dataset']} | {row['method']} | {fmt(row['tau'])} | "
                f"{fmt(row['tokens_per_s'], '.1f')} | {fmt(row['speedup_tpot'], '.2f', '×')} | "
                f"{fmt(row.get('speedup_tokens_per_s'), '.2f', '×')} |"
            )
    names = {row["method"] for row in bench["summary"]}
    lines.append("")
    if any(n.startswith("dflash-lookup") for n in names):
        lines += [
            "`dflash-lookup-*`: this drafter plus prompt lookup (a step whose text ends with a repeated n-gram copies "
            "its continuation, from the text or the n-gram store, instead of drafting; those tokens count in τ); "
            "`-auto`: block size chosen per step; `-bN`: block size N. dflashkit's default is `dflash-lookup-auto`.",
            "",
        ]
    own = [d for d in bench.get("divergences", []) if d.get("family", "dflashkit") == "dflashkit"]
    compared = sum(row.get("compared", 0) for row in bench["summary"] if row["method"] == method)
    identical = sum(row.get("identical", 0) for row in bench["summary"] if row["method"] == method)
    lines += [
        f"Outputs of `{method}` identical to plain decoding's (greedy, and seeded sampling where compared): "
        f"{identical} of {compared}. Departures of any dflashkit method from plain decoding: {len(own)}, of which "
        f"not at a bf16 tie: {bench.get('non_tie_divergences_in_dflashkit', 0)}.",
        "",
        *[line for n in extra for line in (n, "")],
    ]
    return lines


def questions(bench: dict[str, Any]) -> str:
    counts = sorted(set(bench["datasets"].values()))
    n = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{n} question{'' if counts == [1] else 's'} per set"


def limitations_section(bench: dict[str, Any], method: str, extra: list[str]) -> list[str]:
    rows = rows_of(bench, method)
    greedy = [r["tau"] for (_, t), r in rows.items() if t == 0 and r.get("tau") is not None]
    lines = ["## Limitations", ""]
    if greedy and max(greedy) < PAPER_TAU:
        lookup = ", prompt lookup included" if "lookup" in method else ""
        lines.append(
            f"- Acceptance is modest: greedy τ {min(greedy):.2f}-{max(greedy):.2f} in the evaluation above "
            f"(`{method}`{lookup}), far below the τ of about {PAPER_TAU:g} that the DFlash paper reports with 8B "
            "targets and their drafters."
        )
    for t in sorted({t for (_, t) in rows if t != 0}):
        pairs = []
        for d in bench["datasets"]:
            g, s = rows.get((d, 0), {}).get("speedup_tpot"), rows.get((d, t), {}).get("speedup_tpot")
            if g and s:
                pairs.append((EVAL_SETS.get(d, (d,))[0], g, s))
        if pairs:
            less = all(s < g for _, g, s in pairs)
            lines.append(
                ("- Sampling gains less than greedy decoding" if less else "- Sampled and greedy speedups differ")
                + f": at T={t:g} the speedup is "
                + ", ".join(f"{s:.2f}× against {g:.2f}× greedy ({d})" for d, g, s in pairs)
                + "."
            )
    lines += [
        "- Specific to its target: it reads the target's hidden states and uses its tokenizer, embedding and LM "
        "head; another model, a fine-tune or another tokenizer will not work with it.",
        f"- The speedups depend on the machine and its load: the figures above come from {questions(bench)} on one "
        "machine; `dflashkit bench` measures them on yours.",
        *[f"- {n}" for n in extra],
        "",
    ]
    return lines


# ---- main ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--run",
        type=Path,
        help="training run folder (drafter/, run_config.json, train_log.jsonl): "
        "package its drafter into --out and write the card there",
    )
    mode.add_argument(
        "--refresh",
        type=Path,
        metavar="DRAFTER",
        help="a drafter folder whose card has a "
        "`dflashkit:` record in its header: rewrite the card from that record and --bench",
    )
    ap.add_argument("--bench", required=True, type=Path, help="results.json of a `dflashkit bench` run of this drafter")
    ap.add_argument("--out", type=Path, help="with --run: the drafter folder to write")
    ap.add_argument("--base-model", help="the target's Hub id (default: from the card, else the target's name)")
    ap.add_argument(
        "--method",
        help="the bench method whose τ and speedup go into model-index "
        f"(default: the first of {', '.join(PREFERRED_METHODS)} that ran)",
    )
    ap.add_argument("--name", help="model-index name (default: dflash-drafter-<folder name>)")
    ap.add_argument(
        "--shipped",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write the card of a drafter that ships inside dflashkit (default: when the folder is in "
        "dflashkit/drafters)",
    )
    ap.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="with --run: show path OLD (and what lies under it) as NEW in the card, e.g. a data folder "
        "as data/greedy; repeatable",
    )
    ap.add_argument("--drafter-version", help="with --run: a name for this drafter's stage, e.g. v16")
    ap.add_argument("--date", help="with --run: the training date, YYYY-MM-DD (default: the log's last write)")
    ap.add_argument("--hardware", help="with --run: what it trained on (default: as run_config.json records it)")
    ap.add_argument(
        "--dataset",
        action="append",
        default=[],
        help="with --run: a Hub data set the prompts came from, besides those its sources name; repeatable",
    )
    ap.add_argument(
        "--data-note",
        action="append",
        default=[],
        help="with --run: a line on how the data was made that no file records; repeatable, shown as written",
    )
    ap.add_argument(
        "--training-note",
        action="append",
        default=[],
        help="with --run: a line on the training that no file records; repeatable, shown as written",
    )
    ap.add_argument("--store-command", help="with --run: the `dflashkit ngram-store` command that built the store")
    ap.add_argument(
        "--store-note", action="append", default=[], help="with --run: a line on the n-gram store; repeatable"
    )
    ap.add_argument(
        "--note",
        action="append",
        default=[],
        metavar="SECTION: TEXT",
        help=f"with --run: a line for a section ({', '.join(NOTE_SECTIONS)}); repeatable",
    )
    ap.add_argument(
        "--previous-card",
        type=Path,
        help="with --run: the card of the drafter this run started from "
        "(--init): its stages, and its own as the last of them, become this card's earlier stages",
    )
    args = ap.parse_args(argv)
    if args.run is not None and args.out is None:
        ap.error("--run needs --out")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    paths = Paths(args.rename)
    bench = json.loads(args.bench.expanduser().read_text())
    if args.refresh is not None:
        folder = args.refresh.expanduser()
        card = folder / "README.md"
        if not card.is_file():
            raise SystemExit(f"{folder}: no README.md to refresh")
        old, _ = split_card(card.read_text())
        if "training" not in (old.get("dflashkit") or {}):
            raise SystemExit(f"{card}: no `dflashkit:` record with `training` in its header: nothing to refresh from")
        used = str(bench.get("settings", {}).get("drafter") or "")
        if used and used != "auto" and Path(used).name != folder.resolve().name:
            print(
                f"note: the bench ran the drafter {paths(used)}, not {folder}: the card shows its figures",
                file=sys.stderr,
            )
        record, datasets = old["dflashkit"], list(old.get("datasets") or [])
        base = args.base_model or old.get("base_model")
        name = args.name or (old.get("model-index") or [{}])[0].get("name")
    else:
        folder = args.out.expanduser()
        record, datasets = record_from_run(args, paths)
        base = (
            args.base_model or HUB_IDS.get(record["target"]) or (record["target"] if "/" in record["target"] else None)
        )
        name = args.name
        run = args.run.expanduser()
        size = sum((run / "drafter" / f).stat().st_size for f in DRAFTER_FILES if (run / "drafter" / f).is_file())
        size += (folder / NGRAM_STORE).stat().st_size if (folder / NGRAM_STORE).is_file() else 0
        if size > MAX_BYTES:
            raise SystemExit(f"the drafter is {size / 1e6:.1f} MB ({size / 2**20:.1f} MiB), over the 40 MB limit")
        folder.mkdir(parents=True, exist_ok=True)
        for f in DRAFTER_FILES:
            if (run / "drafter" / f).is_file():
                shutil.copy2(run / "drafter" / f, folder / f)
    method = chosen_method(bench, args.method)
    header: dict[str, Any] = {"license": "apache-2.0"}
    if base:
        header["base_model"] = base
    header.update({"library_name": "dflashkit", "pipeline_tag": "text-generation", "tags": TAGS})
    if datasets:
        header["datasets"] = datasets
    header["model-index"] = model_index(name or f"dflash-drafter-{folder.resolve().name}", bench, method)
    header["dflashkit"] = record
    shipped = args.shipped if args.shipped is not None else folder.resolve().parent.name == "drafters"
    body = render(header, folder, bench, method, paths, shipped)
    (folder / "README.md").write_text(join_card(header, body))
    for path in sorted(paths.shortened):
        print(f"note: {path} is shown by its name alone; --rename {path}=NAME chooses how", file=sys.stderr)
    print(f"wrote {folder / 'README.md'} (model-index from `{method}`)")


if __name__ == "__main__":
    main()
