"""Benchmark figures on synthetic step logs: τ, α_k, histogram, TPOT and both speedup definitions."""

from __future__ import annotations

import pytest

from dflashkit.bench.metrics import (
    RunRow,
    acceptance_per_position,
    accepted_histogram,
    question_tokens_per_s,
    speedup_tokens_per_s,
    speedup_tpot,
    speedup_tpot_per_question,
    summarize,
    tau,
    tpot,
)


def row(method: str, qid: str, new_tokens: int, ttft: float, total: float, turn: int = 0, **kw) -> RunRow:
    return RunRow(
        method=method,
        dataset="d",
        question_id=qid,
        turn=turn,
        temperature=0.0,
        prompt_tokens=5,
        new_tokens=new_tokens,
        ttft_s=ttft,
        total_s=total,
        **kw,
    )


def test_tau_is_accepted_per_step_plus_one() -> None:
    assert tau([3, 0, 1, 4]) == pytest.approx(3.0)  # 8 accepted over 4 steps + 1
    assert tau([0, 0]) == 1.0
    assert tau([]) is None


def test_histogram_counts_steps_by_accepted_length() -> None:
    assert accepted_histogram([3, 0, 1, 3, 0, 0], block_size=4) == [3, 1, 0, 2]
    assert accepted_histogram([], block_size=4) == [0, 0, 0, 0]
    assert accepted_histogram([5], block_size=4) == [0, 0, 0, 0, 0, 1]  # grows (transformers' dynamic drafts)
    with pytest.raises(ValueError):
        accepted_histogram([-1], 4)


def test_acceptance_per_position_is_conditional() -> None:
    # block 4 (3 drafts per step); accepted lengths 3, 0, 1, 2; the last step could only draft 1 token.
    accepted, drafted = [3, 0, 1, 1], [3, 3, 3, 1]
    alphas = acceptance_per_position(accepted, drafted, 4)
    # k=1: all 4 steps drafted it, 3 accepted it; k=2: steps 1 and 3 accepted k=1 and drafted a 2nd (step 4
    # drafted only one), 1 accepted it; k=3: step 1 only, accepted
    assert alphas == [pytest.approx(3 / 4), pytest.approx(1 / 2), pytest.approx(1.0)]
    assert acceptance_per_position([0, 0], [3, 3], 4) == [0.0, None, None]
    with pytest.raises(ValueError):
        acceptance_per_position([1], [1, 2], 4)


def test_tpot_pools_decode_time_over_tokens_after_the_first() -> None:
    rows = [row("m", "a", 11, 0.5, 1.5), row("m", "b", 21, 0.2, 2.2), row("m", "c", 1, 0.3, 0.3)]
    assert tpot(rows) == pytest.approx((1.0 + 2.0) / (10 + 20))
    assert tpot([row("m", "a", 1, 0.1, 0.1)]) is None


def test_speedups_tpot_ratio_and_mean_of_question_ratios() -> None:
    base = [row("ar", "a", 11, 0.1, 1.1), row("ar", "b", 11, 0.1, 2.1)]  # TPOT 3.0/20 = 0.15; tok/s 10, 5.238
    spec = [row("sp", "a", 11, 0.1, 0.6), row("sp", "b", 11, 0.1, 0.6)]  # TPOT 1.0/20 = 0.05; tok/s 18.33 both
    assert speedup_tpot(base, spec) == pytest.approx(3.0)
    per_q = question_tokens_per_s(spec)
    assert per_q[("d", "a")] == pytest.approx(11 / 0.6)
    expected = ((11 / 0.6) / (11 / 1.1) + (11 / 0.6) / (11 / 2.1)) / 2
    assert speedup_tokens_per_s(base, spec) == pytest.approx(expected)
    assert speedup_tpot(base, []) is None and speedup_tokens_per_s(base, []) is None


def test_question_tokens_per_s_adds_turns() -> None:
    rows = [row("m", "a", 10, 0.1, 1.0, turn=0), row("m", "a", 30, 0.1, 1.0, turn=1)]
    assert question_tokens_per_s(rows) == {("d", "a"): pytest.approx(20.0)}


def test_summarize_speculative_and_lossless_counts() -> None:
    base = [
        row("ar", "a", 5, 0.1, 0.5, accepted_lengths=[0] * 4, drafted_lengths=[0] * 4, block_size=1),
        row("ar", "b", 5, 0.1, 0.5, accepted_lengths=[0] * 4, drafted_lengths=[0] * 4, block_size=1),
    ]
    spec = [
        row("sp", "a", 5, 0.1, 0.3, accepted_lengths=[3, 0], drafted_lengths=[3, 3], block_size=4, identical=True),
        row(
            "sp",
            "b",
            5,
            0.1,
            0.3,
            accepted_lengths=[1, 1],
            drafted_lengths=[3, 1],
            block_size=4,
            identical=False,
            divergence={"tie": True},
        ),
    ]
    s = summarize(spec, base)
    assert s["tau"] == pytest.approx(5 / 4 + 1)
    assert s["accepted_histogram"] == [1, 2, 0, 1]
    assert s["acceptance_per_position"][0] == pytest.approx(3 / 4)
    assert s["speedup_tpot"] == pytest.approx((0.8 / 8) / (0.4 / 8))
    assert (s["compared"], s["identical"], s["tie_divergences"], s["non_tie_divergences"]) == (2, 1, 1, 0)
    b = summarize(base, base)
    assert b["tau"] == 1.0 and b["acceptance_per_position"] is None and b["speedup_tpot"] == pytest.approx(1.0)
    assert b["compared"] == 0


def test_summarize_peer_without_draft_counts() -> None:
    """transformers' speculative peers report accepted lengths only: τ and histogram, no α_k."""
    rows = [row("pld", "a", 9, 0.1, 0.5, accepted_lengths=[2, 4, 0], block_size=11)]
    s = summarize(rows, rows)
    assert s["tau"] == pytest.approx(3.0) and s["acceptance_per_position"] is None
    assert s["accepted_histogram"][:5] == [1, 0, 1, 0, 1] and len(s["accepted_histogram"]) == 11


def test_the_per_question_speedup_is_the_median_of_paired_ratios() -> None:
    """Each question's pair is compared with itself: one question of the baseline run in a slow phase moves a pooled
    ratio a lot and the median of the pairs not at all; questions only one side ran are left out."""
    base = [row("ar", "a", 11, 0.1, 0.2), row("ar", "b", 11, 0.1, 0.2), row("ar", "c", 11, 0.1, 2.1)]
    spec = [row("dflash", q, 11, 0.1, 0.15) for q in "abc"] + [row("dflash", "d", 11, 0.1, 9.0)]
    assert speedup_tpot_per_question(base, spec) == pytest.approx(2.0)  # ratios 2, 2, 40
    assert speedup_tpot(base, spec[:3]) == pytest.approx(14.666, rel=1e-3)  # pooled: 2.2 s / 0.15 s
    assert speedup_tpot_per_question(base, []) is None
