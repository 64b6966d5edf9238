"""`dflashkit drafters` (the shipped drafters, from their config.json) and shipped drafters named by their short name
in export and bench."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dflashkit.drafter.registry
from dflashkit.cli.main import main
from dflashkit.drafter.registry import DRAFTERS_DIR

SHIPPED = "smollm2-135m-instruct"


def test_drafters_lists_the_shipped_drafter(capsys) -> None:
    assert main(["drafters", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    (row,) = [r for r in rows if r["name"] == SHIPPED]
    config = json.loads((DRAFTERS_DIR / SHIPPED / "config.json").read_text())
    assert row["target"] == config["dflashkit"]["target"]["name_or_path"] == SHIPPED
    assert row["layers"] == config["num_hidden_layers"] and row["block_size"] == config["block_size"]
    files = [f for f in (DRAFTERS_DIR / SHIPPED).iterdir() if f.is_file()]
    assert row["size_bytes"] == sum(f.stat().st_size for f in files) and Path(row["path"]) == DRAFTERS_DIR / SHIPPED

    assert main(["drafters"]) == 0
    header, line = capsys.readouterr().out.splitlines()[:2]
    assert header.split() == ["NAME", "TARGET", "LAYERS", "BLOCK", "SIZE", "FOLDER"]
    words = line.split()
    assert words[:4] == [SHIPPED, SHIPPED, str(row["layers"]), str(row["block_size"])]
    assert words[5] == "MiB" and abs(float(words[4]) - row["size_bytes"] / 2**20) < 0.06


def test_drafters_without_any(capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(dflashkit.drafter.registry, "DRAFTERS_DIR", tmp_path / "none")
    assert main(["drafters"]) == 0 and "No drafters ship" in capsys.readouterr().out
    assert main(["drafters", "--json"]) == 0 and json.loads(capsys.readouterr().out) == []


def test_export_a_shipped_drafter_by_name(capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`dflashkit export NAME --format hf` exports the shipped drafter into the working folder, never into the
    installed package; an explicit --out and a drafter folder keep their places."""
    from dflashkit.interop import export
    from dflashkit.interop.export import ExportResult

    calls = []

    def fake_export_hf(drafter, out, *, target=None):
        calls.append((Path(drafter), Path(out)))
        return ExportResult(format="hf", path=Path(out), commands={})

    monkeypatch.setattr(export, "export_hf", fake_export_hf)
    monkeypatch.chdir(tmp_path)
    assert main(["export", SHIPPED, "--format", "hf"]) == 0
    assert calls[-1] == (DRAFTERS_DIR / SHIPPED, tmp_path / f"{SHIPPED}-hf")
    assert main(["export", SHIPPED, "--format", "hf", "--out", "elsewhere"]) == 0
    assert calls[-1][1] == Path("elsewhere")
    (tmp_path / "mine").mkdir()
    assert main(["export", "mine", "--format", "hf"]) == 0
    assert calls[-1] == (Path("mine"), tmp_path / "mine-hf")
    capsys.readouterr()
    assert main(["export", "smollm2", "--format", "hf"]) == 2 and len(calls) == 3
    err = capsys.readouterr().err
    assert f"no shipped drafter of that name (shipped: {SHIPPED};" in err and "one of" not in err  # no keywords


def test_bench_takes_a_shipped_drafter_by_name() -> None:
    from dflashkit.bench.command import bench_parser

    parser = bench_parser()
    assert parser.parse_args(["--drafter", SHIPPED]).drafter == str(DRAFTERS_DIR / SHIPPED)
    assert parser.parse_args(["--drafter", "untrained"]).drafter == "untrained"
    assert parser.parse_args(["--drafter", "some/folder"]).drafter == "some/folder"  # reported when it loads
