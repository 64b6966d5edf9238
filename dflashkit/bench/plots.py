"""PNG plots of a benchmark's results object: speedup by data set and method, accepted-length histograms,
per-position acceptance curves. matplotlib (the ``bench`` extra) draws them off-screen."""

from __future__ import annotations

import importlib.util
import math
import pathlib
from typing import Any

PLOTS = ("speedup.png", "accepted_lengths.png", "acceptance.png")


def plots_available() -> bool:
    """Whether matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'dflashkit[bench]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _temp_label(t: float) -> str:
    return "greedy" if t == 0 else f"temperature {t:g}"


def _empty(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def plot_speedup(data: dict[str, Any], path: pathlib.Path) -> None:
    """Grouped bars: speedup (TPOT) of each method over the baseline, per data set; one panel per temperature."""
    plt = _pyplot()
    temps = list(dict.fromkeys(s["temperature"] for s in data["summary"])) or [0.0]
    methods = [m for m in dict.fromkeys(s["method"] for s in data["summary"]) if m != data["baseline"]]
    datasets = list(data["datasets"])
    panel_width = max(6.0, 1.5 + 0.35 * len(datasets) * max(1, len(methods)))
    fig, axes = plt.subplots(1, len(temps), figsize=(panel_width * len(temps), 4.5), squeeze=False)
    for ax, t in zip(axes[0], temps):
        if not methods:
            _empty(ax, "only the baseline ran")
            continue
        width = 0.8 / len(methods)
        for j, m in enumerate(methods):
            values = []
            for d in datasets:
                s = next(
                    (s for s in data["summary"] if (s["temperature"], s["dataset"], s["method"]) == (t, d, m)), None
                )
                values.append(s["speedup_tpot"] if s and s["speedup_tpot"] is not None else float("nan"))
            xs = _grouped(range(len(datasets)), j, len(methods), width)
            bars = ax.bar(xs, values, width, label=m)
            ax.bar_label(bars, labels=["" if math.isnan(v) else f"{v:.2f}" for v in values], fontsize=7, padding=1)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_ylabel(f"speedup over {data['baseline']} (TPOT ratio)")
        ax.set_title(_temp_label(t))
        ax.legend(fontsize=7)
    fig.suptitle("Speedup by data set and method")
    _save(plt, fig, path)


def plot_histograms(data: dict[str, Any], path: pathlib.Path) -> None:
    """Accepted drafts per verification step (fraction of steps), one panel per speculative method and temperature."""
    plt = _pyplot()
    rows = [s for s in data["summary"] if s["accepted_histogram"]]
    methods = list(dict.fromkeys(s["method"] for s in rows))
    temps = list(dict.fromkeys(s["temperature"] for s in rows))
    fig, axes = plt.subplots(
        max(1, len(methods)),
        max(1, len(temps)),
        figsize=(5.5 * max(1, len(temps)), 2.8 * max(1, len(methods))),
        squeeze=False,
    )
    if not rows:
        _empty(axes[0][0], "no speculative method ran")
    for i, m in enumerate(methods):
        for j, t in enumerate(temps):
            ax = axes[i][j]
            here = [s for s in rows if s["method"] == m and s["temperature"] == t]
            width = 0.8 / max(1, len(here))
            for k, s in enumerate(here):
                hist = s["accepted_histogram"]
                total = sum(hist) or 1
                xs = _grouped(range(len(hist)), k, len(here), width)
                ax.bar(xs, [h / total for h in hist], width, label=f"{s['dataset']} (τ {s['tau']:.2f})")
            ax.set_title(f"{m}, {_temp_label(t)}", fontsize=9)
            ax.set_xlabel("accepted drafts per step")
            ax.set_ylabel("fraction of steps")
            ax.legend(fontsize=7)
    _save(plt, fig, path)


def plot_acceptance(data: dict[str, Any], path: pathlib.Path) -> None:
    """α_k against k, one line per method and data set; one panel per temperature."""
    plt = _pyplot()
    rows = [s for s in data["summary"] if s["acceptance_per_position"]]
    temps = list(dict.fromkeys(s["temperature"] for s in rows))
    fig, axes = plt.subplots(1, max(1, len(temps)), figsize=(6 * max(1, len(temps)), 4.2), squeeze=False)
    if not rows:
        _empty(axes[0][0], "no speculative method with per-position figures ran")
    styles = ["-", "--", ":", "-."]
    datasets = list(data["datasets"])
    methods = list(dict.fromkeys(s["method"] for s in rows))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, t in zip(axes[0], temps):
        for s in (s for s in rows if s["temperature"] == t):
            alphas = s["acceptance_per_position"]
            ks = [k for k, a in enumerate(alphas, 1) if a is not None]
            ax.plot(
                ks,
                [alphas[k - 1] for k in ks],
                marker="o",
                markersize=3,
                color=colors[methods.index(s["method"]) % len(colors)],
                linestyle=styles[datasets.index(s["dataset"]) % len(styles)] if s["dataset"] in datasets else "-",
                label=f"{s['method']} {s['dataset']}",
            )
        width = max((len(s["acceptance_per_position"]) for s in rows if s["temperature"] == t), default=1)
        ax.set_xlim(0.5, width + 0.5)
        ax.set_xticks(range(1, width + 1))
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("α_k = P(k accepted | 1..k-1 accepted)")
        ax.set_title(_temp_label(t))
        ax.legend(fontsize=7)
    _save(plt, fig, path)


def write_plots(data: dict[str, Any], out_dir: pathlib.Path) -> list[pathlib.Path]:
    """All three PNGs into out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in PLOTS]
    plot_speedup(data, paths[0])
    plot_histograms(data, paths[1])
    plot_acceptance(data, paths[2])
    return paths


def _grouped(positions: range, member: int, members: int, width: float) -> list[float]:
    """x positions of bar `member` of `members` side-by-side bars of `width` around each position."""
    return [x + (member - (members - 1) / 2) * width for x in positions]


def _save(plt: Any, fig: Any, path: pathlib.Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
