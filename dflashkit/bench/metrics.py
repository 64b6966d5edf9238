"""Benchmark figures from raw runs: τ, per-position acceptance α_k, accepted-length histogram, TTFT, TPOT,
tokens/s, both speedup definitions and the losslessness counts.

Conventions (see the project's landscape notes, after the DFlash paper and Spec-Bench):

* τ = accepted draft tokens per verification step + 1, pooled over every step of a method on a data set;
  1 for autoregressive methods.
* α_k = P(draft token k accepted | drafts 1..k-1 accepted): steps that accepted ≥ k drafts over steps
  that proposed a k-th draft and accepted the k-1 before it.
* TTFT: from the call with token ids to the first new token (prefill included), median over generations.
* TPOT: time after the first token per further token, pooled: Σ (total − TTFT) / Σ (new tokens − 1).
* tokens/s of a question: all its turns' new tokens / their wall time (prefill included); reported as the
  median over questions.
* speedup (TPOT): baseline TPOT / method TPOT (prefill excluded), the DFlash paper's definition;
  speedup (tok/s): mean over questions of method tokens/s / baseline tokens/s (prefill included), Spec-Bench's.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RunRow:
    """The raw figures of one generation (one turn of one question by one method at one temperature)."""

    method: str
    dataset: str
    question_id: str
    turn: int
    temperature: float
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    total_s: float
    accepted_lengths: list[int] | None = None
    drafted_lengths: list[int] | None = None
    # engines that report only totals (llama-server): verification passes and accepted drafts in all
    steps_total: int | None = None
    accepted_total: int | None = None
    block_size: int | None = None
    phases_s: dict[str, float] = field(default_factory=dict)
    identical: bool | None = None  # greedy: same tokens as the baseline (None: not compared)
    divergence: dict[str, Any] | None = None
    text: str = ""

    @property
    def decode_s(self) -> float:
        return max(0.0, self.total_s - self.ttft_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tau(accepted_lengths: Iterable[int]) -> float | None:
    """Mean tokens per verification step (accepted drafts + 1); None without steps."""
    acc = list(accepted_lengths)
    return tau_pooled(len(acc), sum(acc))


def tau_pooled(steps: int, accepted: int) -> float | None:
    """τ from totals: `accepted` drafts over `steps` verification steps, + 1 (what engines such as
    llama-server report); None without steps."""
    return 1.0 + accepted / steps if steps else None


def accepted_histogram(accepted_lengths: Iterable[int], block_size: int) -> list[int]:
    """histogram[a]: steps that accepted exactly a drafts, a = 0 .. block_size-1 (longer if a step accepted
    more, as transformers' assisted generation may when its draft length grows)."""
    acc = list(accepted_lengths)
    if any(a < 0 for a in acc):
        raise ValueError("accepted lengths cannot be negative")
    hist = [0] * max(1, block_size, max(acc, default=0) + 1)
    for a in acc:
        hist[a] += 1
    return hist


def acceptance_per_position(
    accepted_lengths: Sequence[int], drafted_lengths: Sequence[int], block_size: int
) -> list[float | None]:
    """α_k for k = 1 .. block_size-1 (None where no step reached position k)."""
    if len(accepted_lengths) != len(drafted_lengths):
        raise ValueError("accepted_lengths and drafted_lengths must have one entry per step")
    alphas: list[float | None] = []
    for k in range(1, block_size):
        reached = sum(1 for a, d in zip(accepted_lengths, drafted_lengths) if d >= k and a >= k - 1)
        accepted = sum(1 for a in accepted_lengths if a >= k)
        alphas.append(accepted / reached if reached else None)
    return alphas


def tpot(rows: Iterable[RunRow]) -> float | None:
    """Pooled time per output token after the first: Σ decode time / Σ (new tokens − 1)."""
    rows = list(rows)
    tokens = sum(max(0, r.new_tokens - 1) for r in rows)
    return sum(r.decode_s for r in rows if r.new_tokens > 1) / tokens if tokens else None


def question_tokens_per_s(rows: Iterable[RunRow]) -> dict[tuple[str, str], float]:
    """(dataset, question id): new tokens over wall time (prefill included), all turns together."""
    tokens: dict[tuple[str, str], int] = defaultdict(int)
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    for r in rows:
        key = (r.dataset, r.question_id)
        tokens[key] += r.new_tokens
        seconds[key] += r.total_s
    return {k: tokens[k] / seconds[k] for k in tokens if seconds[k] > 0}


def speedup_tpot(baseline: Iterable[RunRow], rows: Iterable[RunRow]) -> float | None:
    """Baseline TPOT / method TPOT (prefill excluded)."""
    b, m = tpot(baseline), tpot(rows)
    return b / m if b and m else None


def speedup_tokens_per_s(baseline: Iterable[RunRow], rows: Iterable[RunRow]) -> float | None:
    """Mean over questions run by both of method tokens/s / baseline tokens/s (prefill included)."""
    b, m = question_tokens_per_s(baseline), question_tokens_per_s(rows)
    ratios = [m[k] / b[k] for k in m if k in b and b[k] > 0]
    return statistics.fmean(ratios) if ratios else None


def speedup_tpot_per_question(baseline: Iterable[RunRow], rows: Iterable[RunRow]) -> float | None:
    """Median over the generations both ran (question and turn) of baseline TPOT / method TPOT. Each pair ran side
    by side (the runner runs every method on a question before the next), so a slow phase of a shared machine moves
    both sides of a ratio, where it moves a pooled :func:`speedup_tpot` on one side only."""

    def per_question(rs: Iterable[RunRow]) -> dict[tuple[str, str, int], float]:
        return {(r.dataset, r.question_id, r.turn): r.decode_s / (r.new_tokens - 1) for r in rs if r.new_tokens > 1}

    b, m = per_question(baseline), per_question(rows)
    return _median(b[k] / m[k] for k in m if k in b and m[k] > 0)


def _median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def summarize(rows: Sequence[RunRow], baseline: Sequence[RunRow]) -> dict[str, Any]:
    """Figures of one method on one data set at one temperature, against the baseline's rows there."""
    steps = [a for r in rows if r.accepted_lengths is not None for a in r.accepted_lengths]
    totals = [r for r in rows if r.accepted_lengths is None and r.steps_total is not None]
    n_steps = len(steps) + sum(r.steps_total or 0 for r in totals)
    n_accepted = sum(steps) + sum(r.accepted_total or 0 for r in totals)
    block = max((r.block_size or 1 for r in rows), default=1)
    speculative = any(
        (r.accepted_lengths is not None or r.steps_total is not None) and (r.block_size or 2) > 1 for r in rows
    )
    with_drafts = [r for r in rows if r.accepted_lengths is not None and r.drafted_lengths is not None]
    acc = [a for r in with_drafts for a in r.accepted_lengths]
    drafted = [d for r in with_drafts for d in r.drafted_lengths]
    compared = [r for r in rows if r.identical is not None]
    divergent = [r for r in compared if not r.identical]
    judged = [r.divergence for r in divergent if r.divergence and r.divergence.get("tie") is not None]
    tps = question_tokens_per_s(rows)
    tpot_s = tpot(rows)
    return {
        "generations": len(rows),
        "questions": len(tps),
        "new_tokens": sum(r.new_tokens for r in rows),
        "tau": tau_pooled(n_steps, n_accepted) if speculative else 1.0,
        "steps": n_steps,
        "block_size": block if speculative else 1,
        "acceptance_per_position": acceptance_per_position(acc, drafted, block) if acc and block > 1 else None,
        "accepted_histogram": accepted_histogram(steps, block) if steps and speculative else None,
        "ttft_s": _median(r.ttft_s for r in rows),
        "tpot_s": tpot_s,
        "decode_tokens_per_s": 1.0 / tpot_s if tpot_s else None,
        "tokens_per_s": _median(tps.values()),
        "speedup_tpot": speedup_tpot(baseline, rows),
        "speedup_tokens_per_s": speedup_tokens_per_s(baseline, rows),
        "compared": len(compared),
        "identical": len(compared) - len(divergent),
        "divergences": len(divergent),
        "tie_divergences": sum(1 for d in judged if d["tie"]),
        "non_tie_divergences": sum(1 for d in judged if not d["tie"]),
    }
