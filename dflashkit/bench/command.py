"""`dflashkit bench`: the command line of the benchmark (options, model loading, method list, outputs)."""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import pathlib
import re
import shlex
import sys
from typing import TYPE_CHECKING, Any

from dflashkit.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

# the parser is built by every `dflashkit` call, --help included: what it needs imports no torch (torch, the tree
# check and the kernels are imported where a bench runs)
QUANT_METHODS = ("int8", "int4")  # dflashkit.kernels.quantize.METHODS (tests/cli/test_main.py checks they agree)


def check_budget(budget: object) -> int:
    """dflashkit.decoding.tree.check_budget, imported when a bench's settings are read."""
    from dflashkit.decoding.tree import check_budget as check

    return check(budget)


METHODS = ("ar", "dflash", "dflash-lookup", "lookup", "hf", "hf-pld", "hf-assisted", "llama.cpp", "llama-server")
DEFAULTS = {
    "datasets": "mt-bench,humaneval,math500",
    "limit": 10,
    "max_new_tokens": 256,
    "max_turns": None,
    "temperatures": "0,1",
    "block_sizes": "4,8,16,auto",
}
# --quick's starting point (first turns, 2 questions per set); dflashkit.bench.quick cuts it to what the CPU's measured
# speed fits in about 5 minutes
QUICK = {
    "datasets": "mt-bench,humaneval,math500",
    "limit": 2,
    "max_new_tokens": 64,
    "max_turns": 1,
    "temperatures": "0,1",
    "block_sizes": "4,8,16,auto",
}
SMOLLM_NO_DRAFT = (
    "no draft model with the target's tokenizer (SmolLM2-135M is the smallest of its family); pass --assistant "
    "PATH, or bench --target qwen2.5-coder-1.5b, whose 0.5B sibling is assembled from packages"
)


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to the dflashkit command line."""
    b = sub.add_parser(
        "bench",
        help="benchmark DFlash against autoregressive decoding and the alternatives (τ, speed, losslessness)",
        description="Run every method on every prompt, interleaved per prompt after a warm-up: autoregressive "
        "decoding in dflashkit's loop (the baseline), DFlash at several block sizes, transformers' generate "
        "(plain, prompt lookup, assisted), llama.cpp (llama-cpp-python, and llama-server: plain bf16 and Q4_1 GGUFs, "
        "and its own DFlash with the drafter exported to GGUF). Writes results.json, summary.md and PNG plots. Exits 1 "
        "if a dflashkit method's greedy output parts from the baseline's other than at a bf16 tie.",
    )
    b.add_argument(
        "--datasets",
        default=None,
        help="comma-separated: mt-bench, humaneval, math500, jsonl:PATH "
        f"(FastChat / Spec-Bench questions), hf:NAME[:SPLIT[:FIELD]] (default: {DEFAULTS['datasets']})",
    )
    b.add_argument(
        "--limit",
        type=int,
        default=None,
        help=f"questions per data set, a seeded random subset; 0 = all (default: {DEFAULTS['limit']})",
    )
    b.add_argument("--seed", type=int, default=0, help="subset and sampling seed")
    b.add_argument("--max-new-tokens", type=int, default=None, help=f"per turn (default: {DEFAULTS['max_new_tokens']})")
    b.add_argument("--max-turns", type=int, default=None, help="turns per question (default: all)")
    b.add_argument("--temperatures", default=None, help="comma-separated; 0 = greedy (default: 0,1)")
    b.add_argument(
        "--sampler",
        choices=["rejection", "coupled"],
        default="rejection",
        help="dflashkit's sampler at temperature > 0 (default: rejection); with 'coupled' its sampled "
        "outputs are checked token for token against the baseline's, as greedy ones are, and the adaptive "
        "methods verify token trees as seeded generations do by default",
    )
    b.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of {', '.join(METHODS)}; the baseline 'ar' always runs (default: all)",
    )
    b.add_argument(
        "--block-sizes", default=None, help="DFlash block sizes; 'auto' = chosen per step (default: 4,8,16,auto)"
    )
    b.add_argument(
        "--trees",
        default=None,
        help="token-tree node budgets (comma-separated): each adds, per block size, "
        "dflash[-lookup]-treeN at the drafter's own block size, -auto-treeN with 'auto' (copies and depths "
        "sized per step), -bB-treeN at another (default: none)",
    )
    b.add_argument(
        "--target",
        default=None,
        help="HF model id, local folder or qwen2.5-coder-1.5b (assembled from "
        "packages); default: embedded SmolLM2-135M-Instruct",
    )
    b.add_argument(
        "--drafter",
        type=_drafter_arg,
        default=None,
        help="a shipped drafter's name (`dflashkit drafters` lists them), a drafter folder, 'untrained' (random: "
        "τ≈1) or 'none'; default: the drafter shipped for the target; without one the DFlash methods are skipped",
    )
    b.add_argument(
        "--lookup-store",
        default=None,
        metavar="PATH",
        help="with the `lookup` method, also run `lookup-store`: prompt lookup that drafts from this n-gram store of "
        "the target's answers (an ngram_store.safetensors, or a folder holding one, as `dflashkit ngram-store --out` "
        "writes) where the text has no repeat of its own (default: none)",
    )
    b.add_argument(
        "--assistant",
        default="auto",
        help="draft model for transformers' assisted generation: a folder, "
        "hub id, qwen2.5-coder-0.5b, 'none', or 'auto' (the known sibling of the target)",
    )
    b.add_argument("--gguf", default=None, help="GGUF for the llama.cpp peer (default: the target's, when known)")
    b.add_argument(
        "--llama-server",
        default=None,
        help="llama-server binary for the llama-server peers (default: "
        "$DFLASHKIT_LLAMA_SERVER, else the one `scripts/get_llama_cpp.sh --build` builds, else on PATH)",
    )
    b.add_argument("--prompt-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens of hf-pld")
    b.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="number format of every model: bfloat16 or float32 (twice the memory)",
    )
    b.add_argument(
        "--quantize",
        choices=["none", *QUANT_METHODS],
        default="none",
        help="int8 / int4: every dflashkit method runs on a weight-only quantized target (int8: per-channel scales; "
        "int4: 4-bit blocks of 32 with int8 activations, CPU); tokens are compared with the quantized baseline, "
        "never with the bf16 model",
    )
    b.add_argument(
        "--eager",
        "--no-compile",
        dest="eager",
        action="store_true",
        help="dflashkit methods on the eager path (plain nn.Linear layers, no prepacked oneDNN weights)",
    )
    b.add_argument("--device", default="cpu", help="where the models run: cpu, cuda, cuda:N, ...")
    b.add_argument("--threads", type=int, default=None, help="CPU threads for torch and llama.cpp (default: torch's)")
    quick = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items() if k != "datasets")
    b.add_argument(
        "--quick",
        action="store_true",
        help=f"a run sized to about 5 minutes on this CPU: from {quick}, it times short generations and cuts "
        "slow peers, then tokens, block sizes, temperatures and questions until the estimate fits (options given "
        "explicitly are kept); it prints what it chose and why",
    )
    b.add_argument("--out", default=None, help="output folder (default: runs/bench-<time>)")
    b.add_argument("--json", default=None, help="results JSON path (default: OUT/results.json)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)
    return b


def _drafter_arg(text: str) -> str:
    """--drafter: a shipped drafter's short name becomes its folder (unless a path of that name exists: a path
    wins); folders, none and untrained stay as given."""
    from dflashkit.drafter.registry import drafter_name_or_path

    return drafter_name_or_path(text, keywords=("none", "untrained"))


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidInputError(f"--{what}: expected comma-separated numbers, got {text!r}") from None


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidInputError(f"--{what}: expected comma-separated integers, got {text!r}") from None


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    """Option values after --quick / defaults (explicit options win)."""
    preset = QUICK if args.quick else DEFAULTS
    out = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in preset.items()}
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise InvalidInputError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    out["methods"] = ["ar"] + [m for m in methods if m != "ar"]
    out["temperatures"] = _floats(out["temperatures"], "temperatures")
    sizes = [b.strip() for b in str(out["block_sizes"]).split(",") if b.strip()]
    auto = ["auto"] if "auto" in sizes else []
    out["block_sizes"] = _ints(",".join(b for b in sizes if b != "auto"), "block-sizes") + auto
    if any(b < 2 for b in out["block_sizes"] if b != "auto"):
        raise InvalidInputError(f"--block-sizes must be at least 2, got {out['block_sizes']}")
    out["datasets"] = [d.strip() for d in out["datasets"].split(",") if d.strip()]
    from dflashkit.bench.datasets import PACKAGED

    odd = [
        d
        for d in out["datasets"]
        if d not in PACKAGED and not d.startswith(("jsonl:", "hf:")) and not d.endswith(".jsonl")
    ]
    if odd:  # before any model loads
        raise InvalidInputError(
            f"unknown data set(s) {odd}: use {', '.join(PACKAGED)}, jsonl:PATH or hf:NAME[:SPLIT[:FIELD]]"
        )
    out["trees"] = [check_budget(n) for n in _ints(args.trees, "trees")] if args.trees else []
    return out


def resolve_target(name: str | None) -> tuple[str | None, str]:
    """(what load_target gets, a label): packaged models are assembled and converted first."""
    from dflashkit.target.packaged import model_folder, packaged

    pm = packaged(name)
    if pm is not None:
        return str(model_folder(pm)), pm.name
    from dflashkit.target.loading import DEFAULT_TARGET

    return name, name or DEFAULT_TARGET


def resolve_drafter(choice: str | None, target: str | None, model: Any) -> tuple[Any, str | None, str]:
    """(drafter or None, its label, why not): a folder, 'untrained', or the shipped one."""
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.drafter.identity import drafter_config_for
    from dflashkit.drafter.network import DFlashDrafter
    from dflashkit.drafter.registry import shipped_drafter

    if choice == "none":
        return None, None, "disabled (--drafter none)"
    if choice == "untrained":
        import torch

        torch.manual_seed(0)
        drafter = DFlashDrafter(drafter_config_for(model, num_layers=3)).to(model.dtype).eval()
        return drafter, "untrained (random, τ≈1)", ""
    if choice is None:
        path = shipped_drafter(target)
        if path is None:
            return (
                None,
                None,
                (
                    "no trained drafter ships for this target yet: pass --drafter PATH, or --drafter "
                    "untrained to exercise the speculative path"
                ),
            )
        choice = str(path)
    return load_drafter(choice, dtype=model.dtype, device=model.device), choice, ""


def resolve_assistant(choice: str, target_label: str, dtype: torch.dtype, device: str) -> tuple[Any, Any, str, str]:
    """(assistant model, its tokenizer, label, why not) for transformers' assisted generation."""
    from dflashkit.target.loading import DEFAULT_TARGET, load_target
    from dflashkit.target.packaged import AssetError, model_folder, packaged

    if choice == "none":
        return None, None, "", "disabled (--assistant none)"
    if choice == "auto":
        pm = packaged(target_label)
        if pm is None or pm.draft is None:
            why = (
                SMOLLM_NO_DRAFT
                if target_label == DEFAULT_TARGET
                else (f"no draft model with the tokenizer of {target_label} is known: pass --assistant PATH")
            )
            return None, None, "", why
        choice = pm.draft
    pm = packaged(choice)
    try:
        source = str(model_folder(pm)) if pm is not None else choice
    except AssetError as e:
        return None, None, "", str(e)
    model, tok = load_target(source, dtype=dtype, device=device)
    return model, tok, pm.name if pm else choice, ""


def build_methods(
    session: Any,
    settings: dict[str, Any],
    args: argparse.Namespace,
    target_label: str,
    threads: int,
    log_dir: pathlib.Path | None = None,
) -> tuple[list[Any], str]:
    """The methods asked for (unavailable ones as placeholders that the runner lists as skipped)."""
    from dflashkit.bench.assets import target_gguf
    from dflashkit.bench.methods import KERNELS, Autoregressive, DFlash, PromptLookup, Unavailable
    from dflashkit.bench.peers import LlamaCpp, TransformersGenerate

    wanted = settings["methods"]
    methods: list[Any] = [Autoregressive(session)]
    drafter_label = "none"
    drafter, drafter_path, no_drafter = None, None, "not asked for"
    if {"dflash", "dflash-lookup", "llama-server"} & set(wanted):
        drafter, drafter_path, no_drafter = resolve_drafter(args.drafter, args.target, session.model)
    for family, lookup in (("dflash", False), ("dflash-lookup", True)):
        if family not in wanted:
            continue
        if drafter is None:
            methods += [
                Unavailable(f"{family}-b{b}", "dflashkit", no_drafter, note=f"dflashkit decode loop, block size {b}")
                for b in settings["block_sizes"]
            ]
        else:
            drafter_label = drafter_path
            methods += [DFlash(session, drafter, b, drafter_path, lookup=lookup) for b in settings["block_sizes"]]
            methods += [
                DFlash(session, drafter, b, drafter_path, lookup=lookup, tree=n)
                for n in settings["trees"]
                for b in settings["block_sizes"]
            ]
    if "lookup" in wanted:
        methods.append(PromptLookup(session))
        if args.lookup_store:  # beside lookup alone, interleaved with it: what the store adds
            methods.append(PromptLookup(session, store=load_lookup_store(args.lookup_store)))
    if "hf" in wanted:
        methods.append(TransformersGenerate(session, "plain"))
    if "hf-pld" in wanted:
        methods.append(TransformersGenerate(session, "prompt-lookup", prompt_lookup_tokens=args.prompt_lookup_tokens))
    if "hf-assisted" in wanted:
        model, tok, label, why = resolve_assistant(args.assistant, target_label, session.dtype, args.device)
        if model is None:
            methods.append(
                Unavailable("hf-assisted", "transformers", why, KERNELS, "transformers generate(assistant_model=...)")
            )
        else:
            methods.append(
                TransformersGenerate(
                    session, "assisted", assistant=model, assistant_tokenizer=tok, assistant_label=label
                )
            )
    if "llama.cpp" in wanted:
        if importlib.util.find_spec("llama_cpp") is None:  # says so itself; don't assemble a GGUF for nothing
            methods.append(LlamaCpp(args.gguf, threads=threads))
        else:
            gguf, why = (pathlib.Path(args.gguf), "") if args.gguf else target_gguf(args.target)
            methods.append(LlamaCpp(gguf, threads=threads, vocab_size=session.adapter.vocab_size, missing_gguf=why))
    if "llama-server" in wanted:
        block = drafter.block_size if drafter is not None else 16
        path = drafter_path if drafter is not None else None
        methods += llama_server_methods(args, path, no_drafter, block, threads, log_dir)
    return methods, drafter_label


def load_lookup_store(path: str | None) -> Any:
    """The n-gram store at ``path`` (a file, or a folder holding ngram_store.safetensors), None without one."""
    if path is None:
        return None
    from dflashkit.drafter.ngram_store import NgramStore, find_store

    p = pathlib.Path(path).expanduser()
    file = find_store(p) if p.is_dir() else p
    if file is None or not file.is_file():
        raise InvalidInputError(f"--lookup-store {path}: no n-gram store there (make one with `dflashkit ngram-store`)")
    return NgramStore.load(file)


def llama_server_methods(
    args: argparse.Namespace,
    drafter: str | None,
    no_drafter: str,
    block_size: int,
    threads: int,
    log_dir: pathlib.Path | None,
) -> list[Any]:
    """llama-server on the target's bf16 GGUF and on its packaged quantized GGUF (plain decoding), llama.cpp's
    DFlash on the bf16 GGUF with the drafter exported to GGUF (all converted once by llama.cpp's converter), and, for
    a packaged target with a smaller sibling, llama.cpp's speculative decoding of the quantized GGUF with that
    sibling's GGUF as the draft model."""
    from dflashkit.bench.assets import draft_model_gguf, drafter_gguf, target_bf16_gguf, target_gguf
    from dflashkit.bench.methods import KERNELS, OTHER_WEIGHTS
    from dflashkit.bench.peers import LlamaServerPeer
    from dflashkit.interop.llama_server import LlamaServerError, find_llama_server

    names = ("llama-server-bf16", "llama-server-q", f"llama-server-dflash-b{block_size}")
    try:
        binary = find_llama_server(args.llama_server)
        missing = (
            ""
            if binary
            else (
                "no llama-server binary: build one with `bash scripts/get_llama_cpp.sh --build`, "
                "or pass --llama-server PATH"
            )
        )
    except LlamaServerError as e:
        binary, missing = None, str(e)
    sibling, why_sibling = draft_model_gguf(args.target)
    if missing:
        names = (*names, "llama-server-q-draft") if sibling else names
        return [LlamaServerPeer(n, None, None, threads=threads, comparable=KERNELS, missing=missing) for n in names]
    bf16, why_bf16 = target_bf16_gguf(args.target)
    quant, why_quant = (pathlib.Path(args.gguf), "") if args.gguf else target_gguf(args.target)
    names = (names[0], f"llama-server-{re.split(r'[-.]', quant.stem)[-1].lower()}" if quant else names[1], names[2])
    draft, why_draft = drafter_gguf(drafter, args.target) if drafter else (None, no_drafter)
    common = {"threads": threads, "log_dir": log_dir}
    return [
        LlamaServerPeer(names[0], binary, bf16, comparable=KERNELS, missing=why_bf16, **common),
        LlamaServerPeer(names[1], binary, quant, comparable=OTHER_WEIGHTS, missing=why_quant, **common),
        LlamaServerPeer(
            names[2],
            binary,
            bf16,
            drafter_gguf=draft,
            block_size=block_size,
            comparable=KERNELS,
            missing=why_bf16 or why_draft,
            **common,
        ),  # llama.cpp's DFlash runs on the bf16 GGUF
        *(
            [
                LlamaServerPeer(
                    f"{names[1]}-draft",
                    binary,
                    quant,
                    draft_model_gguf=sibling,
                    comparable=OTHER_WEIGHTS,
                    missing=why_quant,
                    **common,
                )
            ]
            if sibling  # a packaged target's smaller sibling: llama.cpp's classic draft-model speculation
            else []
        ),
    ]


def cmd_bench(args: argparse.Namespace) -> int:
    import time

    started = time.perf_counter()  # --quick counts loading against its time budget
    import torch
    from transformers.utils import logging as hf_logging

    from dflashkit.bench.methods import TargetSession
    from dflashkit.bench.report import as_json, summary_table, write_outputs
    from dflashkit.bench.runner import BenchConfig, run_bench
    from dflashkit.cpuload import apply_threads, busy_cores, on_cpu
    from dflashkit.target.loading import load_target

    settings = settings_from(args)
    cpu = on_cpu(args.device)
    load_at_start = busy_cores(0.2) if cpu else None  # other processes' load: timings on a shared machine
    apply_threads(args.threads, args.device, load_at_start)  # without --threads: a busy-CPU note
    threads = torch.get_num_threads()
    config = BenchConfig(
        datasets=settings["datasets"],
        limit=settings["limit"],
        seed=args.seed,
        max_new_tokens=settings["max_new_tokens"],
        temperatures=settings["temperatures"],
        max_turns=settings["max_turns"],
        progress=not args.no_progress,
        sampler=args.sampler,
    )
    dtype = getattr(torch, args.dtype)
    hf_logging.set_verbosity_error()  # transformers' deprecation chatter would break the progress bar
    source, target_label = resolve_target(args.target)
    quantize = args.quantize
    print(f"Loading {target_label} ({args.dtype}{f', weight-only {quantize}' if quantize else ''})...", file=sys.stderr)
    model, tokenizer = load_target(source, dtype=dtype, device=args.device, quantize=quantize)
    session = TargetSession(model, tokenizer, fast=not args.eager)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = pathlib.Path(args.out) if args.out else pathlib.Path("runs") / f"bench-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    methods, drafter_label = build_methods(session, settings, args, target_label, threads, log_dir=out)
    quick = None
    try:
        if args.quick:  # sized to this CPU: measure, then cut what would not fit the time budget
            from dflashkit.bench.quick import apply_quick

            methods, quick = apply_quick(args, session, methods, settings, config, started, _stderr, METHODS)
        result = run_bench(session, methods, config)
    finally:
        for m in methods:  # servers and peers' models go, even when the run fails
            m.close()
    result.extra["settings"] = {
        "target": target_label,
        "drafter": drafter_label,
        "dtype": args.dtype,
        "quantize": quantize,
        "target_weights": session.adapter.weights,
        "engine": session.adapter.engine,
        "device": args.device,
        "threads": threads,
        "quick": args.quick,
        "quick_plan": quick.as_dict() if quick is not None else None,  # what --quick measured, chose and why
        "methods": settings["methods"],
        "block_sizes": settings["block_sizes"],
        "trees": settings["trees"],
        "other_load_cores": {"start": load_at_start, "end": busy_cores(0.2) if cpu else None},
    }
    argv = getattr(args, "argv", None)
    result.extra["command"] = "dflashkit " + " ".join(shlex.quote(a) for a in argv) if argv else None
    data = as_json(result)
    paths = write_outputs(data, out, args.json)
    for t in config.temperatures:
        print(f"\n{'greedy' if t == 0 else f'temperature {t:g}'}:\n{summary_table(data, t)}")
    print("\nwrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    if quick is not None:
        took = time.perf_counter() - started
        _stderr(f"--quick: took {took / 60:.1f} min in all (estimated {(quick.estimate_s + quick.spent_s) / 60:.1f})")
    if result.failures:
        print(
            f"error: {len(result.failures)} non-tie divergence(s) of dflashkit methods from the baseline: "
            "a bug, please report it (details in summary.md)",
            file=sys.stderr,
        )
    return result.exit_code


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench_parser() -> argparse.ArgumentParser:
    """A stand-alone parser of the bench options (for tests and embedding)."""
    parser = argparse.ArgumentParser(prog="dflashkit")
    sub = parser.add_subparsers()
    return add_bench_parser(sub)
