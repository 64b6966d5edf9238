"""The benchmark loop on tiny random models: interleaving, multi-turn, skips, losslessness verdicts, outputs."""

from __future__ import annotations

import json

import pytest
import torch

from dflashkit.bench import methods as bench_methods
from dflashkit.bench.methods import (
    EXACT,
    Autoregressive,
    DFlash,
    Method,
    Record,
    Request,
    TargetSession,
    Unavailable,
    run_decode_loop,
)
from dflashkit.bench.peers import LlamaCpp, TransformersGenerate
from dflashkit.bench.plots import PLOTS
from dflashkit.bench.report import as_json, retention_table, summary_table, write_outputs
from dflashkit.bench.runner import BenchConfig, run_bench
from dflashkit.decoding.defaults import COUPLED_TREE
from dflashkit.errors import InvalidInputError
from dflashkit.kernels import row_kernels
from tests.conftest import tiny_drafter, tiny_target, word_tokenizer


@pytest.fixture
def questions(tmp_path) -> str:
    path = tmp_path / "tiny.jsonl"
    rows = [
        {"question_id": i, "category": "c", "turns": [f"w{10 + i} w11 w12 w13", f"w{20 + i} w21"]} for i in range(3)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def make_session(dtype: torch.dtype = torch.float32) -> TargetSession:
    return TargetSession(tiny_target("llama", dtype=dtype), word_tokenizer())


class Spy(Method):
    """The baseline's loop, recording what it was asked (and in which order methods ran)."""

    family = "test"

    def __init__(self, session: TargetSession, name: str, calls: list) -> None:
        self.inner, self.name, self.calls = Autoregressive(session), name, calls

    def generate(self, request: Request) -> Record:
        self.calls.append((self.name, request))
        return self.inner.generate(request)


class Corrupt(Method):
    """A 'dflashkit' method with a bug: the baseline's tokens with token 3 replaced by its least likely one."""

    name, family, comparable = "buggy", "dflashkit", EXACT

    def __init__(self, session: TargetSession) -> None:
        self.inner = Autoregressive(session)

    def generate(self, request: Request) -> Record:
        rec = self.inner.generate(request)
        rec.tokens = rec.tokens[:3] + [(rec.tokens[3] + 1) % 96] + rec.tokens[4:]
        return rec


class Broken(Method):
    """Fails on call number `fail_at` (1: the warm-up)."""

    family = "test"

    def __init__(self, session: TargetSession, name: str, fail_at: int) -> None:
        self.inner, self.name, self.fail_at, self.calls = Autoregressive(session), name, fail_at, 0

    def generate(self, request: Request) -> Record:
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("cannot go on")
        return self.inner.generate(request)


def test_smoke_run_writes_every_output(tmp_path, questions) -> None:
    s = make_session(torch.bfloat16)
    drafter = tiny_drafter(s.model, block_size=8)
    methods = [
        Autoregressive(s),
        DFlash(s, drafter, 4, "tiny"),
        DFlash(s, drafter, 8, "tiny"),
        TransformersGenerate(s, "plain"),
        TransformersGenerate(s, "prompt-lookup", prompt_lookup_tokens=3),
        TransformersGenerate(s, "assisted", missing_assistant="no draft model with the target's tokenizer"),
        LlamaCpp(None, threads=1, missing_gguf="no GGUF of the target"),
    ]
    lines: list[str] = []
    config = BenchConfig(datasets=[questions], limit=2, max_new_tokens=12, temperatures=(0.0, 1.0), progress=False)
    result = run_bench(s, methods, config, log=lines.append)
    # missing optional peers: one clear line each, never a crash
    assert any(line.startswith("skipped hf-assisted: no draft model") for line in lines)
    assert any(line.startswith("skipped llama.cpp: ") for line in lines)
    status = {m["name"]: m["status"] for m in result.methods}
    assert status == {
        "ar": "ran",
        "dflash-b4": "ran",
        "dflash-b8": "ran",
        "hf-generate": "ran",
        "hf-prompt-lookup": "ran",
        "hf-assisted": "skipped",
        "llama.cpp": "skipped",
    }
    assert len(result.rows) == 2 * 2 * 2 * 5  # temperatures x questions x turns x methods that ran
    assert len(result.summary) == 2 * 5 and result.exit_code == 0 and not result.failures

    paths = write_outputs(result, tmp_path / "out", tmp_path / "results.json")
    assert paths["json"] == tmp_path / "results.json"
    for name in ("summary.md", *PLOTS):
        f = tmp_path / "out" / name
        assert f.is_file() and f.stat().st_size > 0, name
    for name in PLOTS:
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(paths["json"].read_text())
    assert {"machine", "versions", "commit", "settings", "summary", "runs", "methods", "divergences"} <= set(data)
    assert data["machine"]["cores"] and data["versions"]["torch"] and data["settings"]["max_new_tokens"] == 12
    assert data["runs"][0]["ttft_s"] > 0 and "accepted_lengths" in data["runs"][0]
    md = paths["markdown"].read_text()
    assert "| data set | method | τ | tok/s | TPOT ms | TTFT ms | speedup (TPOT) | speedup (tok/s) | identical |" in md
    assert "| tiny | dflash-b8 |" in md and "## Temperature 1" in md and "α1" in md
    assert "skipped: no draft model" in md and "llama.cpp" in md
    assert "Share of the greedy speedup kept at T=1" in md and retention_table(data, 0.0) is None
    speedups = {(x["temperature"], x["method"]): x["speedup_tpot"] for x in data["summary"]}
    kept = speedups[1.0, "dflash-b8"] / speedups[0.0, "dflash-b8"]
    assert (
        f"| tiny | dflash-b8 | {speedups[0.0, 'dflash-b8']:.2f}× | {speedups[1.0, 'dflash-b8']:.2f}× | {kept:.0%} |"
        in md
    )
    assert "| tiny | ar |" not in retention_table(data, 1.0)  # the baseline keeps 100% by definition: left out


def test_interleaved_rotating_order_and_multi_turn_context(questions) -> None:
    s = make_session()
    calls: list = []
    methods = [Spy(s, "ar", calls), Spy(s, "b", calls), Spy(s, "c", calls)]
    result = run_bench(
        s,
        methods,
        BenchConfig(datasets=[questions], limit=0, max_new_tokens=6, temperatures=(0.0,), progress=False),
        log=lambda _: None,
    )
    calls = calls[3:]  # after the warm-ups
    assert len(calls) == 3 * 2 * 3
    groups = [calls[i : i + 3] for i in range(0, len(calls), 3)]
    assert all(len({r.prompt_ids.__repr__() for _, r in g}) == 1 for g in groups)  # same prompt for all in a group
    assert len({tuple(n for n, _ in g) for g in groups}) == 3  # the order rotates
    first, second = groups[0][0][1], groups[1][0][1]
    answer = next(r for r in result.rows if r.method == "ar" and r.turn == 0 and r.question_id == "0").text
    assert [m["role"] for m in second.messages] == ["user", "assistant", "user"]
    assert second.messages[1]["content"] == answer and second.messages[0] == first.messages[0]
    assert second.seed != first.seed and all(r.identical for r in result.rows if r.method != "ar")


def test_non_tie_divergence_of_a_dflashkit_method_fails_the_run(questions) -> None:
    s = make_session()
    lines: list[str] = []
    config = BenchConfig(
        datasets=[questions], limit=1, max_new_tokens=8, temperatures=(0.0,), max_turns=1, progress=False
    )
    result = run_bench(s, [Autoregressive(s), Corrupt(s)], config, log=lines.append)
    (d,) = result.divergences
    assert d["method"] == "buggy" and d["index"] == 3 and d["tie"] is False and d["margin"] > 0
    assert result.failures == [d] and result.exit_code == 1
    assert any("NOT a tie" in line for line in lines)
    (summary,) = [x for x in result.summary if x["method"] == "buggy"]
    assert summary["non_tie_divergences"] == 1 and summary["identical"] == 0


def test_coupled_sampling_compares_sampled_outputs_token_for_token(questions, monkeypatch) -> None:
    """sampler="coupled": at temperature 1 dflashkit's speculative methods are checked against the baseline token
    for token (all identical here, fp32), the adaptive one verifying token trees as the library does by default; a
    bug there is caught as at temperature 0; rejection sampling compares nothing at temperature 1."""
    s = make_session()
    drafter = tiny_drafter(s.model, block_size=4)
    trees: list = []  # the tree argument of every decode loop the auto method ran

    def recording_loop(*args, **kwargs):
        if kwargs.get("block_policy") is not None:
            trees.append(kwargs.get("tree"))
        return run_decode_loop(*args, **kwargs)

    monkeypatch.setattr(bench_methods, "run_decode_loop", recording_loop)
    methods = [Autoregressive(s), DFlash(s, drafter, 4, "tiny"), DFlash(s, drafter, "auto", "tiny", lookup=True)]
    config = BenchConfig(
        datasets=[questions],
        limit=2,
        max_new_tokens=12,
        temperatures=(1.0,),
        max_turns=1,
        progress=False,
        sampler="coupled",
    )
    result = run_bench(s, methods, config, log=lambda _: None)
    spec = [r for r in result.rows if r.method != "ar"]
    assert len(spec) == 4 and all(r.identical is True for r in spec) and not result.divergences
    assert sum(sum(r.accepted_lengths) for r in spec) > 0  # drafts were accepted
    assert trees == [None, COUPLED_TREE, COUPLED_TREE]  # the greedy warm-up: chains; the 2 prompts at T=1: trees
    assert summary_table(as_json(result), 1.0).count("| 2/2 |") == 2  # the table shows the comparison
    buggy = run_bench(s, [Autoregressive(s), Corrupt(s)], config, log=lambda _: None)
    # (the corrupted method needs 4 tokens: a sampled answer that ends sooner drops it, as any failing method)
    assert buggy.failures and buggy.exit_code == 1
    assert all(d["method"] == "buggy" and d["tie"] is False and d["index"] == 3 for d in buggy.divergences)
    rejection = run_bench(
        s,
        methods,
        BenchConfig(datasets=[questions], limit=1, max_new_tokens=8, temperatures=(1.0,), max_turns=1, progress=False),
        log=lambda _: None,
    )
    assert all(r.identical is None for r in rejection.rows) and not rejection.divergences
    assert trees[-1] is None  # rejection sampling: chains, as by default
    assert "| sampled |" in summary_table(as_json(rejection), 1.0)
    with pytest.raises(InvalidInputError, match="sampler"):
        BenchConfig(datasets=[questions], sampler="gumbel")


def test_failing_methods_are_skipped_or_dropped_and_bad_setups_refused(questions) -> None:
    s = make_session()
    lines: list[str] = []
    config = BenchConfig(datasets=[questions], limit=1, max_new_tokens=4, temperatures=(0.0,), progress=False)
    methods = [Autoregressive(s), Broken(s, "at-start", 1), Broken(s, "later", 3)]
    result = run_bench(s, methods, config, log=lines.append)
    assert "skipped at-start: failed to run: RuntimeError: cannot go on" in lines
    assert any(line.startswith("dropped later: failed on tiny/") and "RuntimeError" in line for line in lines)
    assert result.ran() == ["ar"] and {m["name"]: m["status"] for m in result.methods}["later"] == "failed"
    assert [r.method for r in result.rows].count("later") == 1  # its first turn is kept and summarized
    assert any(x["method"] == "later" for x in result.summary)
    with pytest.raises(InvalidInputError, match="baseline"):
        run_bench(s, [Spy(s, "x", [])], config)
    with pytest.raises(InvalidInputError, match="unique"):
        run_bench(s, [Autoregressive(s), Autoregressive(s)], config)
    with pytest.raises(InvalidInputError, match="cannot run"):
        run_bench(s, [Unavailable("ar", "dflashkit", "nope")], config, log=lambda _: None)
    with pytest.raises(InvalidInputError):
        BenchConfig(datasets=[questions], temperatures=(-1.0,))


class CtrlC(Broken):
    def generate(self, request: Request) -> Record:
        self.calls += 1
        if self.calls >= self.fail_at:
            raise KeyboardInterrupt
        return self.inner.generate(request)


def test_ctrl_c_reports_what_was_finished(questions) -> None:
    s = make_session()
    config = BenchConfig(
        datasets=[questions], limit=0, max_new_tokens=4, temperatures=(0.0,), max_turns=1, progress=False
    )
    result = run_bench(s, [Autoregressive(s), CtrlC(s, "user", 3)], config, log=lambda _: None)
    assert result.interrupted and result.exit_code == 130
    assert len(result.rows) == 2 and {r.method for r in result.rows} == {"ar", "user"}  # one whole prompt


def test_cpu_model_names_family_and_model():
    """A virtual machine's bare "AMD EPYC" is told apart by its family and model (Zen 4 is family 25, model 17)."""
    from dflashkit.bench.environment import cpu_model_from, machine

    info = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n\n"
        "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: Other\n"
    )
    assert cpu_model_from(info) == "AMD EPYC (family 25, model 17)"
    assert cpu_model_from("model name\t: Apple M2\n") == "Apple M2"
    with pytest.raises(ValueError):
        cpu_model_from("processor\t: 0\n")
    m = machine()
    assert m["cpu"] and m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert m["cpu_kernels"] == (row_kernels.label() or "oneDNN")
