"""`bench --quick` sized to the CPU: the plan from made-up speeds (no model), and the command applying a plan."""

from __future__ import annotations

import json

import pytest

import dflashkit.bench.quick
from dflashkit.bench.command import QUICK, bench_parser, settings_from
from dflashkit.bench.quick import (
    ESTIMATE_MARGIN,
    QUICK_BUDGET_S,
    WARMUP_TOKENS,
    QuickMethod,
    Speed,
    describe,
    plan_quick,
)
from dflashkit.cli.main import main
from tests.bench.test_command import questions, tiny_load  # noqa: F401 (fixtures)

# what the quick preset runs with the shipped drafter and no llama.cpp: the baseline, DFlash at 4 block sizes with
# and without prompt lookup, prompt lookup alone, transformers' generate plain and with prompt lookup
BLOCKS = [4, 8, 16, "auto"]
DFLASH = [
    QuickMethod(f"{family}-{'auto' if b == 'auto' else f'b{b}'}", "dflashkit", b)
    for family in ("dflash", "dflash-lookup")
    for b in BLOCKS
]
PEERS = [QuickMethod("hf-generate", "transformers"), QuickMethod("hf-prompt-lookup", "transformers")]
METHODS = [QuickMethod("ar", "dflashkit"), *DFLASH, QuickMethod("lookup", "dflashkit"), *PEERS]
SETTINGS = settings_from(bench_parser().parse_args(["--quick"]))
PROMPTS = {2: 6, 1: 3}  # mt-bench, humaneval, math500: first turns of 2 (or 1) questions each


def speeds_of(loop: float, hf: float, dflash: float | None = None) -> dict[str, Speed]:
    """Made-up measurements: the baseline's, the DFlash method's (it stands for all of them), the two peers'."""
    speeds = {"ar": Speed(0.2, loop), "dflash-auto": Speed(0.3, dflash or loop)}
    return speeds | {"hf-generate": Speed(0.4, hf), "hf-prompt-lookup": Speed(0.4, hf * 1.1)}


def plan(loop: float, hf: float, *, dflash: float | None = None, fixed: frozenset[str] = frozenset()):
    speeds = speeds_of(loop, hf, dflash)
    return plan_quick(METHODS, speeds, SETTINGS, PROMPTS.__getitem__, QUICK_BUDGET_S, fixed), speeds


def test_the_estimate_is_the_sum_of_every_generation_at_its_measured_speed() -> None:
    ar, dflash, hf = Speed(0.5, 10.0), Speed(0.5, 20.0), Speed(1.0, 2.0)
    assert ar.seconds(64) == pytest.approx(0.5 + 63 / 10)
    methods = [METHODS[0], DFLASH[0], DFLASH[3], PEERS[0], QuickMethod("llama-server-bf16", "llama.cpp")]
    speeds = {"ar": ar, "dflash-auto": dflash, "hf-generate": hf}
    p = plan_quick(methods, speeds, SETTINGS, PROMPTS.__getitem__, 1e9)

    def one(speed: Speed) -> float:  # the warm-up, then 6 prompts x 2 temperatures x 64 tokens
        return speed.seconds(WARMUP_TOKENS) + 12 * speed.seconds(64)

    # dflash-b4 is not measured: the measured DFlash method stands for it; llama-server-bf16 not measured: ar does;
    # the sum is scaled by the margin a real run needed over its raw estimate
    assert p.estimate_s == pytest.approx(ESTIMATE_MARGIN * (one(ar) + 2 * one(dflash) + one(hf) + one(ar)))
    assert plan_quick(methods, speeds, SETTINGS, PROMPTS.__getitem__, 1e9, margin=1.0).estimate_s == pytest.approx(
        p.estimate_s / ESTIMATE_MARGIN
    )
    assert p.estimate_s == p.full_estimate_s and not p.cuts and p.fits


def test_a_fast_cpu_runs_the_whole_preset() -> None:
    p, speeds = plan(loop=400.0, hf=150.0)
    assert p.fits and not p.cuts and not p.left_out
    assert (p.limit, p.max_new_tokens, p.temperatures, p.block_sizes) == (2, 64, [0.0, 1.0], BLOCKS)
    assert p.max_new_tokens == QUICK["max_new_tokens"]
    assert "nothing cut" in "\n".join(describe(p, speeds))


def test_a_laptop_cpu_leaves_out_the_slow_transformers_peers_first() -> None:
    """The case reported: transformers' bf16 generate at a few tokens per second made the preset take over 15
    minutes; the sizing leaves those methods out first, the slowest first, says why, then cuts only what still
    does not fit."""
    p, speeds = plan(loop=30.0, hf=3.0)
    assert p.full_estimate_s > 15 * 60  # the preset would not have finished in 15 minutes
    assert list(p.left_out) == ["hf-generate", "hf-prompt-lookup"]  # the slowest first
    assert "3.0 tok/s here" in p.left_out["hf-generate"] and "--methods ar,hf runs it" in p.left_out["hf-generate"]
    assert "--methods ar,hf-pld runs it" in p.left_out["hf-prompt-lookup"]
    assert p.fits and p.estimate_s <= QUICK_BUDGET_S
    assert p.cuts[0].startswith("left out the peers slower than dflashkit's plain decoding: hf-generate (3.0 tok/s")
    # dropping the peers left 10 dflashkit methods x 12 generations of 64 tokens at 30 tok/s: still over, so 32 tokens
    assert p.max_new_tokens == 32 and p.block_sizes == BLOCKS and p.temperatures == [0.0, 1.0] and p.limit == 2
    text = "\n".join(describe(p, speeds))
    assert "ar 30.0, dflash-auto 30.0, hf-generate 3.0, hf-prompt-lookup 3.3" in text
    assert "32 new tokens per turn instead of 64" in text and "--quick: running 2 question(s)" in text


def test_only_as_many_slow_peers_go_as_needed() -> None:
    p, _ = plan(loop=90.0, hf=12.0)  # one peer out is enough
    assert list(p.left_out) == ["hf-generate"] and p.max_new_tokens == 64 and p.fits


def test_the_drafters_measured_speed_counts() -> None:
    """An untrained drafter makes DFlash slower than plain decoding, a trained one faster: the same CPU gets
    different plans."""
    untrained, _ = plan(loop=40.0, hf=60.0, dflash=15.0)
    trained, _ = plan(loop=40.0, hf=60.0, dflash=90.0)
    assert untrained.full_estimate_s > trained.full_estimate_s and len(untrained.cuts) > len(trained.cuts)
    assert not trained.cuts and untrained.max_new_tokens == 32


def test_slower_cpus_get_more_cuts_in_order() -> None:
    counts = [len(plan(loop=loop, hf=loop / 5)[0].cuts) for loop in (400.0, 25.0, 12.0, 6.0, 3.0, 0.8)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 5  # slower CPUs: more cuts
    slowest, speeds = plan(loop=0.8, hf=0.2)
    assert (slowest.limit, slowest.max_new_tokens, slowest.temperatures, slowest.block_sizes) == (
        1,
        32,
        [0.0],
        ["auto"],
    )
    assert set(slowest.left_out) == {m.name for m in PEERS} | {m.name for m in DFLASH if m.block_size != "auto"}
    assert [c.split(" ")[0] for c in slowest.cuts] == ["left", "32", "DFlash", "greedy", "1"]  # the documented order
    assert not slowest.fits  # even the smallest run is over: said so, and it runs anyway
    assert "over the budget even after every cut" in "\n".join(describe(slowest, speeds))
    assert slowest.estimate_s < slowest.full_estimate_s / 10


def test_options_given_explicitly_are_never_cut() -> None:
    p, _ = plan(loop=3.0, hf=0.5, fixed=frozenset({"methods", "max_new_tokens", "temperatures"}))
    assert not set(p.left_out) & {m.name for m in PEERS} and p.max_new_tokens == 64 and p.temperatures == [0.0, 1.0]
    assert p.block_sizes == ["auto"] and p.limit == 1  # what was not fixed was cut


def test_peers_faster_than_plain_decoding_are_not_left_out() -> None:
    p, _ = plan(loop=20.0, hf=60.0)
    assert not set(p.left_out) & {m.name for m in PEERS} and p.max_new_tokens == 32


def test_the_command_applies_the_plan_and_says_why(tiny_load, questions, tmp_path, capsys, monkeypatch) -> None:  # noqa: F811
    """On the tiny target with slow made-up speeds: the run uses the cut settings, the transformers methods are
    listed as skipped with the reason, and the output says what was measured and chosen."""
    measured = []

    def fake_speeds(methods, prompt_ids, stop):
        measured.extend(m.name for m in methods)
        return {"ar": Speed(0.1, 10.0), "dflash-auto": Speed(0.1, 10.0), "hf-generate": Speed(0.2, 1.0)}

    monkeypatch.setattr(dflashkit.bench.quick, "measure_speeds", fake_speeds)
    out = tmp_path / "out"
    args = ["bench", "--quick", "--datasets", questions, "--drafter", "untrained", "--threads", "1"]
    rc = main([*args, "--out", str(out), "--json", str(tmp_path / "r.json"), "--no-progress"])
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    assert "hf-prompt-lookup" in measured and "hf-assisted" not in measured  # what can run here
    assert "--quick: measured tokens per second after the first: ar 10.0, dflash-auto 10.0, hf-generate 1.0" in stderr
    assert "--quick: left out the peers slower than dflashkit's plain decoding: hf-generate (1.0 tok/s" in stderr
    assert "skipped hf-generate: left out by --quick: 1.0 tok/s here" in stderr
    assert "--quick: running" in stderr and "--quick: took" in stderr
    data = json.loads((tmp_path / "r.json").read_text())
    status = {m["name"]: m["status"] for m in data["methods"]}
    assert status["hf-generate"] == "skipped" and status["ar"] == "ran"
    s = data["settings"]
    assert s["quick_plan"]["cuts"] and s["quick_plan"]["estimate_s"] > 0 and s["quick_plan"]["spent_s"] > 0
    # 10 dflashkit methods + hf-prompt-lookup x 2 questions x 2 temperatures of 64 tokens at 10 tok/s: over 5 minutes
    assert s["max_new_tokens"] == 32 and max(r["new_tokens"] for r in data["runs"]) <= 32
    assert s["temperatures"] == [0.0, 1.0] and s["limit"] == 2 and "temperature 1:" in stdout
    assert {r["method"] for r in data["runs"]} >= {"ar", "dflash-b4", "dflash-auto", "lookup"}
