"""`dflashkit generate` and `dflashkit chat`, run in-process on a tiny random target with an offline WordLevel
tokenizer."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import dflashkit
import dflashkit.drafter.registry
import dflashkit.target.loading
from dflashkit.cli.main import main
from dflashkit.drafter.checkpoint import save_drafter
from dflashkit.drafter.identity import drafter_config_for
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.target.adapter import TargetAdapter
from tests.cli.helpers import PROMPT, fake_model, make_tokenizer, refused
from tests.conftest import tiny_target

JSON_KEYS = {
    "text",
    "new_tokens",
    "tau",
    "tokens_per_s",
    "dtype",
    "block_size",
    "time_s",
    "ar_text",
    "identical",
    "speedup",
    "divergence",
}


def cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    rc = main(["generate", PROMPT, "--max-new-tokens", "10", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_compare_ar_fp32(loads, capsys) -> None:
    rc, out, err = cli(capsys, "--drafter", "untrained", "--compare-ar", "--json", "--dtype", "float32")
    assert rc == 0, err
    result = json.loads(out)  # stdout is exactly ONE JSON object
    assert isinstance(result, dict) and JSON_KEYS <= set(result)
    assert {"draft", "verify", "other"} <= set(result["time_s"])
    assert all(isinstance(v, float) and v >= 0 for v in result["time_s"].values())
    assert result["dtype"] == "float32" and result["block_size"] == 16  # the untrained drafter's block size
    assert result["identical"] is True and result["divergence"] is None
    assert result["text"] == result["ar_text"] and result["text"]
    assert 1 < result["new_tokens"] <= 10
    assert result["tau"] >= 1.0 and result["tokens_per_s"] > 0 and result["speedup"] > 0
    assert result["speculative"] is True
    assert "UNTRAINED" in err
    assert loads and loads[0][0] is None and loads[0][1] == torch.float32


def test_json_compare_ar_bf16_default(loads, capsys) -> None:
    rc, out, err = cli(capsys, "--drafter", "untrained", "--compare-ar", "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert JSON_KEYS <= set(result) and result["dtype"] == "bfloat16"
    assert loads[0][1] == torch.bfloat16
    assert isinstance(result["identical"], bool)
    if result["identical"]:
        assert result["divergence"] is None
    else:  # in bf16 outputs may only part at a numerical tie
        d = result["divergence"]
        assert set(d) >= {"index", "spec_token", "ar_token", "margin", "max_abs_logit", "tie"} and d["tie"] is True


def test_drafter_none_is_autoregressive(loads, capsys) -> None:
    rc, out, err = cli(capsys, "--drafter", "none", "--json", "--dtype", "float32")
    assert rc == 0, err
    result = json.loads(out)
    assert result["block_size"] == 1 and result["tau"] == 1.0 and result["speculative"] is False
    assert "autoregressive" in err
    rc, out, err = cli(capsys, "--drafter", "none", "--dtype", "float32")
    assert rc == 0 and "autoregressive" in err and out.strip()


def test_prompt_lookup_flags(loads, capsys) -> None:
    """Prompt lookup is on by default with a drafter, off with --no-lookup, and alone with --drafter none --lookup."""
    runs = {}
    for name, args in {
        "default": ["--drafter", "untrained"],
        "off": ["--drafter", "untrained", "--no-lookup"],
        "alone": ["--drafter", "none", "--lookup"],
        "plain": ["--drafter", "none"],
    }.items():
        rc, out, err = cli(capsys, *args, "--json", "--dtype", "float32", "--compare-ar")
        assert rc == 0, err
        runs[name] = json.loads(out)
        assert runs[name]["identical"] is True
    assert runs["default"]["stats"]["lookup"] is not None and runs["off"]["stats"]["lookup"] is None
    alone = runs["alone"]["stats"]
    assert alone["lookup"]["drafter_steps"] + alone["lookup"]["copied_steps"] == alone["steps"]
    assert (
        runs["alone"]["block_size"] > 1
        and runs["plain"]["block_size"] == 1
        and runs["plain"]["stats"]["lookup"] is None
    )


def test_no_shipped_drafter_means_prompt_lookup_alone(loads, capsys) -> None:
    """Without --drafter, a target that no drafter ships for decodes with prompt lookup alone (its copies sized per
    step), identical to plain decoding; --no-lookup and --drafter none decode plainly."""
    runs = {}
    for name, args in {"default": [], "no-lookup": ["--no-lookup"], "none": ["--drafter", "none"]}.items():
        rc, out, err = cli(capsys, *args, "--json", "--dtype", "float32", "--compare-ar")
        assert rc == 0, err
        runs[name] = (json.loads(out), err)
        assert runs[name][0]["identical"] is True and runs[name][0]["speculative"] is False
    default, err = runs["default"]
    assert default["stats"]["lookup"] is not None and default["stats"]["adaptive"] and default["block_size"] == 16
    assert "No trained drafter ships for this target yet: prompt lookup alone" in err
    no_lookup, err = runs["no-lookup"]
    assert no_lookup["stats"]["lookup"] is None and no_lookup["block_size"] == 1
    assert "decoding autoregressively (--no-lookup)" in err
    none, err = runs["none"]
    assert none["stats"]["lookup"] is None and none["block_size"] == 1 and "autoregressive" in err


def test_sampler_flag(loads, capsys) -> None:
    """Sampled with --seed: coupled sampling by default, identical to plain sampling of the seed under --compare-ar;
    without a seed, or with --sampler rejection, the rejection sampler (whose outputs are not compared by token)."""
    common = ["--drafter", "untrained", "--temperature", "1", "--dtype", "float32", "--compare-ar"]
    rc, out, err = cli(capsys, *common, "--seed", "3", "--json")
    assert rc == 0, err
    run = json.loads(out)
    assert run["stats"]["sampler"] == "coupled" and run["identical"] is True and run["divergence"] is None
    rc, out, err = cli(capsys, *common, "--seed", "3", "--sampler", "rejection", "--json")
    assert rc == 0 and json.loads(out)["stats"]["sampler"] == "rejection"
    rc, out, err = cli(capsys, *common, "--seed", "3")
    assert rc == 0 and "identical output" in err and "(coupled sampling)" not in err  # the sampler: --verbose
    rc, out, err = cli(capsys, *common, "--seed", "3", "--verbose")
    assert rc == 0 and "(coupled sampling)" in err and "identical output" in err
    rc, out, err = cli(capsys, *common)  # no seed: the rejection sampler, whose outputs are not compared by token
    assert rc == 0 and "outputs not compared" in err and "--seed" in err
    with pytest.raises(SystemExit):  # argparse refuses a sampler it does not know
        cli(capsys, *common, "--sampler", "gumbel")
    assert "--sampler" in capsys.readouterr().err


def test_token_tree_flag(loads, capsys) -> None:
    """--tree N: drafter steps verify token trees (reported in the stats and the summary line); output unchanged."""
    rc, out, err = cli(
        capsys, "--drafter", "untrained", "--no-lookup", "--tree", "5", "--json", "--dtype", "float32", "--compare-ar"
    )
    assert rc == 0, err
    run = json.loads(out)
    assert run["identical"] is True
    tree = run["stats"]["tree"]
    assert tree["budget"] == 5 and tree["tree_steps"] > 0 and 0 < tree["mean_nodes"] <= 5
    assert run["block_size"] == 16 and not run["stats"]["adaptive"]  # the untrained drafter's own block size
    rc, out, err = cli(capsys, "--drafter", "untrained", "--tree", "5", "--dtype", "float32", "--verbose")
    assert rc == 0 and "token trees of up to 5 nodes" in err
    loads.clear()
    last = refused(capsys, ["generate", PROMPT, "--drafter", "untrained", "--tree", "-1", "--json"])
    assert "--tree: must be at least 0 (0: chains), got -1" in last and loads == []
    # 0: chains, even where a seeded sampled generation would verify trees by default
    rc, out, err = cli(
        capsys,
        "--drafter",
        "untrained",
        "--tree",
        "0",
        "--temperature",
        "1",
        "--seed",
        "3",
        "--json",
        "--dtype",
        "float32",
    )
    assert rc == 0, err
    run = json.loads(out)
    assert run["stats"]["tree"] is None and run["stats"]["adaptive"] and "--tree has no effect" not in err
    rc, out, err = cli(capsys, "--drafter", "none", "--tree", "5", "--dtype", "float32")
    assert rc == 0 and "--tree has no effect without a drafter" in err


def test_draft_window_flag(loads, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """--draft-window N reaches the drafter's context (0: the whole context); output unchanged; bad values refused."""
    from dflashkit.drafter.network import DFlashDrafter

    windows = []
    new_context = DFlashDrafter.new_context

    def recording(self, capacity=256, window=None):
        windows.append(window)
        return new_context(self, capacity, window)

    monkeypatch.setattr(DFlashDrafter, "new_context", recording)
    for flag, window in (("3", 3), ("0", None)):
        rc, out, err = cli(
            capsys,
            "--drafter",
            "untrained",
            "--no-lookup",
            "--draft-window",
            flag,
            "--json",
            "--dtype",
            "float32",
            "--compare-ar",
        )
        assert rc == 0, err
        assert json.loads(out)["identical"] is True and windows[-1] == window
    loads.clear()
    last = refused(capsys, ["generate", PROMPT, "--drafter", "untrained", "--draft-window", "-2"])
    assert "--draft-window: must be at least 0" in last and loads == []


def test_proposal_temperature_flag(loads, capsys, proposal_temperatures: list) -> None:
    """--proposal-temperature RATIO reaches the decode loop (default: the drafter's own); bad values refused early."""
    for flags, ratio in ((["--proposal-temperature", "0.6"], 0.6), ([], None)):
        proposal_temperatures.clear()
        rc, out, err = cli(
            capsys,
            "--drafter",
            "untrained",
            "--no-lookup",
            "--temperature",
            "1",
            "--seed",
            "3",
            "--sampler",
            "rejection",
            "--dtype",
            "float32",
            *flags,
        )
        assert rc == 0, err
        assert proposal_temperatures and set(proposal_temperatures) == {ratio}
    loads.clear()
    rc, out, err = cli(capsys, "--drafter", "untrained", "--temperature", "1", "--proposal-temperature", "-1")
    assert rc == 2 and "proposal temperature" in err and loads == []


class RecordingStdout:
    """Stands in for sys.stdout and keeps every write, to see the text arrive in pieces."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return len(s)

    def flush(self) -> None:
        pass


def test_streams_text_to_stdout_and_stats_to_stderr(loads, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out, err = cli(capsys, "--drafter", "untrained", "--json", "--dtype", "float32")
    assert rc == 0
    expected = json.loads(out)["text"]

    fake = RecordingStdout()
    monkeypatch.setattr(sys, "stdout", fake)
    rc = main(["generate", PROMPT, "--max-new-tokens", "10", "--drafter", "untrained", "--dtype", "float32"])
    _, err = capsys.readouterr()
    assert rc == 0, err
    out = "".join(fake.writes)
    assert out == expected + "\n"  # the streamed text, then a newline
    assert len([w for w in fake.writes if w.strip()]) > 1  # it arrived in several pieces
    assert "tok/s" in err and "τ" in err and "tok/s" not in out and "{" not in out


def test_compare_ar_summary_on_stderr(loads, capsys) -> None:
    rc, out, err = cli(capsys, "--drafter", "untrained", "--compare-ar", "--dtype", "float32")
    assert rc == 0
    stats, comparison = err.strip().splitlines()[-2:]
    assert re.fullmatch(
        r"10 tokens in [\d.]+ s, [\d.]+ tok/s · τ [\d.]+ tokens per target pass · stopped at --max-new-tokens 10", stats
    ), stats
    found = re.fullmatch(
        r"plain decoding ([\d.]+) tok/s vs speculative ([\d.]+) tok/s after the prompt → ([\d.]+)x (faster|slower), "
        r"identical output",
        comparison,
    )
    assert found, comparison
    plain, spec, ratio = (float(found[i]) for i in (1, 2, 3))
    shown = spec / plain if found[4] == "faster" else plain / spec  # the ratio is the two rates shown, rounded
    assert abs(shown - ratio) <= 0.06 * ratio + 0.01, (comparison, shown)
    assert "plain decoding" not in out


def test_compare_ar_without_a_drafter_calls_no_speedup(loads, capsys) -> None:
    """Without a drafter or prompt lookup both runs are plain: the line gives their rates, not a 'speedup'."""
    rc, _, err = cli(capsys, "--drafter", "none", "--compare-ar", "--dtype", "float32")
    assert rc == 0
    comparison = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"both runs decode plainly \(no drafter, no prompt lookup\): [\d.]+ and [\d.]+ tok/s, identical output",
        comparison,
    ), comparison


def test_drafter_folder(loads, capsys, tmp_path: Path) -> None:
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config_for(fake_model(), num_layers=2, block_size=5))
    save_drafter(drafter, tmp_path / "drafter")
    rc, out, err = cli(capsys, "--drafter", str(tmp_path / "drafter"), "--compare-ar", "--json", "--dtype", "float32")
    assert rc == 0, err
    result = json.loads(out)
    assert result["block_size"] == 5 and result["speculative"] is True
    assert result["identical"] is True and result["divergence"] is None
    rc, out, err = cli(
        capsys, "--drafter", str(tmp_path / "drafter"), "--block-size", "3", "--json", "--dtype", "float32"
    )
    assert rc == 0 and json.loads(out)["block_size"] == 3


def test_drafter_folder_for_another_target(loads, capsys, tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(drafter_config_for(fake_model(seed=7), num_layers=2)), tmp_path / "other")
    rc, out, err = cli(capsys, "--drafter", str(tmp_path / "other"))
    assert rc == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith("error:") and "fingerprint" in err


def test_missing_drafter_folder(loads, capsys, tmp_path: Path) -> None:
    rc, out, err = cli(capsys, "--drafter", str(tmp_path / "no-such-drafter"))
    assert rc == 2 and out == "" and loads == []  # refused before the target loads
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: no drafter folder") and "no-such-drafter" in last and "Traceback" not in err


def test_shipped_drafter_by_name(loads, capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--drafter NAME loads the shipped drafter of that name; a folder of the same name in the working directory
    wins over it; an unknown name is refused before anything loads, with the shipped names."""
    shipped = tmp_path / "shipped"
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(drafter_config_for(fake_model(), num_layers=1, block_size=3)), shipped / "tiny-drafter")
    monkeypatch.setattr(dflashkit.drafter.registry, "DRAFTERS_DIR", shipped)
    rc, out, err = cli(capsys, "--drafter", "tiny-drafter", "--json", "--dtype", "float32")
    assert rc == 0, err
    assert json.loads(out)["block_size"] == 3 and json.loads(out)["speculative"] is True
    local = tmp_path / "cwd"
    save_drafter(DFlashDrafter(drafter_config_for(fake_model(), num_layers=1, block_size=5)), local / "tiny-drafter")
    monkeypatch.chdir(local)
    rc, out, err = cli(capsys, "--drafter", "tiny-drafter", "--json", "--dtype", "float32")
    assert rc == 0 and json.loads(out)["block_size"] == 5  # the path wins
    loads.clear()
    rc, out, err = cli(capsys, "--drafter", "tiny-draftr")
    assert rc == 2 and loads == [] and "no shipped drafter of that name (shipped: tiny-drafter;" in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--block-size", "1"], "--block-size: must be at least 2"),
        (["--block-size", "0"], "--block-size: must be at least 2"),
        (["--block-size", "big"], "--block-size: expected an integer >= 2 or 'auto'"),
        (["--temperature", "-1"], "--temperature: must be >= 0"),
        (["--temperature", "nan"], "--temperature: expected a finite number"),
        (["--top-p", "0"], "--top-p: must be in (0, 1]"),
        (["--top-p", "2"], "--top-p: must be in (0, 1]"),
        (["--top-k", "-1"], "--top-k: must be at least 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
        (["--max-new-tokens", "ten"], "--max-new-tokens: expected an integer"),
        (["--tree", "-3"], "--tree: must be at least 0"),
        (["--draft-window", "-1"], "--draft-window: must be at least 0"),
        (["--threads", "0"], "--threads: must be at least 1"),
    ],
)
def test_bad_arguments_are_refused_by_the_parser(loads, capsys, args: list[str], message: str) -> None:
    """Bad values end the run while the command line is parsed: exit 2, one line naming the flag, no load."""
    from dflashkit.cli.main import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    commands = [["generate", PROMPT, "--json"]]
    if args[0] in sub.choices["chat"]._option_string_actions:
        commands.append(["chat"])
    for command in commands:
        last = refused(capsys, [*command, "--drafter", "untrained", *args])
        assert message in last, last
    assert loads == []


@pytest.mark.parametrize("prompt", ["", "  \n\t "])
def test_empty_or_blank_prompt(loads, capsys, monkeypatch: pytest.MonkeyPatch, prompt: str) -> None:
    """An empty or whitespace-only prompt (given, or on standard input with -) is refused before the model loads."""
    import io

    rc = main(["generate", prompt, "--drafter", "untrained"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == "error: the prompt is empty: give the text to answer" and loads == []
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompt))
    rc = main(["generate", "-", "--drafter", "untrained"])
    err = capsys.readouterr().err
    assert rc == 2 and "the prompt is empty (nothing on standard input)" in err and loads == []


def test_no_cuda_graphs_reaches_the_target(loads, capsys, monkeypatch) -> None:
    """--no-cuda-graphs is handed to the target adapter (on a CPU the fast forward never uses graphs anyway)."""
    seen = []
    original = TargetAdapter.__init__

    def spy(self, *args, cuda_graphs=True, **kwargs):
        seen.append(cuda_graphs)
        original(self, *args, cuda_graphs=cuda_graphs, **kwargs)

    monkeypatch.setattr(TargetAdapter, "__init__", spy)
    rc, out, err = cli(capsys, "--drafter", "untrained", "--json", "--no-cuda-graphs")
    assert rc == 0, err
    assert seen and not any(seen)
    assert "CUDA graphs" not in json.loads(out)["engine"]


def test_structured_output_flags(capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--regex / --json-schema / --json-object constrain the output (spec == plain); bad grammars are refused
    before the model loads; the flags exclude one another."""
    from tests.conftest import BYTE_VOCAB, byte_tokenizer

    calls = []

    def byte_load_target(name_or_path=None, *, dtype=torch.bfloat16, device="cpu", progress=False, quantize=None):
        calls.append(name_or_path)
        return tiny_target("llama", vocab_size=BYTE_VOCAB, dtype=dtype).requires_grad_(False), byte_tokenizer()

    monkeypatch.setattr(dflashkit.target.loading, "load_target", byte_load_target)
    monkeypatch.setattr(dflashkit.drafter.registry, "DRAFTERS_DIR", Path("/nonexistent"))
    base = ["--drafter", "untrained", "--json", "--dtype", "float32", "--compare-ar", "--max-new-tokens", "200"]
    rc = main(["generate", "hello", *base, "--regex", "(ab|cd)+x"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    result = json.loads(out)
    assert re.fullmatch("(ab|cd)+x", result["text"]) and result["identical"] is True
    rc = main(["generate", "hello", *base, "--choice", "left", "--choice", "right turn"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["text"] in ("left", "right turn") and json.loads(out)["identical"] is True
    assert result["stats"]["grammar"] == "regex" and result["finish_reason"] == "stop"
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            }
        )
    )
    rc = main(["generate", "hello", *base, "--json-schema", str(schema)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert set(json.loads(json.loads(out)["text"])) == {"ok"}
    calls.clear()
    for bad, message in (
        (["--json-schema", str(tmp_path / "missing.json")], "cannot read"),
        (["--json-schema", "{not json"], "not valid JSON"),
        (["--regex", ""], "needs its text"),
    ):
        rc = main(["generate", "hello", *base, *bad])
        out, err = capsys.readouterr()
        assert rc == 2 and message in err and calls == [], (bad, err)
    rc = main(["generate", "hello", *base, "--regex", "[a-"])  # refused by the grammar compiler, after the load
    out, err = capsys.readouterr()
    assert rc == 2 and "invalid regex grammar" in err
    with pytest.raises(SystemExit) as info:
        main(["generate", "hello", "--json-object", "--regex", "x"])
    assert info.value.code == 2


def test_notes_for_ignored_flags_and_the_context_limit(loads, capsys) -> None:
    rc, out, err = cli(capsys, "--drafter", "untrained", "--tree", "3", "--eager")
    assert rc == 0 and "--tree has no effect with --eager" in err
    rc, out, err = cli(capsys, "--drafter", "untrained", "--tree", "3", "--frequency-penalty", "0.5")
    assert rc == 0 and "--tree has no effect with penalties" in err
    rc, out, err = cli(capsys, "--drafter", "none", "--draft-window", "5")
    assert rc == 0 and "--draft-window has no effect without a drafter" in err
    rc = main(["generate", PROMPT, "--drafter", "none", "--max-new-tokens", "100000", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and "leaves room for" in err and json.loads(out)["finish_reason"] == "length"


def test_logprobs_flag(loads, capsys) -> None:
    """--logprobs K: a 'logprobs' list in --json (one entry per token, K alternatives, the likeliest first), a
    table after the summary otherwise; a K outside 0..20 is refused before the model loads."""
    rc, out, err = cli(capsys, "--drafter", "untrained", "--json", "--dtype", "float32", "--logprobs", "2")
    assert rc == 0, err
    result = json.loads(out)
    entries = result["logprobs"]
    assert len(entries) == result["new_tokens"] and all(e["token"] in result["text"] for e in entries)
    for e in entries:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        assert e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6
    assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the last token is the likeliest
    rc, out, err = cli(capsys, "--drafter", "untrained", "--logprobs", "0")
    assert rc == 0 and "log-probabilities under the target" in out
    n = len(loads)
    rc, out, err = cli(capsys, "--logprobs", "21")
    assert rc == 2 and "logprobs" in err and len(loads) == n


def test_penalty_flags(loads, capsys) -> None:
    """--frequency-penalty etc. change the output and keep it identical to plain decoding; bad values are
    refused before the model loads."""
    rc, out, err = cli(capsys, "--drafter", "untrained", "--json", "--dtype", "float32", "--compare-ar")
    plain = json.loads(out)
    rc, out, err = cli(
        capsys,
        "--drafter",
        "untrained",
        "--json",
        "--dtype",
        "float32",
        "--compare-ar",
        "--frequency-penalty",
        "2",
        "--repetition-penalty",
        "3",
    )
    assert rc == 0, err
    result = json.loads(out)
    assert result["identical"] is True and result["text"] != plain["text"]
    n = len(loads)
    for flag, value in (("--presence-penalty", "3"), ("--repetition-penalty", "0")):
        rc, out, err = cli(capsys, flag, value)
        assert rc == 2 and "penalty" in err and len(loads) == n


def test_prompt_from_stdin_and_a_system_message(loads, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    def run(*args: str, stdin: str | None = None) -> dict:
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        rc = main(["generate", *args, "--drafter", "none", "--max-new-tokens", "4", "--json", "--dtype", "float32"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        return json.loads(out)

    direct = run(PROMPT)
    piped = run("-", stdin=PROMPT)
    assert piped["text"] == direct["text"] and piped["stats"]["prompt_tokens"] == direct["stats"]["prompt_tokens"]
    system = run(PROMPT, "--system", "a story")
    assert system["stats"]["prompt_tokens"] == direct["stats"]["prompt_tokens"] + 3  # "system a story"
    n = len(loads)
    assert main(["generate", PROMPT, "--system", "x", "--no-chat"]) == 2
    assert "--system needs the chat template" in capsys.readouterr().err and len(loads) == n
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["generate", "-", "--drafter", "none"]) == 2 and "nothing on standard input" in capsys.readouterr().err
    assert len(loads) == n  # refused before the model loads


def test_generate_with_tools(capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--tools / --tool-choice: a forced call comes out as a tool call (spec == plain), printed and in --json;
    bad tool flags are refused before the model loads; a template without tools is refused after it."""
    from tests.conftest import BYTE_VOCAB, byte_tokenizer
    from tests.live_server import TOOLS_TEMPLATE

    calls, template = [], [TOOLS_TEMPLATE]

    def tool_load_target(name_or_path=None, *, dtype=torch.bfloat16, device="cpu", progress=False, quantize=None):
        calls.append(name_or_path)
        tokenizer = byte_tokenizer()
        tokenizer.chat_template = template[0]
        model = tiny_target("llama", vocab_size=BYTE_VOCAB, max_position_embeddings=2048, dtype=dtype)
        return model.requires_grad_(False), tokenizer

    monkeypatch.setattr(dflashkit.target.loading, "load_target", tool_load_target)
    monkeypatch.setattr(dflashkit.drafter.registry, "DRAFTERS_DIR", Path("/nonexistent"))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "pick",
                "parameters": {
                    "type": "object",
                    "properties": {"color": {"enum": ["red", "green"]}},
                    "required": ["color"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(tools))
    base = ["--drafter", "untrained", "--dtype", "float32", "--max-new-tokens", "400", "--tools", str(path)]
    rc = main(["generate", "Pick one.", *base, "--tool-choice", "pick", "--json", "--compare-ar"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    result = json.loads(out)
    assert result["identical"] is True and result["finish_reason"] == "stop"
    (call,) = result["tool_calls"]
    assert call["function"]["name"] == "pick" and json.loads(call["function"]["arguments"])["color"] in ("red", "green")
    rc = main(["generate", "Pick one.", *base[:-2], "--tools", json.dumps(tools), "--tool-choice", "required"])
    out, err = capsys.readouterr()
    assert rc == 0 and re.search(r'^tool call: pick\(\{"color": "(red|green)"\}\)$', out, re.MULTILINE), (out, err)
    calls.clear()
    for bad, message in (
        (["--tool-choice", "sometimes"], "not among the tools"),
        (["--tools", '[{"type": "x"}]'], "tools[0] must be"),
        (["--tools", "[not json"], "not valid JSON"),
        (["--tools", str(tmp_path / "none.json")], "cannot read"),
        (["--no-chat"], "--no-chat"),
        (["--tool-choice", "required", "--json-object"], "structured-output flag"),
    ):
        rc = main(["generate", "Pick one.", *base, *bad])
        out, err = capsys.readouterr()
        assert rc == 2 and message in err and calls == [], (bad, err)
    rc = main(["generate", "hi", "--tool-choice", "required"])
    assert rc == 2 and "--tool-choice needs --tools" in capsys.readouterr().err
    template[0] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    rc = main(["generate", "Pick one.", *base])
    assert rc == 2 and "no tools" in capsys.readouterr().err


def test_chat_turns_reuse_the_conversation(loads, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dflashkit chat` reads one message per line: each answer streams to stdout and a stats line to stderr; the
    second turn restores the first (its stats say how many tokens) and answers as a fresh run of the whole
    conversation does; /reset starts over, /exit stops reading; bad flags fail before the model loads."""
    import io

    from dflashkit import SpeculativeGenerator

    lines = "tell me a story\nabout the sea\n/reset\nhello world\n/exit\nnever read\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    rc = main(["chat", "--drafter", "untrained", "--max-new-tokens", "6", "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    answers = out.splitlines()
    stats = [line for line in err.splitlines() if line.startswith("[") and "tok/s" in line]
    assert len(answers) == len(stats) == 3 and "[new conversation]" in err
    assert "restored" not in stats[0] and int(re.search(r"(\d+) restored", stats[1]).group(1)) > 10
    plain = SpeculativeGenerator(fake_model(), make_tokenizer())  # the same target, no drafter, no cache
    messages = [
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": answers[0]},
        {"role": "user", "content": "about the sea"},
    ]
    assert plain.generate(messages, max_new_tokens=6).text == answers[1]
    assert plain.generate("hello world", max_new_tokens=6).text == answers[2]
    n = len(loads)
    assert main(["chat", "--prefix-cache-mb", "-1"]) == 2 and "MiB" in capsys.readouterr().err
    assert "--temperature: must be >= 0" in refused(capsys, ["chat", "--temperature", "-1"]) and len(loads) == n
