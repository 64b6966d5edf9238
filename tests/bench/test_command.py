"""`dflashkit bench` end to end on a tiny random target (load_target replaced), and its option handling."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import dflashkit.drafter.registry
import dflashkit.interop.llama_server
import dflashkit.target.loading
from dflashkit.bench.command import QUICK, bench_parser, settings_from
from dflashkit.cli.main import main
from dflashkit.errors import InvalidInputError
from dflashkit.kernels.quantize import quantize_model
from tests.conftest import tiny_target, word_tokenizer

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w4{% endif %}"


@pytest.fixture
def tiny_load(monkeypatch):
    def fake_load_target(name_or_path=None, *, dtype=torch.bfloat16, device="cpu", progress=False, quantize=None):
        tok = word_tokenizer()
        tok.chat_template = CHAT_TEMPLATE
        return quantize_model(tiny_target("llama", dtype=dtype).requires_grad_(False), quantize), tok

    monkeypatch.setattr(dflashkit.target.loading, "load_target", fake_load_target)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if llama-cpp-python were not installed
    monkeypatch.setattr(
        dflashkit.interop.llama_server, "find_llama_server", lambda explicit=None: None
    )  # nor llama-server


@pytest.fixture
def questions(tmp_path) -> str:
    path = tmp_path / "qs.jsonl"
    path.write_text(
        "\n".join(json.dumps({"question_id": i, "turns": [f"w{9 + i} w10 w11", "w12 w13"]}) for i in range(2))
    )
    return str(path)


def test_bench_command_writes_outputs_and_skips_missing_peers(tiny_load, questions, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "--datasets",
            questions,
            "--limit",
            "1",
            "--max-new-tokens",
            "6",
            "--temperatures",
            "0,1",
            "--drafter",
            "untrained",
            "--block-sizes",
            "2,4,auto",
            "--out",
            str(out),
            "--json",
            str(tmp_path / "r.json"),
            "--no-progress",
            "--threads",
            "1",
        ]
    )
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    assert "skipped hf-assisted: no draft model with the target's tokenizer" in stderr
    assert "skipped llama.cpp: llama-cpp-python is not installed" in stderr
    assert "skipped llama-server-bf16: no llama-server binary" in stderr
    assert "| qs | dflash-b4 |" in stdout and "| qs | hf-prompt-lookup |" in stdout and "temperature 1:" in stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["settings"]["drafter"].startswith("untrained") and data["settings"]["threads"] == 1
    assert data["command"].startswith("dflashkit bench --datasets")
    load = data["settings"]["other_load_cores"]  # other processes' load as the run started and ended (Linux)
    if load["start"] is not None:
        assert load["start"] >= 0 and load["end"] >= 0
        assert "other processes kept" in (out / "summary.md").read_text()
    status = {m["name"]: m["status"] for m in data["methods"]}
    assert status["dflash-b2"] == "ran" and status["dflash-auto"] == "ran"
    assert {p.name for p in out.iterdir()} >= {"summary.md", "speedup.png", "accepted_lengths.png", "acceptance.png"}


def test_without_a_drafter_dflash_is_skipped_with_a_reason(tiny_load, questions, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(
        dflashkit.drafter.registry, "DRAFTERS_DIR", tmp_path / "none-shipped"
    )  # a target with no drafter
    rc = main(
        [
            "bench",
            "--datasets",
            questions,
            "--limit",
            "1",
            "--max-new-tokens",
            "4",
            "--temperatures",
            "0",
            "--methods",
            "ar,dflash",
            "--max-turns",
            "1",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    _, stderr = capsys.readouterr()
    assert rc == 0 and "skipped dflash-b16: no trained drafter ships for this target yet" in stderr


def test_options_quick_preset_and_errors(capsys) -> None:
    parser = bench_parser()
    s = settings_from(parser.parse_args(["--quick", "--limit", "5"]))
    assert s["limit"] == 5 and s["max_new_tokens"] == QUICK["max_new_tokens"] and s["max_turns"] == 1
    assert s["methods"][0] == "ar" and s["temperatures"] == [0.0, 1.0] and s["block_sizes"] == [4, 8, 16, "auto"]
    full = settings_from(parser.parse_args(["--methods", "hf,ar", "--temperatures", "0"]))
    assert full["methods"] == ["ar", "hf"] and full["max_turns"] is None and full["limit"] == 10
    assert full["trees"] == [] and settings_from(parser.parse_args(["--trees", "5,11"]))["trees"] == [5, 11]
    for bad in (
        ["--methods", "vllm"],
        ["--block-sizes", "1"],
        ["--block-sizes", "4,big"],
        ["--temperatures", "x"],
        ["--trees", "0"],
        ["--trees", "five"],
        ["--datasets", "bogus"],
        ["--datasets", "mt-bench,gsm9k"],
    ):
        with pytest.raises(InvalidInputError):
            settings_from(parser.parse_args(bad))
    assert main(["bench", "--methods", "vllm"]) == 2
    assert "unknown method" in capsys.readouterr().err
