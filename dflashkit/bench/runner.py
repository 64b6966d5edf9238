"""The benchmark loop: every method on every prompt, interleaved, after a warm-up; then the figures.

Order: for each temperature, data set, question and turn, every method generates once, in a rotating
order (so no method always runs first or last), with the same prompt token ids and seed. A method that
cannot run here is skipped with a line saying why; one that fails its warm-up is skipped the same way, and
one that fails later is dropped from then on. Ctrl-C stops the loop and reports what was finished.

Multi-turn questions (MT-Bench) feed the model's own answer back: the next turn's context holds the
baseline's answer to the previous turn, so every method sees the same context.

Losslessness: at temperature 0 each method's tokens are compared with the baseline's, and at any temperature
with ``sampler="coupled"`` (dflashkit's methods against a dflashkit baseline: the seed's plain sampled output,
whatever was drafted). Where they part,
the baseline is decoded again, untimed, with a :class:`~dflashkit.decoding.lossless.DivergenceRecorder` that judges
the first differing token on the baseline's own logits (noisy scores when coupled; a bf16 tie or not). A
non-tie divergence of a
dflashkit method is a bug: the run reports it and its exit code is 1.
"""

from __future__ import annotations

import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from dflashkit.bench.datasets import Question, load_questions
from dflashkit.bench.methods import (
    EXACT,
    KERNELS,
    OTHER_WEIGHTS,
    Method,
    Record,
    Request,
    TargetSession,
    run_decode_loop,
)
from dflashkit.bench.metrics import RunRow, summarize
from dflashkit.decoding.lossless import DivergenceRecorder
from dflashkit.decoding.sampling import check_sampler
from dflashkit.errors import InvalidInputError
from dflashkit.text import encode_chat


@dataclass
class BenchConfig:
    datasets: Sequence[str] = ("mt-bench", "humaneval", "math500")
    limit: int | None = 10  # questions per data set (seeded subset); None or 0: all
    seed: int = 0
    max_new_tokens: int = 256
    temperatures: Sequence[float] = (0.0, 1.0)
    max_turns: int | None = None  # None: every turn
    warmup_tokens: int = 16
    progress: bool = True
    sampler: str = (
        "rejection"  # dflashkit's methods at temperature > 0: "rejection" or "coupled" (dflashkit.decoding.sampling)
    )

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise InvalidInputError(f"temperatures must be >= 0, got {list(self.temperatures)}")
        if self.max_turns is not None and self.max_turns < 1:
            raise InvalidInputError(f"max_turns must be at least 1, got {self.max_turns}")
        if not self.datasets:
            raise InvalidInputError("no data set given")
        check_sampler(self.sampler)


@dataclass
class BenchResult:
    config: BenchConfig
    methods: list[dict[str, Any]]  # every method asked for: description + status ("ran" / "skipped") + reason
    datasets: dict[str, int]  # name: questions
    rows: list[RunRow]
    summary: list[dict[str, Any]]  # one per (temperature, data set, method)
    divergences: list[dict[str, Any]]
    baseline: str
    wall_s: float = 0.0
    interrupted: bool = False  # stopped by Ctrl-C: the figures cover the prompts finished before
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failures(self) -> list[dict[str, Any]]:
        """Non-tie greedy divergences of dflashkit's own methods (bugs)."""
        return [d for d in self.divergences if d["family"] == "dflashkit" and d.get("tie") is False]

    @property
    def exit_code(self) -> int:
        """1: a non-tie divergence of a dflashkit method (a bug); 130: interrupted; else 0."""
        return 1 if self.failures else 130 if self.interrupted else 0

    def ran(self) -> list[str]:
        return [m["name"] for m in self.methods if m["status"] == "ran"]


def question_seed(seed: int, dataset: str, question_id: str, turn: int) -> int:
    """A stable per-prompt seed, the same for every method."""
    return zlib.crc32(f"{seed}/{dataset}/{question_id}/{turn}".encode()) & 0x7FFFFFFF


def run_bench(
    session: TargetSession,
    methods: Sequence[Method],
    config: BenchConfig,
    *,
    baseline: str = "ar",
    log: Callable[[str], None] | None = None,
) -> BenchResult:
    """Run every available method on every prompt of `config.datasets` (see the module docstring)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"method names must be unique, got {names}")
    if baseline not in names:
        raise InvalidInputError(f"the baseline {baseline!r} is not among the methods {names}")
    sets: list[tuple[str, list[Question]]] = []
    for spec in config.datasets:
        name, questions = load_questions(spec, config.limit or None, config.seed)
        if name in dict(sets):
            raise InvalidInputError(f"data set {name!r} given twice")
        sets.append((name, questions))

    described = {m.name: {**m.describe(), "status": "ran", "reason": None} for m in methods}
    active: list[Method] = []
    for m in methods:
        reason = m.unavailable()
        if reason:
            described[m.name].update(status="skipped", reason=reason)
            log(f"skipped {m.name}: {reason}")
        else:
            active.append(m)
    if baseline not in [m.name for m in active]:
        raise InvalidInputError(f"the baseline {baseline!r} cannot run: {described[baseline]['reason']}")

    t_start = time.perf_counter()
    warm = Request(
        _encode(session, [{"role": "user", "content": sets[0][1][0].turns[0]}]),
        config.warmup_tokens,
        0.0,
        config.seed,
        frozenset(session.eos_token_ids),
    )
    for m in list(active):
        try:
            m.warmup(warm)
        except Exception as e:  # a peer that cannot start (bad GGUF, missing weights) is skipped, not fatal
            if m.name == baseline:
                raise
            active.remove(m)
            described[m.name].update(status="skipped", reason=f"failed to run: {type(e).__name__}: {e}")
            log(f"skipped {m.name}: failed to run: {type(e).__name__}: {e}")

    turns = sum(len(q.turns[: config.max_turns]) for _, qs in sets for q in qs)
    bar = tqdm(
        total=turns * len(config.temperatures) * len(active),
        disable=not config.progress,
        unit="gen",
        file=sys.stderr,
        dynamic_ncols=True,
        desc="bench",
    )
    rows: list[RunRow] = []
    divergences: list[dict[str, Any]] = []
    interrupted = False
    base_method = next(m for m in active if m.name == baseline)
    say = _bar_writer(bar) if config.progress else log
    try:
        for temperature in config.temperatures:
            for dataset, questions in sets:
                for qi, q in enumerate(questions):
                    history: list[dict[str, str]] = []
                    for ti, user in enumerate(q.turns[: config.max_turns]):
                        messages = [*history, {"role": "user", "content": user}]
                        request = Request(
                            prompt_ids=_encode(session, messages),
                            max_new_tokens=config.max_new_tokens,
                            temperature=temperature,
                            seed=question_seed(config.seed, dataset, q.question_id, ti),
                            stop_token_ids=frozenset(session.eos_token_ids),
                            messages=tuple(messages),
                            sampler=config.sampler,
                        )
                        shift = (qi + ti) % len(active)
                        records: dict[str, Record] = {}
                        for m in active[shift:] + active[:shift]:
                            bar.set_postfix_str(f"T={temperature:g} {dataset} {qi + 1}/{len(questions)} {m.name}")
                            try:
                                records[m.name] = m.generate(request)
                            except Exception as e:  # a peer failing mid-run costs its column, not the run
                                if m.name == baseline:
                                    raise
                                active.remove(m)
                                reason = f"failed on {dataset}/{q.question_id}: {type(e).__name__}: {e}"
                                described[m.name].update(status="failed", reason=reason)
                                say(f"dropped {m.name}: {reason}")
                            bar.update()
                        base = records[baseline]
                        for m in (m for m in active if m.name in records):
                            row, div = _row(session, m, base_method, records[m.name], base, request, dataset, q, ti)
                            rows.append(row)
                            if div is not None:
                                divergences.append(div)
                                _log_divergence(div, say)
                        history = [*messages, {"role": "assistant", "content": _text(session, base.tokens)}]
    except KeyboardInterrupt:
        interrupted = True
        log(f"interrupted: reporting the {len(rows)} generations done so far")
    finally:
        bar.close()

    summary = []
    by_name = {m.name: m for m in methods}
    ran = [name for name in by_name if any(r.method == name for r in rows)]  # failed methods keep their rows
    for temperature in config.temperatures:
        for dataset, _ in sets:
            here = [r for r in rows if r.temperature == temperature and r.dataset == dataset]
            base_rows = [r for r in here if r.method == baseline]
            for name in ran:
                mine = [r for r in here if r.method == name]
                if mine:
                    summary.append(
                        {
                            "temperature": temperature,
                            "dataset": dataset,
                            "method": name,
                            "family": by_name[name].family,
                            "comparable": by_name[name].comparable,
                            **summarize(mine, base_rows),
                        }
                    )
    return BenchResult(
        config=config,
        methods=list(described.values()),
        datasets={n: len(qs) for n, qs in sets},
        rows=rows,
        summary=summary,
        divergences=divergences,
        baseline=baseline,
        wall_s=time.perf_counter() - t_start,
        interrupted=interrupted,
    )


def _bar_writer(bar: tqdm) -> Callable[[str], None]:
    return lambda msg: bar.write(msg, file=sys.stderr)


def _encode(session: TargetSession, messages: list[dict[str, str]]) -> list[int]:
    return encode_chat(session.tokenizer, messages)


def _text(session: TargetSession, tokens: list[int]) -> str:
    return session.tokenizer.decode(tokens, skip_special_tokens=True)


def _row(
    session: TargetSession,
    method: Method,
    base_method: Method,
    rec: Record,
    base: Record,
    request: Request,
    dataset: str,
    q: Question,
    turn: int,
) -> tuple[RunRow, dict[str, Any] | None]:
    """The raw row of one record; at temperature 0 (or coupled sampling among dflashkit's methods), also its
    divergence from the baseline (judged)."""
    coupled = request.sampler == "coupled" and method.family == base_method.family == "dflashkit"
    compare = (request.greedy or coupled) and method is not base_method
    identical = rec.tokens == base.tokens if compare else None
    row = RunRow(
        method=method.name,
        dataset=dataset,
        question_id=q.question_id,
        turn=turn,
        temperature=request.temperature,
        prompt_tokens=len(request.prompt_ids),
        new_tokens=rec.new_tokens,
        ttft_s=rec.ttft_s,
        total_s=rec.total_s,
        accepted_lengths=rec.accepted_lengths,
        drafted_lengths=rec.drafted_lengths,
        steps_total=rec.steps_total,
        accepted_total=rec.accepted_total,
        block_size=rec.block_size,
        phases_s=rec.phases_s,
        identical=identical,
        text=_text(session, rec.tokens),
    )
    if not compare or identical:
        return row, None
    div = judge_divergence(session, request, rec.tokens, base.tokens, method.comparable)
    div.update(
        method=method.name,
        family=method.family,
        comparable=method.comparable,
        dataset=dataset,
        question_id=q.question_id,
        turn=turn,
    )
    row.divergence = div
    return row, div


def judge_divergence(
    session: TargetSession, request: Request, tokens: list[int], base_tokens: list[int], comparable: str
) -> dict[str, Any]:
    """Locate the first token where `tokens` part from the baseline's and, for methods on the same weights,
    judge it on the baseline's logits by the bf16 tie rule (an untimed second baseline decode)."""
    index = next((i for i, (a, b) in enumerate(zip(tokens, base_tokens)) if a != b), min(len(tokens), len(base_tokens)))
    out: dict[str, Any] = {
        "index": index,
        "token": tokens[index] if index < len(tokens) else None,
        "baseline_token": base_tokens[index] if index < len(base_tokens) else None,
        "margin": None,
        "max_abs_logit": None,
        "tie": None,
    }
    pieces = {
        k: _text(session, [v]) if v is not None else None
        for k, v in (("text", out["token"]), ("baseline_text", out["baseline_token"]))
    }
    out.update(pieces, context=_text(session, base_tokens[max(0, index - 12) : index]))
    if comparable == OTHER_WEIGHTS:
        out["note"] = "other weights: not comparable token for token"
        return out
    recorder = DivergenceRecorder(tokens, session.dtype)
    again = run_decode_loop(session, None, request, observer=recorder)
    d = recorder.result(again.tokens)
    if again.tokens != base_tokens:
        out["note"] = "the baseline's second decode differed from its timed one: judged on the second"
    if d is not None:
        out.update(
            index=d.index,
            token=d.spec_token,
            baseline_token=d.ar_token,
            margin=d.margin,
            max_abs_logit=d.max_abs_logit,
            tie=d.tie,
        )
        if d.margin is None:  # one output ended earlier: no logits pair to judge, so not a tie
            out["note"] = "one output ended before the other"
    if comparable == KERNELS and out["tie"] is False:
        out["note"] = "other kernels (transformers' attention): not held to the tie rule"
    return out


def _log_divergence(d: dict[str, Any], write: Callable[[str], None]) -> None:
    if d["comparable"] == OTHER_WEIGHTS:
        return  # expected: quantized weights; counted in the table, not listed line by line
    if d["tie"] is True:
        kind = "a numerical tie"
    elif d["family"] == "dflashkit" and d["comparable"] == EXACT:
        kind = "NOT a tie: a bug in dflashkit"
    else:
        kind = "not a tie (other kernels)"
    margin = f"margin {d['margin']:.4g} at max |logit| {d['max_abs_logit']:.4g}" if d["margin"] is not None else ""
    write(
        f"divergence {d['method']} {d['dataset']}/{d['question_id']} turn {d['turn']} at token {d['index']}: "
        f"{d['text']!r} vs baseline {d['baseline_text']!r} {margin}: {kind}"
    )
