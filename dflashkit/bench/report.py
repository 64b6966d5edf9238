"""Benchmark outputs: the JSON results file (everything, raw per-generation figures included) and the
Markdown summary (tables per temperature, per-position acceptance, methods, divergences, definitions)."""

from __future__ import annotations

import datetime as _dt
import json
import pathlib
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from dflashkit.bench import environment
from dflashkit.bench.methods import EXACT, KERNELS, OTHER_WEIGHTS
from dflashkit.bench.metrics import __doc__ as METRICS_DOC
from dflashkit.bench.runner import BenchResult
from dflashkit.fsutil import atomic_write
from dflashkit.kernels.quantize import is_quantized

FORMAT = "dflashkit-bench/1"
COMPARABLE = {
    EXACT: "yes (same loop, weights and kernels)",
    KERNELS: "up to bf16 ties (same weights, transformers' attention kernel)",
    OTHER_WEIGHTS: "no (other weights and kernels: compare speed only)",
}
TIMING = (
    "Per prompt, every method runs once in a rotating order after one warm-up generation each; all are timed "
    "from the call with prompt token ids to the first new token (TTFT) and to the last (TPOT = time after "
    "the first token / further tokens, pooled over the data set). tok/s is the median over questions of new "
    "tokens / wall time, prefill included. Speedup (TPOT) = baseline TPOT / method TPOT (prefill excluded, "
    "the DFlash paper's definition); speedup (tok/s) = mean over questions of method tok/s / baseline tok/s "
    "(prefill included, Spec-Bench's)."
)


def as_json(result: BenchResult) -> dict[str, Any]:
    """The whole run as one JSON-ready object."""
    return {
        "format": FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": environment.machine(),
        "versions": environment.versions(),
        "commit": environment.commit(),
        "settings": {**asdict(result.config), **result.extra.get("settings", {})},
        "command": result.extra.get("command"),
        "baseline": result.baseline,
        "methods": result.methods,
        "datasets": result.datasets,
        "summary": result.summary,
        "divergences": result.divergences,
        "non_tie_divergences_in_dflashkit": len(result.failures),
        "exit_code": result.exit_code,
        "interrupted": result.interrupted,
        "wall_s": result.wall_s,
        "definitions": {"timing": TIMING, "metrics": METRICS_DOC.strip(), "comparable": COMPARABLE},
        "runs": [r.as_dict() for r in result.rows],
    }


def write_json(data: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    atomic_write(path, lambda f: json.dump(data, f, indent=1, ensure_ascii=False))
    return path


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{1000 * value:.1f}"


def _identical(s: dict[str, Any], method: str, baseline: str, temperature: float) -> str:
    if method == baseline:
        return "baseline"
    if temperature != 0 and not s["compared"]:  # sampled, not compared (rejection sampling, or another family)
        return "sampled"
    if not s["compared"]:
        return "–"
    text = f"{s['identical']}/{s['compared']}"
    if s["comparable"] == OTHER_WEIGHTS:
        return text + " (other weights)"
    if s["divergences"]:
        text += f" ({s['tie_divergences']} tie, {s['non_tie_divergences']} non-tie)"
    return text


def summary_table(data: dict[str, Any], temperature: float) -> str:
    """The Markdown table of one temperature: one row per data set and method."""
    lines = [
        "| data set | method | τ | tok/s | TPOT ms | TTFT ms | speedup (TPOT) | speedup (tok/s) | identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in data["summary"]:
        if s["temperature"] != temperature:
            continue
        lines.append(
            f"| {s['dataset']} | {s['method']} | {_fmt(s['tau'])} | {_fmt(s['tokens_per_s'], '.1f')} | "
            f"{_ms(s['tpot_s'])} | {_ms(s['ttft_s'])} | {_fmt(s['speedup_tpot'], '.2f', '×')} | "
            f"{_fmt(s['speedup_tokens_per_s'], '.2f', '×')} | "
            f"{_identical(s, s['method'], data['baseline'], temperature)} |"
        )
    return "\n".join(lines)


def acceptance_table(data: dict[str, Any], temperature: float) -> str | None:
    rows = [s for s in data["summary"] if s["temperature"] == temperature and s["acceptance_per_position"]]
    if not rows:
        return None
    width = max(len(s["acceptance_per_position"]) for s in rows)
    lines = [
        "| data set | method | " + " | ".join(f"α{k}" for k in range(1, width + 1)) + " |",
        "|---|---|" + "---:|" * width,
    ]
    for s in rows:
        cells = [_fmt(a) for a in s["acceptance_per_position"]] + [""] * (width - len(s["acceptance_per_position"]))
        lines.append(f"| {s['dataset']} | {s['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def retention_table(data: dict[str, Any], temperature: float) -> str | None:
    """How much of its greedy speedup (TPOT) each method keeps at `temperature`, per data set: the fast-path
    issue's bar for sampling (>= 80%). None unless the run has greedy rows and rows at that temperature."""
    if temperature == 0:
        return None
    greedy = {(s["dataset"], s["method"]): s["speedup_tpot"] for s in data["summary"] if s["temperature"] == 0}
    lines = []
    for s in data["summary"]:
        base = greedy.get((s["dataset"], s["method"]))
        if s["temperature"] != temperature or s["method"] == data["baseline"] or not base or s["speedup_tpot"] is None:
            continue
        lines.append(
            f"| {s['dataset']} | {s['method']} | {_fmt(base, '.2f', '×')} | "
            f"{_fmt(s['speedup_tpot'], '.2f', '×')} | {s['speedup_tpot'] / base:.0%} |"
        )
    if not lines:
        return None
    return "\n".join(
        [
            f"| data set | method | greedy speedup (TPOT) | T={temperature:g} speedup (TPOT) | kept |",
            "|---|---|---:|---:|---:|",
            *lines,
        ]
    )


def _other_load(load: dict[str, float | None] | None) -> str:
    """ "; other processes' load ..." for the machine line, where the run measured it (CPU runs on Linux)."""
    if not load or load.get("start") is None:
        return ""
    end = load.get("end")
    return f"; other processes kept {load['start']:.1f} cores busy as the run started" + (
        f", {end:.1f} as it ended" if end is not None else ""
    )


def markdown(data: dict[str, Any]) -> str:
    """The human summary of a results object (see :func:`as_json`)."""
    m, st, v = data["machine"], data["settings"], data["versions"]
    commit = data.get("commit") or {}
    sha = (commit.get("sha", "")[:10] + (" (uncommitted changes)" if commit.get("dirty") else "")) or "unknown"
    temps = list(dict.fromkeys(s["temperature"] for s in data["summary"]))
    out = [
        "# dflashkit bench",
        "",
        *(
            ["**Interrupted**: the figures cover the prompts finished before the stop.", ""]
            if data["interrupted"]
            else []
        ),
        f"- **command**: `{data['command'] or '(Python API)'}`",
        (
            f"- **machine**: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}"
            + (f", {m['memory_gib']} GiB" if "memory_gib" in m else "")
            + (f", GPU {m['gpu']}" if "gpu" in m else "")
            + (f"; dflashkit's CPU kernels: {m['cpu_kernels']}" if "cpu_kernels" in m else "")
            + _other_load(st.get("other_load_cores"))
        ),
        (
            f"- **software**: dflashkit {v.get('dflashkit')} @ {sha}, torch {v.get('torch')}, transformers "
            f"{v.get('transformers')}"
            + (f", llama-cpp-python {v['llama-cpp-python']}" if v.get("llama-cpp-python") else "")
        ),
        (
            f"- **target**: {st.get('target', '?')} ({st.get('dtype', '?')}"
            + (
                f"; weights {st['target_weights']}: every method runs on this quantized target, "
                "exact with respect to it"
                if is_quantized(st.get("target_weights"))
                else ""
            )
            + f"); **drafter**: {st.get('drafter', '?')}"
        ),
        (
            f"- **settings**: data sets {', '.join(f'{k} ({n} questions)' for k, n in data['datasets'].items())}; "
            f"max {st['max_new_tokens']} new tokens; turns {st['max_turns'] or 'all'}; seed {st['seed']}; "
            f"baseline `{data['baseline']}`; run took {data['wall_s'] / 60:.1f} min"
        ),
        "",
    ]
    for t in temps:
        out += [f"## {'Greedy' if t == 0 else f'Temperature {t:g}'}", "", summary_table(data, t), ""]
        acc = acceptance_table(data, t)
        if acc:
            out += ["Per-position acceptance α_k (P(draft k accepted | drafts before it accepted)):", "", acc, ""]
        kept = retention_table(data, t)
        if kept:
            out += [
                f"Share of the greedy speedup kept at T={t:g} (each speedup over the baseline at its own temperature):",
                "",
                kept,
                "",
            ]
    out += [
        "## Methods",
        "",
        "| method | what runs | tokens comparable with the baseline | status |",
        "|---|---|---|---|",
    ]
    for meth in data["methods"]:
        status = "ran" if meth["status"] == "ran" else f"{meth['status']}: {meth['reason']}"
        out.append(
            f"| {meth['name']} | {meth['note']} | {COMPARABLE.get(meth['comparable'], meth['comparable'])} | {status} |"
        )
    divs = [d for d in data["divergences"] if d["comparable"] != OTHER_WEIGHTS]
    out += ["", "## Greedy divergences from the baseline", ""]
    if not divs:
        out.append("None (methods on other weights aside).")
    for d in divs:
        kind = {True: "tie", False: "**NOT a tie**", None: "unjudged"}[d["tie"]]
        margin = (
            f", margin {d['margin']:.4g} at max |logit| {d['max_abs_logit']:.4g}" if d["margin"] is not None else ""
        )
        note = f" ({d['note']})" if d.get("note") else ""
        out.append(
            f"- {d['method']} on {d['dataset']}/{d['question_id']} turn {d['turn']}, token {d['index']}: "
            f"{d['text']!r} vs {d['baseline_text']!r} after {d['context']!r}{margin}: {kind}{note}"
        )
    if data["non_tie_divergences_in_dflashkit"]:
        out += [
            "",
            (
                f"**{data['non_tie_divergences_in_dflashkit']} non-tie divergence(s) of dflashkit methods: a "
                "bug; the run exited with code 1.**"
            ),
        ]
    out += ["", "## How it was measured", "", TIMING, ""]
    return "\n".join(out)


def write_outputs(
    data: dict[str, Any] | BenchResult,
    out_dir: str | pathlib.Path,
    json_path: str | pathlib.Path | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, pathlib.Path]:
    """results.json (or json_path), summary.md and the PNG plots of a result (or its :func:`as_json`);
    returns {kind: path}. Without matplotlib the plots are left out with a line saying so."""
    from dflashkit.bench.plots import plots_available, write_plots

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = as_json(data) if isinstance(data, BenchResult) else data
    paths = {"json": write_json(data, json_path or out / "results.json")}
    md = out / "summary.md"
    atomic_write(md, lambda f: f.write(markdown(data)))
    paths["markdown"] = md
    if not plots_available():
        (log or (lambda msg: print(msg, file=sys.stderr)))(
            "plots skipped: matplotlib is not installed (pip install 'dflashkit[bench]')"
        )
        return paths
    for p in write_plots(data, out):
        paths[p.stem] = p
    return paths
