"""Acceptance statistics on hand-made step logs."""

from __future__ import annotations

from dflashkit.decoding.stats import DecodeStats


def test_tau_positions_and_histogram():
    s = DecodeStats(block_size=4)
    for drafted, accepted in [(3, 3), (3, 0), (3, 1), (2, 2)]:
        s.record_step(drafted, accepted)
    assert s.steps == 4
    assert s.tau == (3 + 0 + 1 + 2) / 4 + 1
    assert s.accepted_per_position == [3, 2, 1]
    assert s.drafted_per_position == [4, 4, 3]
    assert s.acceptance_histogram == [1, 1, 1, 1]
    d = s.as_dict()
    assert d["draft_tokens"] == 11 and d["accepted_tokens"] == 6 and d["tau"] == s.tau


def test_plain_decoding_has_tau_one_and_times_add_up():
    s = DecodeStats(block_size=1)
    for _ in range(5):
        s.record_step(0, 0)
    s.new_tokens, s.prefill_s, s.decode_s, s.verify_s, s.draft_s = 6, 0.5, 1.0, 0.75, 0.0
    assert s.tau == 1.0 and s.acceptance_histogram == [5] and s.accepted_per_position == []
    assert s.other_s == 0.25 and s.tokens_per_s == 6 / 1.5
    assert DecodeStats(block_size=8).tau == 0.0  # no steps yet


def test_combined_stats_of_several_runs():
    a, b = DecodeStats(block_size=4), DecodeStats(block_size=4)
    for s, steps in ((a, [(3, 2), (3, 0)]), (b, [(3, 3)])):
        for drafted, accepted in steps:
            s.record_step(drafted, accepted)
    a.new_tokens, b.new_tokens, a.decode_s, b.decode_s, a.prefill_s = 5, 4, 1.0, 0.5, 0.5
    both = DecodeStats.combined([a, b])
    assert both.steps == 3 and both.accepted_lengths == [2, 0, 3] and both.new_tokens == 9
    assert both.tau == (5 / 3 + 1) and both.accepted_per_position == [2, 2, 1]
    assert both.decode_s == 1.5 and both.tokens_per_s == 9 / 2.0
    assert (a.steps, b.steps) == (2, 1)  # the runs themselves are unchanged
