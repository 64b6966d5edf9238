"""scripts/model_card.py: the card is a Hugging Face model card (YAML header with base_model, library_name,
model-index, ...) whose evaluation figures are the bench's, whose record of how the drafter was made lives in the
header and survives a refresh, and the shipped drafter's card is such a card."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import struct
from pathlib import Path

import pytest
import yaml

from dflashkit.cli.main import build_parser
from dflashkit.target.loading import DEFAULT_TARGET

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "dflashkit" / "drafters" / DEFAULT_TARGET


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


model_card = _load("model_card")
check_words = _load("check_words")
SECTIONS = [
    "## Model details",
    "## Intended use",
    "## How to use",
    "## Training data",
    "## Training procedure",
    "## Evaluation",
    "## Limitations",
]
METHOD = "dflash-lookup-auto"


def header_of(card: Path) -> tuple[dict, str]:
    text = card.read_text()
    assert text.startswith("---\n")
    end = text.index("\n---\n", 4)
    return yaml.safe_load(text[4:end]), text[end + 5 :]


def bench_results(scale: float = 1.0) -> dict:
    """A results.json as `dflashkit bench` writes it (the fields the card reads), figures scaled by `scale`."""
    summary = []
    for t in (0.0, 1.0):
        for i, dataset in enumerate(("mt-bench", "humaneval", "math500")):
            for method, tau, speedup in (("ar", 1.0, 1.0), ("dflash-b16", 1.9, 1.2), (METHOD, 2.5, 1.8)):
                if method != "ar":
                    tau, speedup = scale * (tau + 0.1 * i - 0.4 * t), scale * (speedup + 0.05 * i - 0.5 * t)
                summary.append(
                    {
                        "temperature": t,
                        "dataset": dataset,
                        "method": method,
                        "family": "dflashkit",
                        "comparable": "exact",
                        "tau": tau,
                        "tokens_per_s": 100.0 * speedup,
                        "speedup_tpot": speedup,
                        "speedup_tokens_per_s": speedup * 0.95,
                    }
                )
    return {
        "format": "dflashkit-bench/1",
        "created": "2026-11-28T09:13:41+00:00",
        "machine": {"cpu": "AMD EPYC (family 25, model 17)", "cores": 2, "torch_threads": 2, "cpu_kernels": "AVX512"},
        "versions": {"dflashkit": "0.1.0", "torch": "2.13.0+cpu", "transformers": "5.24.0"},
        "commit": {"sha": "9f6070ce3fabba92fc6756f5acf3cf232bc4df24", "dirty": False},
        "settings": {"max_new_tokens": 128, "max_turns": 1, "target": DEFAULT_TARGET, "dtype": "bfloat16"},
        "command": "dflashkit bench --methods ar,dflash,dflash-lookup --limit 4 --block-sizes 16,auto "
        "--temperatures 0,1 --out docs/benchmarks/2026-11-28-epyc",
        "baseline": "ar",
        "methods": [],
        "datasets": {"mt-bench": 4, "humaneval": 4, "math500": 4},
        "summary": summary,
        "divergences": [],
        "non_tie_divergences_in_dflashkit": 0,
    }


def write_safetensors(path: Path) -> None:
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))


def fake_run(tmp_path: Path) -> tuple[Path, Path]:
    """A training run folder and its data folder, with the files the trainer and `dflashkit data` write."""
    data, run = tmp_path / "work" / "data-folder", tmp_path / "work" / "run"
    data.mkdir(parents=True)
    (run / "drafter").mkdir(parents=True)
    (data / "meta.json").write_text(
        json.dumps(
            {
                "settings": {"max_new_tokens": 192, "max_prompt_tokens": 512, "temperature": 0.0, "seed": 3},
                "num_prompts": 10,
                "num_shards": 1,
                "shards": {"0": {"seconds": 90.0}},
                "extra": {"collection": {"sources": "sharegpt:0.8,math:0.2", "num_prompts": 10, "exclude_eval": True}},
            }
        )
    )
    config = {
        "data_dir": str(data),
        "out_dir": str(run),
        "target": None,
        "num_layers": 2,
        "block_size": 16,
        "gamma": 7.0,
        "loss_weighting": "decay",
        "dpace_alpha": 0.5,
        "init_from_target": True,
        "init_drafter": None,
        "anchors_per_seq": 32,
        "seqs_per_step": 8,
        "grad_accum": 1,
        "steps": 10,
        "lr": 0.0006,
        "warmup_ratio": 0.04,
        "max_seq_len": 768,
        "draft_vocab_size": 8192,
        "distill_topk": 32,
        "distill_weight": 0.5,
        "eval_every": 5,
        "checkpoint_every": 5,
        "seed": 0,
        "device": "cuda",
        "precision": "bf16",
        "time_budget_s": None,
    }
    (run / "run_config.json").write_text(
        json.dumps({"config": config, "machine": "NVIDIA H100 80GB HBM3", "processes": 1, "torch": "2.11.0"})
    )
    log = [{"step": s, "loss": 3.0, "acc": [0.5, 0.3, 0.2], "elapsed_s": 6.0 * s} for s in range(1, 11)]
    for r in log[4::5]:
        r.update(tau=1.5 + r["step"] / 100, heldout_acc=[0.4, 0.2, 0.1])
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    (run / "data_used.json").write_text(json.dumps([{"folder": str(data), "sequences": 10, "response_tokens": 1500}]))
    shipped = json.loads((SHIPPED / "config.json").read_text())
    shipped["num_hidden_layers"] = 2
    shipped["dflashkit"]["draft_vocab"] = list(range(8192))
    (run / "drafter" / "config.json").write_text(json.dumps(shipped))
    write_safetensors(run / "drafter" / "model.safetensors")
    return run, data


def check_model_index(header: dict, bench: dict) -> None:
    """model-index holds, per data set, τ and the TPOT speedup of the default method at each temperature, as the
    bench's summary has them (rounded to 3 decimals)."""
    (entry,) = header["model-index"]
    assert entry["name"]
    by_name = {r["dataset"]["name"]: r for r in entry["results"]}
    assert set(by_name) == {"MT-Bench", "HumanEval", "MATH-500"}
    names = {"MT-Bench": "mt-bench", "HumanEval": "humaneval", "MATH-500": "math500"}
    for name, result in by_name.items():
        assert result["task"]["type"] == "text-generation"
        assert result["dataset"]["type"]
        got = {(m["type"], m["args"]["temperature"]): m["value"] for m in result["metrics"]}
        want = {}
        for row in bench["summary"]:
            if row["method"] == METHOD and row["dataset"] == names[name]:
                want[("acceptance_length", row["temperature"])] = round(row["tau"], 3)
                want[("speedup", row["temperature"])] = round(row["speedup_tpot"], 3)
        assert got == want
    hub = pytest.importorskip("huggingface_hub.repocard_data")
    model_name, results = hub.model_index_to_eval_results(header["model-index"])  # the Hub's own reader
    assert model_name == entry["name"] and len(results) == 12


def cli_commands(body: str) -> list[list[str]]:
    """The `dflashkit ...` command lines of the card's bash blocks, as words."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", body, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["dflashkit"]:
                out.append(words[1:])
    return out


def test_a_run_is_packaged_with_a_hugging_face_card(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    run, data = fake_run(tmp_path)
    bench = bench_results()
    (tmp_path / "results.json").write_text(json.dumps(bench))
    out = tmp_path / "out" / "my-drafter"
    model_card.main(
        ["--run", str(run), "--bench", str(tmp_path / "results.json"), "--out", str(out),
         "--rename", f"{data}=data/greedy", "--rename", f"{run}=runs/v1", "--drafter-version", "v1",
         "--date", "2026-11-28", "--note", "limitations: a line of its own"]
    )  # fmt: skip
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    header, body = header_of(out / "README.md")
    assert header["license"] == "apache-2.0"
    assert header["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert header["library_name"] == "dflashkit" and header["pipeline_tag"] == "text-generation"
    assert {"speculative-decoding", "dflash", "block-diffusion", "drafter"} <= set(header["tags"])
    assert header["datasets"] == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]
    check_model_index(header, bench)
    training = header["dflashkit"]["training"]
    assert training["data"][0]["command"] == (
        "dflashkit data --sources sharegpt:0.8,math:0.2 --num-prompts 10 --max-new-tokens 192 "
        "--max-prompt-tokens 512 --temperature 0.0 --seed 3 --out data/greedy"
    )
    assert training["data"][0]["answers"] == 10 and training["data"][0]["response_tokens"] == 1500
    procedure = training["procedure"]
    assert procedure["command"].startswith("dflashkit train --data data/greedy --out runs/v1 --layers 2 ")
    assert "--distill-topk 32 --distill-weight 0.5 --device cuda" in procedure["command"]
    assert procedure["hardware"] == "NVIDIA H100 80GB HBM3" and procedure["date"] == "2026-11-28"
    assert procedure["steps"] == 10 and procedure["wall_minutes"] == 1.0
    assert [h["step"] for h in procedure["heldout"]] == [5, 10]
    positions = [body.index(s) for s in SECTIONS]
    assert positions == sorted(positions), "sections missing or out of order"
    assert body.startswith("\n# DFlash drafter for SmolLM2-135M-Instruct")
    assert "| MT-Bench | 2.50 | 1.80× | 2.10 | 1.30× |" in body  # the evaluation table: the bench's figures
    assert "- a line of its own" in body
    assert str(tmp_path) not in (out / "README.md").read_text()  # paths as the reader can reproduce them
    for words in cli_commands(body):
        build_parser().parse_args(words)  # every command of the card parses with today's CLI


def test_a_card_refreshes_from_its_own_header_and_a_new_bench(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    run, data = fake_run(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps(bench_results()))
    out = tmp_path / "my-drafter"
    model_card.main(["--run", str(run), "--bench", "results.json", "--out", str(out), "--drafter-version", "v1"])
    before, _ = header_of(out / "README.md")
    shutil.rmtree(tmp_path / "work")  # the run and its data are gone: the card alone keeps their record
    bench = bench_results(scale=1.5)
    (tmp_path / "new.json").write_text(json.dumps(bench))
    model_card.main(["--refresh", str(out), "--bench", "new.json"])
    after, body = header_of(out / "README.md")
    assert after["dflashkit"] == before["dflashkit"]
    assert after["base_model"] == before["base_model"] and after["datasets"] == before["datasets"]
    check_model_index(after, bench)
    assert all(s in body for s in SECTIONS)
    assert before["dflashkit"]["training"]["procedure"]["command"] in body

    # a drafter trained from this one keeps it as its earlier stage
    run2, _ = fake_run(tmp_path)
    model_card.main(
        ["--run", str(run2), "--bench", "new.json", "--out", str(tmp_path / "next"), "--drafter-version", "v2",
         "--previous-card", str(out / "README.md")]
    )  # fmt: skip
    header, body = header_of(tmp_path / "next" / "README.md")
    (stage,) = header["dflashkit"]["training"]["stages"]
    assert stage["stage"] == "v1" and stage["steps"] == 10 and stage["data"] == "10 answers"
    assert "| v2 (this drafter) |" in body


def test_refresh_refuses_a_card_without_a_record(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("# A card\n")
    (tmp_path / "results.json").write_text(json.dumps(bench_results()))
    with pytest.raises(SystemExit, match="no `dflashkit:` record"):
        model_card.main(["--refresh", str(tmp_path), "--bench", str(tmp_path / "results.json")])


def test_the_shipped_card_is_a_hugging_face_model_card() -> None:
    header, body = header_of(SHIPPED / "README.md")
    assert header["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert header["library_name"] == "dflashkit" and header["license"] == "apache-2.0"
    assert header["pipeline_tag"] == "text-generation" and "speculative-decoding" in header["tags"]
    (entry,) = header["model-index"]
    datasets = {r["dataset"]["name"] for r in entry["results"]}
    assert datasets == {"MT-Bench", "HumanEval", "MATH-500"}
    for result in entry["results"]:
        assert result["task"]["type"] == "text-generation" and result["dataset"]["type"]
        kinds = {m["type"] for m in result["metrics"]}
        assert kinds == {"acceptance_length", "speedup"}
        for m in result["metrics"]:
            assert isinstance(m["value"], (int, float)) and not isinstance(m["value"], bool) and m["value"] > 0
    training = header["dflashkit"]["training"]
    assert training["procedure"]["command"].startswith("dflashkit train ")
    assert training["data"] and training["stages"]
    assert all(s in body for s in SECTIONS)
    assert not check_words.check_text((SHIPPED / "README.md").read_text())
    for words in cli_commands(body):
        build_parser().parse_args(words)
    config = json.loads((SHIPPED / "config.json").read_text())
    assert config["dflashkit"]["target"]["name_or_path"] == DEFAULT_TARGET


def test_refreshing_the_shipped_card_keeps_its_record(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    folder = tmp_path / "drafters" / DEFAULT_TARGET
    shutil.copytree(SHIPPED, folder)
    bench = bench_results()
    (tmp_path / "results.json").write_text(json.dumps(bench))
    model_card.main(["--refresh", str(folder), "--bench", str(tmp_path / "results.json")])
    before, _ = header_of(SHIPPED / "README.md")
    after, body = header_of(folder / "README.md")
    assert after["dflashkit"] == before["dflashkit"]
    assert {k: v for k, v in after.items() if k != "model-index"} == {
        k: v for k, v in before.items() if k != "model-index"
    }
    check_model_index(after, bench)
    assert "This drafter ships inside the dflashkit package" in body
    assert not check_words.check_text((folder / "README.md").read_text())
