"""scripts/bench_pages.py: published benchmark runs are data, and the pages that quote them are generated from it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_pages", ROOT / "scripts" / "bench_pages.py")
bench_pages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_pages)


def test_the_pages_quote_the_newest_published_runs() -> None:
    """README's results table and docs/performance.md's results are what the data under docs/benchmarks/ says."""
    assert bench_pages.published_runs(), "no benchmark run is published under docs/benchmarks/"
    assert bench_pages.main(["--check"]) == 0


def test_every_published_run_names_its_machine_commit_and_command() -> None:
    for path in bench_pages.published_runs():
        data = json.loads(path.read_text())
        assert data["machine"]["cpu"] and data["commit"]["sha"] and data["command"].startswith("dflashkit bench")
        assert data["non_tie_divergences_in_dflashkit"] == 0, f"{path}: a lossless method diverged"
        assert (path.parent / "summary.md").exists()


def _summary(t: float, ds: str, method: str, tau: float, tpot: float) -> dict:
    return {"temperature": t, "dataset": ds, "method": method, "tau": tau, "tokens_per_s": 1 / tpot, "tpot_s": tpot,
            "speedup_tpot": None, "compared": 1, "identical": 1}  # fmt: skip


def _gens(method: str, tpots: list[float]) -> list[dict]:
    """One generation of 11 tokens per question, 0.1 s to the first token, then `tpot` a token."""
    return [{"method": method, "dataset": "humaneval", "question_id": str(q), "turn": 0, "temperature": 0.0,
             "prompt_tokens": 5, "new_tokens": 11, "ttft_s": 0.1, "total_s": 0.1 + 10 * t}
            for q, t in enumerate(tpots)]  # fmt: skip


def _run(folder: Path, repo: Path, home: Path) -> Path:
    folder.mkdir(parents=True)
    methods = ["ar", "dflash-lookup-auto", "hf-generate", "llama-server-bf16", "llama-server-q4_1"]
    # per question, dflashkit's TPOT against each peer's: the medians of the ratios are 2.5, 2, 1.5 and 10 (one slow
    # question of the baseline moves a pooled ratio, not the median)
    runs = [
        *_gens("dflash-lookup-auto", [0.004, 0.004, 0.004]),
        *_gens("ar", [0.010, 0.010, 0.100]),
        *_gens("llama-server-bf16", [0.008, 0.008, 0.008]),
        *_gens("llama-server-q4_1", [0.006, 0.006, 0.006]),
        *_gens("hf-generate", [0.040, 0.040, 0.040]),
    ]
    data = {
        "created": "2030-01-02T03:04:05+00:00",
        "machine": {"cpu": "AMD EPYC 9000", "cores": 2, "cpu_kernels": "AVX512-BF16"},
        "versions": {"dflashkit": "9.9.9", "torch": "2.13.0"},
        "commit": {"sha": "abcdef1234567", "dirty": False},
        "settings": {"temperatures": [0.0], "threads": 2, "dtype": "bfloat16", "max_new_tokens": 64},
        "command": f"dflashkit bench --drafter {repo}/dflashkit/drafters/x --out {home}/out",
        "methods": [{"name": m, "status": "ran", "note": m} for m in methods],
        "datasets": {"humaneval": 3},
        "runs": runs,
        "summary": [
            _summary(0.0, "humaneval", "ar", 1.0, 0.010),
            _summary(0.0, "humaneval", "dflash-lookup-auto", 3.0, 0.004),
            _summary(0.0, "humaneval", "hf-generate", 1.0, 0.040),
            _summary(0.0, "humaneval", "llama-server-bf16", 1.0, 0.008),
            _summary(0.0, "humaneval", "llama-server-q4_1", 1.0, 0.006),
        ],
    }
    (folder / "results.json").write_text(json.dumps(data))
    (folder / "summary.md").write_text(f"drafter {repo}/dflashkit/drafters/x\n")
    (folder / "speedup.png").write_bytes(b"\x89PNG")
    return folder


def test_publishing_copies_a_run_without_the_machines_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, home = tmp_path / "repo", tmp_path / "home"
    (repo / "docs" / "benchmarks").mkdir(parents=True)
    monkeypatch.setattr(bench_pages, "ROOT", repo)
    monkeypatch.setattr(bench_pages, "RUNS", repo / "docs" / "benchmarks")
    monkeypatch.setattr(bench_pages.Path, "home", staticmethod(lambda: home))
    dest = bench_pages.publish(_run(tmp_path / "out", repo, home), None)
    assert dest.name == "2030-01-02-amd-avx512bf16"
    text = (dest / "results.json").read_text() + (dest / "summary.md").read_text()
    assert str(tmp_path) not in text
    assert "--drafter dflashkit/drafters/x --out ~/out" in json.loads((dest / "results.json").read_text())["command"]
    assert (dest / "speedup.png").read_bytes() == b"\x89PNG"


def test_the_headline_table_is_the_tpot_ratio_over_each_peer(tmp_path: Path) -> None:
    run = _run(tmp_path / "run", tmp_path, tmp_path)
    table = bench_pages.headline_table(bench_pages.load(run))
    head, _, row = table.splitlines()
    assert head.split(" | ")[3:] == ["tok/s", "vs plain (dflashkit)", "vs llama.cpp bf16", "vs llama.cpp Q4_1",
                                     "vs `generate` |"]  # fmt: skip
    assert row == "| greedy | HumanEval | 3.00 | 250 | 2.50× | 2.00× | 1.50× | 10.00× |"


def test_a_page_without_its_region_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "README.md"
    page.write_text("no markers here\n")
    monkeypatch.setattr(bench_pages, "REGIONS", {page: "results-table"})
    with pytest.raises(SystemExit, match="results-table:start"):
        bench_pages.render(page)
