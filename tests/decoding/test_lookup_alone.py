"""Prompt lookup alone: the default of a generator loaded for a target that no drafter ships for, its copies sized
(or declined for plain steps) by the adaptive copy policy, and its output the target's plain output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dflashkit.drafter.registry
import dflashkit.target.loading
from dflashkit.decoding.adaptive import LOOKUP_ALONE_BLOCK, BlockPolicies
from dflashkit.decoding.defaults import default_block_size, default_lookup
from dflashkit.decoding.lookup import NgramLookup
from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.stats import DecodeStats
from dflashkit.generator import SpeculativeGenerator
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_target, word_tokenizer

REPETITIVE = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [10, 11, 12, 10, 11, 12, 10], [20, 21, 22, 23, 24, 25, 20, 21, 22]]


@pytest.fixture
def no_shipped_drafter(monkeypatch: pytest.MonkeyPatch) -> None:
    """load() gets the tiny fp32 llama target, and no drafter ships for it."""

    def fake_load_target(name_or_path=None, **kwargs):
        return tiny_target("llama"), word_tokenizer()

    monkeypatch.setattr(dflashkit.target.loading, "load_target", fake_load_target)
    monkeypatch.setattr(dflashkit.drafter.registry, "DRAFTERS_DIR", Path("/nonexistent"))


def test_defaults_turn_lookup_alone_on_only_where_asked():
    assert default_lookup(None, has_drafter=True) and not default_lookup(None, has_drafter=False)
    assert default_lookup(None, has_drafter=False, without_drafter=True)
    assert not default_lookup(False, has_drafter=False, without_drafter=True)  # asked off: off
    assert default_lookup(True, has_drafter=False)  # asked on: on
    assert default_block_size(None, has_drafter=False, lookup=True) == "auto"  # copies sized per step
    assert default_block_size(None, has_drafter=False) is None  # plain decoding
    assert default_block_size(6, has_drafter=False, lookup=True) == 6


def test_auto_without_a_shipped_drafter_decodes_with_lookup_and_plain_output(no_shipped_drafter):
    """drafter="auto" finds none: prompt lookup alone by default, sized per step, greedy output the plain output
    token for token (fp32); seeded (coupled) sampling gives the seed's plain sampled output."""
    gen = SpeculativeGenerator.load("tiny", "auto", dtype=torch.float32)
    assert gen.drafter is None and gen.lookup_without_drafter and gen.block_policy is None
    assert gen.uses_lookup() and not gen.uses_lookup(use_drafter=False) and not gen.uses_lookup(False)
    copied = 0
    for prompt in REPETITIVE:
        result = gen.generate(prompt, max_new_tokens=40, compare_ar=True)
        s = result.stats
        assert result.identical, (result.token_ids, result.ar.token_ids)
        assert s.lookup and s.adaptive and s.block_size == LOOKUP_ALONE_BLOCK
        assert not result.ar.stats.lookup and result.ar.stats.block_size == 1  # the plain run stays plain
        copied += sum(s.copied_steps)
        assert all(d == 0 for d, c in zip(s.drafted_lengths, s.copied_steps) if not c)  # elsewhere: plain steps
        assert set(result.origins) <= {"copy", "target"}
    assert copied  # the text repeated itself and copies were verified
    copies = gen.lookup_policies.get(True).copies
    assert copies.candidates == [1, 2, 4, 8, 16]
    assert copies.steps > 0 and 1 in copies.step_seconds  # plain steps timed: the alternative copies must beat

    seeded = gen.generate(REPETITIVE[0], max_new_tokens=40, temperature=1.0, seed=5, compare_ar=True)
    assert seeded.stats.sampler == "coupled" and seeded.stats.lookup and seeded.identical
    assert seeded.stats.block_size == 4  # the sampled regime's largest block
    assert gen.lookup_policies.get(False).copies.steps == seeded.stats.steps  # a policy of its own
    # the rejection sampler's draws depend on the block sizes, which the policy picks by timing: with a fixed
    # block a seed reproduces its output, lookup on
    runs = [
        gen.generate(REPETITIVE[0], max_new_tokens=40, temperature=1.0, seed=5, sampler="rejection", block_size=4)
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].stats.lookup and not runs[0].stats.adaptive

    batched = gen.generate_batch(REPETITIVE, max_new_tokens=30)  # members' copies sized within the batch's cap
    assert all(r.stats.lookup and r.stats.adaptive for r in batched)
    assert [r.token_ids for r in batched] == [
        gen.generate(p, max_new_tokens=30, lookup=False).token_ids for p in REPETITIVE
    ]


def test_explicit_no_drafter_and_plain_runs_stay_plain(no_shipped_drafter):
    """drafter=None: plain decoding (no copies) unless lookup=True; use_drafter=False is plain whatever the load."""
    plain = SpeculativeGenerator.load("tiny", None, dtype=torch.float32)
    assert not plain.lookup_without_drafter and not plain.uses_lookup()
    s = plain.generate(REPETITIVE[0], max_new_tokens=30).stats
    assert not s.lookup and not s.adaptive and s.block_size == 1 and not any(s.copied_steps)
    assert all(d == 0 for d in s.drafted_lengths)
    asked = plain.generate(REPETITIVE[0], max_new_tokens=30, lookup=True).stats  # asked for: lookup alone
    assert asked.lookup and asked.adaptive and any(asked.copied_steps)

    auto = SpeculativeGenerator.load("tiny", "auto", dtype=torch.float32)
    for kwargs in ({"use_drafter": False}, {"lookup": False}):
        s = auto.generate(REPETITIVE[0], max_new_tokens=30, **kwargs).stats
        assert not s.lookup and s.block_size == 1 and not any(s.copied_steps)
    fixed = auto.generate(REPETITIVE[0], max_new_tokens=30, block_size=6).stats  # a block given: no policy
    assert fixed.lookup and not fixed.adaptive and fixed.block_size == 6


def _oracle(monkeypatch, prompt: list[int], output: list[int], right: bool) -> None:
    """A lookup that always has a copy: the plain output's next tokens (right), or tokens that differ from each
    (wrong: rejected at once)."""

    def propose(self, max_tokens):
        i = len(self.tokens) - len(prompt)  # self.tokens = prompt + output[:i]
        ahead = output[i : i + max_tokens]
        return ahead if right else [(t + 1) % VOCAB for t in ahead]

    monkeypatch.setattr(NgramLookup, "propose", propose)


def _timed_by_rows(policy, chosen: list[int]) -> None:
    """Steps cost 10 ms + 2 ms per verified row after the first (a compute-bound target), whatever the machine;
    records the sizes the copy policy chooses."""
    copies = policy.copies
    choose, observe = copies.choose, copies.observe

    def choosing():
        chosen.append(choose())
        return chosen[-1]

    copies.choose = choosing
    copies.observe = lambda block, drafted, accepted, seconds: observe(
        block, drafted, accepted, 0.010 + 0.002 * (block - 1)
    )


@pytest.mark.parametrize("right", [False, True], ids=["copies-rejected", "copies-accepted"])
def test_the_copy_policy_sizes_copies_and_declines_those_that_do_not_pay(monkeypatch, right):
    """Every step has a copy: where copies are rejected the policy settles on plain steps (size 1, no copy);
    where they hold, on the longest copies. The output is plain decoding's either way."""
    model = tiny_target("llama")
    prompt = REPETITIVE[1]
    options = DecodeOptions(max_new_tokens=120, lookup=True)
    plain = [t for s in decode(TargetAdapter(model), None, prompt, DecodeOptions(max_new_tokens=120)) for t in s.tokens]
    _oracle(monkeypatch, prompt, plain, right)
    policy, chosen = BlockPolicies(LOOKUP_ALONE_BLOCK, lookup_alone=True).get(True), []
    _timed_by_rows(policy, chosen)
    stats = DecodeStats(1)
    out = [t for s in decode(TargetAdapter(model), None, prompt, options, stats, block_policy=policy) for t in s.tokens]
    assert out == plain
    copied = [d for d, c in zip(stats.drafted_lengths, stats.copied_steps) if c]
    assert policy.copies.steps == stats.steps  # every step reported: copies and plain steps alike
    assert policy.steps == 0  # no drafter: the drafter's block policy is never asked
    if right:
        assert chosen.count(16) >= 4 and max(copied) == 15
        assert sum(stats.accepted_lengths) >= 80  # most tokens were copies
    else:
        late = chosen[-40:]
        assert late.count(1) >= 30  # plain steps, the small copies re-timed now and then
        assert 8 not in chosen and 16 not in chosen  # their guessed times could not win: never paid for
        assert len(copied) + chosen.count(1) == len(chosen) >= stats.steps - 1  # a declined copy: a plain step
        assert sum(stats.accepted_lengths) == 0


def test_lookup_alone_policies_weigh_plain_steps():
    """Prompt lookup alone: the copy policies have size 1 (a plain step), within each regime's and batch's cap;
    with a drafter a copy is always taken (the drafter's policy weighs plain steps)."""
    alone = BlockPolicies(LOOKUP_ALONE_BLOCK, lookup_alone=True)
    assert alone.get(True).copies.candidates == [1, 2, 4, 8, 16]
    assert alone.get(False).copies.candidates == [1, 2, 4]
    assert alone.get(True, batched=True, members=8).copies.candidates == [1, 2]
    assert BlockPolicies(16).get(True).copies.candidates == [2, 4, 8, 16]
