"""Adaptive block size: the policy's arithmetic, its choices, and that decoding with it stays exact."""

from __future__ import annotations

import pytest

from dflashkit.decoding.adaptive import AdaptiveBlockSize
from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.stats import DecodeStats
from dflashkit.errors import InvalidInputError
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import tiny_drafter, tiny_target


def test_expected_tokens_follow_the_acceptance_estimates():
    policy = AdaptiveBlockSize(8, prior=(1.0, 1.0))
    assert policy.expected_tokens(4) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    policy.observe(8, drafted=7, accepted=2, seconds=0.01)  # drafts 1, 2 accepted, 3 rejected, 4.. not judged
    a1 = (1 + 2 * 0.5) / 3  # one acceptance over a prior of strength 2 and mean 1/2
    a2 = (1 + 2 * a1) / 3  # deeper positions: the prior mean is the estimate at the position before
    a3 = (0 + 2 * a2) / 3
    assert policy.acceptance(1) == pytest.approx(a1) and policy.acceptance(2) == pytest.approx(a2)
    assert policy.acceptance(3) == pytest.approx(a3) and policy.acceptance(4) == pytest.approx(a3)  # not reached
    assert policy.expected_tokens(4) == pytest.approx(1 + a1 + a1 * a2 + a1 * a2 * a3)
    policy.observe(8, drafted=7, accepted=7, seconds=0.01)  # all accepted: positions 1..7 judged, none rejected
    assert policy.acceptance(7) > policy.acceptance(4)


def test_unreached_deep_positions_do_not_look_better_than_observed_ones():
    policy = AdaptiveBlockSize(16)
    for _ in range(50):
        policy.observe(4, drafted=3, accepted=0, seconds=0.01)  # position 1 mostly rejected; deeper never reached
    assert policy.acceptance(1) < 0.05
    assert all(policy.acceptance(i) <= policy.acceptance(1) + 1e-12 for i in range(2, 16))
    assert policy.expected_tokens(16) < 1.06


def test_the_first_step_at_a_size_is_not_timed():
    """A new shape pays one-time costs (kernel creation): its first step would make the size look slow forever."""
    policy = AdaptiveBlockSize(4, candidates=(1, 2, 4))
    policy.observe(2, drafted=1, accepted=1, seconds=0.050)
    assert 2 not in policy.step_seconds and policy.choose() == 1
    policy.observe(2, drafted=1, accepted=1, seconds=0.012)
    assert policy.step_seconds[2] == pytest.approx(0.012)


def test_stale_timings_are_measured_again():
    """A size timed once on a bad moment gets tried again every explore_every steps, oldest timing first."""
    costs = {1: 0.010, 2: 0.011, 4: 0.012}
    policy = AdaptiveBlockSize(4, candidates=(1, 2, 4), explore_every=8)
    for size in (1, 1, 2, 2, 4, 4):
        policy.observe(size, size - 1, size - 1, 0.100 if size == 2 else costs[size])  # 2 looked 10x too slow
    chosen = _run(policy, costs, accept=3, steps=80)
    assert policy.step_seconds[2] < 0.02  # re-measured
    assert chosen[-40:].count(4) >= 30


def _run(policy, costs, accept, steps=200):
    """Simulate steps: a block of size b costs costs[b] seconds and accepts min(accept, b-1) drafts."""
    chosen = []
    for _ in range(steps):
        b = policy.choose()
        chosen.append(b)
        policy.observe(b, b - 1, min(accept, b - 1), costs[b])
    return chosen


def test_low_acceptance_and_costly_big_blocks_choose_a_small_block():
    costs = {1: 0.010, 2: 0.010, 4: 0.012, 8: 0.016, 16: 0.030}
    chosen = _run(AdaptiveBlockSize(16), costs, accept=1)
    late = chosen[-64:]
    assert max(set(late), key=late.count) in (2, 4)
    assert 8 not in chosen and 16 not in chosen  # their guessed times could not win: never paid for


def test_drafting_that_does_not_pay_falls_back_to_plain_steps():
    costs = {1: 0.010, 2: 0.016, 4: 0.018, 8: 0.020, 16: 0.030}
    chosen = _run(AdaptiveBlockSize(16), costs, accept=0)
    assert chosen[-64:].count(1) >= 56  # plain steps, re-timing the small sizes now and then
    assert chosen[:6] == [1, 1, 2, 2, 4, 4] and 8 not in chosen and 16 not in chosen


def test_high_acceptance_chooses_the_largest_block():
    costs = {1: 0.010, 2: 0.010, 4: 0.011, 8: 0.012, 16: 0.014}
    late = _run(AdaptiveBlockSize(16), costs, accept=15)[-64:]
    assert late.count(16) >= 60  # the rest: one exploration step in every 16


def test_untimed_sizes_are_guessed_from_the_line_through_smaller_ones():
    policy = AdaptiveBlockSize(16)
    assert [policy.estimated_seconds(b) for b in (1, 2, 8)] == [None, None, None]
    for size, seconds in ((1, 0.010), (1, 0.010), (2, 0.012), (2, 0.012), (4, 0.016), (4, 0.016)):
        policy.observe(size, size - 1, 0, seconds)
    assert policy.estimated_seconds(8) == pytest.approx(0.016 + 4 * 0.002)  # 2 ms a row, from sizes 2 and 4
    assert policy.estimated_seconds(16) == pytest.approx(0.016 + 12 * 0.002)
    assert policy.summary()["step_ms_guessed"] == {8: pytest.approx(24.0), 16: pytest.approx(40.0)}
    for _ in range(2):
        policy.observe(8, 7, 0, 0.030)  # measured: the line through 4 and 8 now guesses 16
    assert policy.estimated_seconds(8) == 0.030
    assert policy.estimated_seconds(16) == pytest.approx(0.030 + 8 * (0.014 / 4))
    cheaper = AdaptiveBlockSize(16)
    for size, seconds in ((2, 0.012), (2, 0.012), (4, 0.010), (4, 0.010)):
        cheaper.observe(size, size - 1, 0, seconds)
    assert cheaper.estimated_seconds(16) == 0.010  # a falling line is held flat, never below a measured time


def test_big_blocks_are_tried_once_acceptance_rises():
    """A big block ruled out while drafts fail is tried when the text turns predictable (e.g. repeated code)."""
    costs = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.014, 16: 0.018}
    policy = AdaptiveBlockSize(16)
    early = _run(policy, costs, accept=0, steps=60)
    assert 16 not in early
    late = _run(policy, costs, accept=15, steps=200)[-64:]
    assert late.count(16) >= 56


def test_candidates_stay_within_the_drafter_block():
    assert AdaptiveBlockSize(8).candidates == [1, 2, 4, 8]
    assert AdaptiveBlockSize(6, candidates=(2, 4)).candidates == [2, 4, 6]
    with pytest.raises(ValueError):
        AdaptiveBlockSize(1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoding_with_the_policy_is_exact(arch):
    model = tiny_target(arch)
    drafter = tiny_drafter(model, block_size=8)
    options = DecodeOptions(max_new_tokens=40)
    plain = [t for s in decode(TargetAdapter(model), None, [5, 9, 11, 3], options) for t in s.tokens]
    policy = AdaptiveBlockSize(8)
    stats = DecodeStats(8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    for _ in range(2):  # the policy carries over between requests
        spec = [
            t for s in decode(target, drafter, [5, 9, 11, 3], options, stats, block_policy=policy) for t in s.tokens
        ]
        assert spec == plain
    assert set(policy.step_seconds) >= {1, 2, 4}  # the block size changed mid-generation, more than once
    assert {d + 1 for d in stats.drafted_lengths} >= {1, 2, 4}


def test_policy_larger_than_the_block_is_refused():
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=4)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    with pytest.raises(InvalidInputError, match="adaptive"):
        next(decode(target, drafter, [5, 6], DecodeOptions(max_new_tokens=4), block_policy=AdaptiveBlockSize(8)))


def test_generator_auto_block_size():
    from dflashkit.decoding.defaults import COUPLED_TREE
    from dflashkit.generator import SpeculativeGenerator
    from tests.conftest import word_tokenizer

    model = tiny_target("llama")
    gen = SpeculativeGenerator(model, word_tokenizer(), tiny_drafter(model, block_size=8))
    ids = [5, 9, 11, 3]
    auto = gen.generate(ids, max_new_tokens=30, block_size="auto", lookup=False, compare_ar=True)
    assert auto.identical and auto.stats.adaptive and auto.stats.as_dict()["adaptive"] is True
    assert gen.block_policy.steps == auto.stats.steps
    sampled = gen.generate(
        ids, max_new_tokens=30, block_size="auto", lookup=False, temperature=1.0, seed=3, sampler="rejection"
    )
    assert sampled.stats.tree is None  # the rejection sampler: chains
    assert gen.block_policies.get(False).steps == sampled.stats.steps  # sampled requests: a policy of their own
    assert gen.block_policies.get(False).candidates == [1, 2, 4] and gen.block_policy.max_block == 8
    coupled = gen.generate(ids, max_new_tokens=30, lookup=False, temperature=1.0, seed=3)  # seeded: coupled, trees
    assert coupled.stats.tree == COUPLED_TREE and coupled.stats.adaptive
    assert gen.block_policies.get(False, tree=True).steps == coupled.stats.steps  # trees: estimates of their own
    assert gen.block_policies.get(False).steps == sampled.stats.steps
    assert sampled.stats.block_size == 4 and auto.stats.block_size == 8  # the largest block each could use
    assert gen.block_policy.steps == auto.stats.steps  # ... leaving the greedy one as it was
    default = gen.generate(ids, max_new_tokens=5).stats  # the default: adaptive, with prompt lookup
    assert default.adaptive and default.lookup and default.block_size == 8
    assert not gen.generate(ids, max_new_tokens=5, block_size=8).stats.adaptive
    with_tree = gen.generate(ids, max_new_tokens=5, tree=3).stats  # a tree: the drafter's block size, no policy
    assert not with_tree.adaptive and with_tree.block_size == 8
    assert not gen.generate(ids, max_new_tokens=5, use_drafter=False).stats.lookup  # plain stays plain
    with pytest.raises(InvalidInputError, match="auto"):
        gen.generate(ids, max_new_tokens=5, block_size="big")


@pytest.mark.parametrize("copy_sizes", [(2,), (4,), None])
def test_copied_drafts_are_as_long_as_the_copy_policy_chooses(copy_sizes, monkeypatch):
    """With prompt lookup, a copied step drafts copy_policy.choose() - 1 tokens (at most); without a copy policy
    as many as the largest block allows. Either way the output is plain greedy decoding's."""
    from dflashkit.decoding.lookup import NgramLookup

    # a lookup that always has a long match (the tiny models loop on one token: their real matches copy one)
    monkeypatch.setattr(NgramLookup, "propose", lambda self, max_tokens: [self.tokens[-1]] * max_tokens)
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=8)
    prompt = [5, 9, 11, 3]
    options = DecodeOptions(max_new_tokens=60, lookup=True)
    plain = [t for s in decode(TargetAdapter(model), None, prompt, DecodeOptions(max_new_tokens=60)) for t in s.tokens]
    policy = AdaptiveBlockSize(8)
    if copy_sizes is not None:
        policy.copies = AdaptiveBlockSize(max(copy_sizes), candidates=copy_sizes)
    stats = DecodeStats(8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    spec = [t for s in decode(target, drafter, prompt, options, stats, block_policy=policy) for t in s.tokens]
    assert spec == plain
    copied = [d for d, c in zip(stats.drafted_lengths, stats.copied_steps) if c]
    assert len(copied) >= stats.steps - 1  # every step had a match (the last may have no room left to copy)
    longest = max(copy_sizes) - 1 if copy_sizes is not None else 7
    assert max(copied) == longest and copied.count(longest) >= len(copied) - 1  # the last step may be cut short
    if copy_sizes is not None:
        assert policy.copies.steps == len(copied)  # every copied step was reported to the copy policy ...
    assert policy.steps == stats.steps - len(copied)  # ... and only the others to the drafter's block policy


def test_block_policies_size_copies_with_a_policy_of_their_own():
    from dflashkit.decoding.adaptive import BlockPolicies

    policies = BlockPolicies(16)
    assert policies.get(True).copies.candidates == [2, 4, 8, 16]
    assert policies.get(False).copies.candidates == [2, 4]  # the sampled regime's largest block is 4
    assert "copies" in policies.get(True).summary()


def test_batched_members_blocks_are_capped_by_the_batch_size():
    """A member of a batch whose passes run together gets blocks of at most BATCH_ROWS / members (a power of two,
    at least 2), with estimates of its own per cap; alone (or a batch of one) the drafter's own largest block."""
    from dflashkit.decoding.adaptive import BATCH_ROWS, BlockPolicies

    policies = BlockPolicies(16)
    assert BATCH_ROWS == 16
    assert [policies.batched_max_block(m) for m in (1, 2, 3, 4, 5, 8, 16)] == [16, 8, 4, 4, 2, 2, 2]
    assert policies.get(True, batched=True, members=1).max_block == 16
    assert policies.get(True, batched=True, members=4).max_block == 4
    assert policies.get(True, batched=True, members=8).candidates == [1, 2]
    assert policies.get(True, batched=True, members=8).copies.candidates == [2]  # copies within the cap too
    assert policies.get(False, batched=True, members=2).max_block == 4  # the sampled regime's own cap
    assert policies.get(True, batched=True, members=4) is policies.get(True, batched=True, members=3)
    assert policies.get(True, batched=True, members=4) is not policies.get(True, batched=True, members=8)
    assert policies.get(True) is not policies.get(True, batched=True, members=1)


def test_a_members_policy_follows_the_batch_size_at_each_step():
    """A member that starts alone and is joined by seven others: its next steps choose within the cap of a batch
    of 8 (and its copies too), and each step is reported to the policy that chose it."""
    from dflashkit.decoding.adaptive import BlockPolicies

    policies = BlockPolicies(16)
    size = [1]
    member = policies.for_batch(True, lambda: size[0])
    alone, full = policies.get(True, batched=True, members=1), policies.get(True, batched=True, members=8)
    assert member.max_block == 16 and member.copies.max_block == 16  # what the decode loop sizes its caches by
    assert member.current() is alone and member.copies.current() is alone.copies
    block = member.choose()
    size[0] = 8  # the others join before the step is reported
    member.observe(block, block - 1, 0, 0.01)
    assert (alone.steps, full.steps) == (1, 0)
    assert member.current() is full and member.copies.current() is full.copies
    for _ in range(20):
        block = member.choose()
        assert block in (1, 2)
        member.observe(block, block - 1, block - 1, 0.01)
        assert member.copies.choose() == 2
    assert full.steps == 20 and alone.steps == 1
    size[0] = 0  # the batch emptied (the member itself left): the policy of one
    assert member.current() is alone
