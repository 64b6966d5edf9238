"""Publish `dflashkit bench` runs as data and keep the pages that quote them current.

Each published run is a folder ``docs/benchmarks/<date>-<cpu>/`` holding what ``dflashkit bench`` wrote
(results.json with the machine, versions, commit and command; summary.md; the PNG plots). The region between
``<!-- bench-results:start -->`` and ``<!-- bench-results:end -->`` in docs/performance.md, and the one between
``<!-- results-table:start -->`` and ``<!-- results-table:end -->`` in README.md, are generated from the newest
run of each CPU class (README: the newest run of all), never typed.

    python scripts/bench_pages.py --add OUT_DIR     # copy a bench output folder in, then regenerate the pages
    python scripts/bench_pages.py --write           # regenerate the pages from docs/benchmarks/
    python scripts/bench_pages.py --check           # exit 1 when a page differs from what the data says (tests)

Publishing rewrites absolute paths inside the copied text files: the repository's root becomes a relative path and
the home directory ``~``, so that a published run names no folder of the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from dflashkit.bench.metrics import RunRow, speedup_tpot_per_question
from dflashkit.bench.report import summary_table

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "benchmarks"
PERFORMANCE = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
REGIONS = {PERFORMANCE: "bench-results", README: "results-table"}
DATASETS = {"mt-bench": "MT-Bench", "humaneval": "HumanEval", "math500": "MATH-500"}
PLOTS = ("speedup.png", "acceptance.png", "accepted_lengths.png")


def cpu_slug(machine: dict[str, Any]) -> str:
    """A short, stable name of the CPU class: vendor, then the kernels dflashkit's decoding ran on."""
    vendor = "amd" if "AMD" in machine.get("cpu", "") else "intel" if "Intel" in machine.get("cpu", "") else "cpu"
    if machine.get("gpu"):
        return re.sub(r"[^a-z0-9]+", "-", machine["gpu"].lower()).strip("-")
    kernels = re.sub(r"[^a-z0-9]+", "", str(machine.get("cpu_kernels", "")).lower()) or "onednn"
    return f"{vendor}-{kernels}"


def _amd_core(cpu: str) -> str | None:
    """The core generation of an AMD CPU named by family and model, as /proc/cpuinfo gives them in a VM."""
    m = re.search(r"family (\d+), model (\d+)", cpu)
    if not m or "AMD" not in cpu:
        return None
    family, model = int(m[1]), int(m[2])
    if family == 23:
        return "Zen 1" if model < 0x30 else "Zen 2"
    if family == 25:
        return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "Zen 3"
    if family == 26:
        return "Zen 5"
    return None


def cpu_label(machine: dict[str, Any]) -> str:
    if machine.get("gpu"):
        return machine["gpu"]
    cpu = machine.get("cpu", "CPU")
    core = _amd_core(cpu)
    name = cpu.replace(" (", f" {core} (", 1) if core and core not in cpu else cpu
    return f"{name}, {machine.get('cores', '?')} cores, {machine.get('cpu_kernels', '?')} kernels"


def load(run: Path) -> dict[str, Any]:
    return json.loads((run / "results.json").read_text())


def published_runs() -> list[Path]:
    """Every run under docs/benchmarks/, newest first (folder names start with the date)."""
    return sorted((p for p in RUNS.glob("*/results.json")), key=lambda p: p.parent.name, reverse=True)


def newest_per_class() -> list[Path]:
    seen: dict[str, Path] = {}
    for path in published_runs():
        seen.setdefault(cpu_slug(load(path.parent)["machine"]), path.parent)
    return list(seen.values())


def _summary(data: dict[str, Any]) -> dict[tuple[float, str, str], dict[str, Any]]:
    return {(s["temperature"], s["dataset"], s["method"]): s for s in data["summary"]}


def _dflashkit_method(data: dict[str, Any]) -> str:
    """The method that is dflashkit's default: drafter + prompt lookup, block size chosen per step."""
    names = [m["name"] for m in data["methods"] if m.get("status") == "ran"]
    for preferred in ("dflash-lookup-auto", "dflash-auto"):
        if preferred in names:
            return preferred
    return next(n for n in names if n.startswith("dflash"))


def _peers(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(method, column title) of the peers that ran, in a fixed order."""
    ran = {m["name"] for m in data["methods"] if m.get("status") == "ran"}
    out = [("ar", "vs plain (dflashkit)")]
    out += [(n, "vs llama.cpp bf16") for n in sorted(ran) if n == "llama-server-bf16"]
    out += [
        (n, f"vs llama.cpp {n.removeprefix('llama-server-').upper()}")
        for n in sorted(ran)
        if n[:14] == "llama-server-q"
    ]
    out += [(n, "vs llama.cpp's DFlash") for n in sorted(ran) if n.startswith("llama-server-dflash")]
    out += [(n, "vs `generate`") for n in sorted(ran) if n == "hf-generate"]
    return out


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _f(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _when(data: dict[str, Any]) -> str:
    commit = (data.get("commit") or {}).get("sha", "")[:7]
    dirty = " (uncommitted changes)" if (data.get("commit") or {}).get("dirty") else ""
    version = data["versions"].get("dflashkit")
    return f"{data['created'][:10]}, dflashkit {version} at {commit}{dirty}"


def _rows(data: dict[str, Any], method: str, temperature: float, dataset: str) -> list[RunRow]:
    names = {f.name for f in fields(RunRow)}
    return [
        RunRow(**{k: v for k, v in r.items() if k in names})
        for r in data["runs"]
        if r["method"] == method and r["temperature"] == temperature and r["dataset"] == dataset
    ]


def speedup_over(data: dict[str, Any], method: str, peer: str, temperature: float, dataset: str) -> float | None:
    """`method`'s speedup over `peer` on one data set: the median of their per-question TPOT ratios
    (:func:`dflashkit.bench.metrics.speedup_tpot_per_question`)."""
    return speedup_tpot_per_question(_rows(data, peer, temperature, dataset), _rows(data, method, temperature, dataset))


def headline_table(data: dict[str, Any]) -> str:
    """One row per temperature and data set: dflashkit's default, τ, tok/s and its speedup over each peer."""
    rows = _summary(data)
    method, peers = _dflashkit_method(data), _peers(data)
    head = ["temperature", "data set", "τ", "tok/s", *[title for _, title in peers]]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for t in data["settings"]["temperatures"]:
        for ds in data["datasets"]:
            s = rows.get((t, ds, method))
            if s is None:
                continue
            cells = ["greedy" if t == 0 else f"T={t:g}", DATASETS.get(ds, ds), _f(s["tau"], ".2f")]
            cells.append(_f(s["tokens_per_s"], ".0f"))
            cells += [_x(speedup_over(data, method, peer, t, ds)) for peer, _ in peers]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_region() -> str:
    runs = published_runs()
    if not runs:
        return "No published benchmark run yet (`docs/benchmarks/`)."
    run = runs[0].parent
    data = load(run)
    rel = run.relative_to(ROOT).as_posix()
    return "\n".join(
        [
            f"Target `{data['settings'].get('target')}` with dflashkit's default (its shipped drafter, prompt lookup, "
            f"block size chosen per step) on {cpu_label(data['machine'])}, {data['settings']['threads']} threads, "
            f"{data['settings']['dtype']}; {_when(data)}. "
            "Each speedup is the median over the data set's questions of the peer's time per output token over "
            "dflashkit's (prefill excluded), every method run on a question before the next, in one process; "
            "tok/s is the median over the questions, prefill included:",
            "",
            headline_table(data),
            "",
            f"Command: `{data['command']}`. Data: [`{rel}/`]({rel}/summary.md); other CPUs and "
            "how to reproduce: [performance](docs/performance.md).",
        ]
    )


def performance_region() -> str:
    runs = newest_per_class()
    if not runs:
        return "No published benchmark run yet."
    parts = []
    for run in runs:
        data = load(run)
        rel = run.relative_to(RUNS.parent).as_posix()
        methods = "; ".join(f"`{m['name']}`: {m['note']}" for m in data["methods"] if m.get("status") == "ran")
        parts += [
            f"### {cpu_label(data['machine'])}",
            "",
            f"Measured {_when(data)}; torch {data['versions'].get('torch')}, "
            f"{data['settings']['threads']} threads, {data['settings']['dtype']}, "
            f"{data['settings']['max_new_tokens']} new tokens, {sum(data['datasets'].values())} questions "
            f"({', '.join(f'{DATASETS.get(k, k)} {v}' for k, v in data['datasets'].items())}).",
            "",
            f"```bash\n{data['command']}\n```",
            "",
            "dflashkit's default against each peer (per question, the peer's time per output token over "
            "dflashkit's; the median over the data set's questions):",
            "",
            headline_table(data),
            "",
        ]
        for t in data["settings"]["temperatures"]:
            parts += [f"Every method, {'greedy' if t == 0 else f'temperature {t:g}'}:", "", summary_table(data, t), ""]
        parts += [f"Methods: {methods}.", ""]
        parts += [f"![{p.removesuffix('.png')}]({rel}/{p})" for p in PLOTS if (run / p).exists()]
        parts += ["", f"Raw data: [`{rel}/results.json`]({rel}/results.json), [summary]({rel}/summary.md).", ""]
    return "\n".join(parts).rstrip()


def render(path: Path) -> str:
    name = REGIONS[path]
    text = path.read_text()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"{path.name} has no {start} ... {end} region")
    body = performance_region() if path == PERFORMANCE else readme_region()
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def publish(out: Path, name: str | None) -> Path:
    data = load(out)
    dest = RUNS / (name or f"{data['created'][:10]}-{cpu_slug(data['machine'])}")
    dest.mkdir(parents=True, exist_ok=True)
    home = str(Path.home())
    for src in sorted(out.iterdir()):
        if src.suffix == ".png":
            shutil.copyfile(src, dest / src.name)
        elif src.name in ("results.json", "summary.md"):
            text = src.read_text().replace(str(ROOT) + "/", "").replace(str(ROOT), ".").replace(home, "~")
            (dest / src.name).write_text(text)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--add", type=Path, metavar="OUT_DIR", help="a `dflashkit bench --out` folder to publish")
    mode.add_argument("--write", action="store_true", help="regenerate the pages' generated regions")
    mode.add_argument("--check", action="store_true", help="exit 1 when a generated region is out of date")
    parser.add_argument("--name", default=None, help="folder name under docs/benchmarks (default: <date>-<cpu>)")
    args = parser.parse_args(argv)
    if args.add:
        print(f"published {publish(args.add, args.name).relative_to(ROOT)}")
    stale = []
    for path in REGIONS:
        new = render(path)
        if new != path.read_text():
            if args.check:
                stale.append(path.relative_to(ROOT).as_posix())
            else:
                path.write_text(new)
                print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python scripts/bench_pages.py --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
