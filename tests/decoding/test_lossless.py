"""Tie classification of greedy divergences (the bf16 losslessness rule)."""

from __future__ import annotations

import torch

from dflashkit.decoding.lossless import Divergence, DivergenceRecorder, classify, is_tie, ulp


def test_bf16_ulp_values():
    assert ulp(1.0) == 2**-7
    assert ulp(22.375) == 0.125  # 16 <= x < 32: exponent 4, 7 mantissa bits
    assert ulp(-38.0) == 0.25
    assert ulp(0.0) == 0.0
    assert ulp(1.0, torch.float32) == 2**-23


def logits_with(values: dict[int, float], vocab: int = 10) -> torch.Tensor:
    row = torch.full((vocab,), -5.0)
    for i, v in values.items():
        row[i] = v
    return row


def test_exact_tie_is_a_tie():
    d = classify(logits_with({3: 20.0, 7: 20.0}), ar_token=3, spec_token=7, index=5, dtype=torch.bfloat16)
    assert d == Divergence(5, 7, 3, 0.0, 20.0, True)


def test_clear_non_tie():
    d = classify(logits_with({3: 20.0, 7: 18.0}), ar_token=3, spec_token=7, index=0, dtype=torch.bfloat16)
    assert d.margin == 2.0 and not d.tie


def test_ulp_edge():
    # max |logit| 20 -> ulp 0.125 -> a tie up to a margin of 0.25 inclusive, not beyond
    assert is_tie(0.25, 20.0) and not is_tie(0.25 + 1e-6, 20.0)
    # the largest absolute logit decides, even when it is negative and neither candidate
    d = classify(logits_with({0: -40.0, 3: 10.0, 7: 9.6}), ar_token=3, spec_token=7, index=0, dtype=torch.bfloat16)
    assert d.max_abs_logit == 40.0 and d.tie  # ulp(40) = 0.25, margin 0.4 <= 0.5
    d = classify(logits_with({3: 10.0, 7: 9.6}), ar_token=3, spec_token=7, index=0, dtype=torch.bfloat16)
    assert not d.tie  # ulp(10) = 0.0625, margin 0.4 > 0.125


def test_masked_entries_do_not_set_the_scale():
    """A row with -inf entries (a grammar's mask, top-k / top-p under coupled sampling): the largest finite value
    sets the ulp (an infinite one would call every divergence a tie)."""
    row = logits_with({3: 10.0, 7: 9.6})
    row[0] = float("-inf")
    d = classify(row, ar_token=3, spec_token=7, index=0, dtype=torch.bfloat16)
    assert d.max_abs_logit == 10.0 and not d.tie


def test_recorder_finds_first_divergence_and_length_mismatch():
    rec = DivergenceRecorder([1, 2, 3, 4], torch.bfloat16)
    rec(logits_with({1: 9.0})[None], [1])
    rec(logits_with({2: 9.0})[None], [2])
    rec(logits_with({5: 9.0, 3: 8.99})[None], [5])  # plain says 5, speculative said 3
    rec(logits_with({6: 9.0})[None], [6])
    d = rec.result([1, 2, 5, 6])
    assert d.index == 2 and d.ar_token == 5 and d.spec_token == 3 and d.tie

    rec = DivergenceRecorder([1, 2], torch.float32)
    rec(logits_with({1: 9.0})[None], [1])
    rec(logits_with({2: 9.0})[None], [2])
    rec(logits_with({4: 9.0})[None], [4])
    d = rec.result([1, 2, 4])
    assert d.index == 2 and d.spec_token is None and d.ar_token == 4 and not d.tie
    assert DivergenceRecorder([1], torch.float32).result([1]) is None
