"""Prompt lookup: the n-gram index against a brute-force search, and decoding with it stays lossless."""

from __future__ import annotations

import random

import pytest
import torch

from dflashkit.decoding.adaptive import AdaptiveBlockSize
from dflashkit.decoding.lookup import NgramLookup
from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.options import LOOKUP_ONLY_BLOCK
from dflashkit.decoding.stats import DecodeStats
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_drafter, tiny_target


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The continuation after the latest earlier occurrence of the longest suffix n-gram, by scanning."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (2, 4), (1, 3)])
def test_index_equals_brute_force_search(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(60):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(0, 40))]  # small alphabet: many repeats
        index = NgramLookup(min_ngram=min_n, max_ngram=max_n)
        for cut in range(len(tokens) + 1):
            if cut:
                index.extend(tokens[cut - 1 : cut])  # grown one token at a time, as the decode loop does
            for k in (1, 3, 8):
                assert index.propose(k) == brute_force(tokens[:cut], k, min_n, max_n), (tokens[:cut], k)
        assert NgramLookup(tokens, min_n, max_n).propose(5) == brute_force(tokens, 5, min_n, max_n)


def test_index_rejects_bad_ngram_range():
    with pytest.raises(ValueError):
        NgramLookup(min_ngram=0)
    with pytest.raises(ValueError):
        NgramLookup(min_ngram=3, max_ngram=2)


REPETITIVE = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [10, 11, 12, 10, 11, 12, 10], [20, 21, 22, 23, 24, 25, 20, 21, 22]]


def _decode(target, drafter, prompt, stats=None, policy=None, **kw):
    options = DecodeOptions(**{"max_new_tokens": 40, **kw})
    return [t for step in decode(target, drafter, prompt, options, stats, block_policy=policy) for t in step.tokens]


@pytest.mark.parametrize("with_drafter", [True, False])
def test_greedy_with_lookup_equals_plain(arch, with_drafter):
    model = tiny_target(arch)
    drafter = tiny_drafter(model, block_size=8) if with_drafter else None
    target = TargetAdapter(model, drafter.config.target_layer_ids) if drafter else TargetAdapter(model)
    plain = TargetAdapter(model)
    g = torch.Generator().manual_seed(1)
    prompts = REPETITIVE + [torch.randint(3, VOCAB, (9,), generator=g).tolist() for _ in range(3)]
    copied = []
    for prompt in prompts:
        stats = DecodeStats(block_size=1)
        assert _decode(target, drafter, prompt, stats, lookup=True) == _decode(plain, None, prompt)
        copied += stats.copied_steps
        assert stats.lookup and stats.as_dict()["lookup"]["copied_steps"] == sum(stats.copied_steps)
        if not with_drafter:
            assert stats.block_size == LOOKUP_ONLY_BLOCK
            assert all(d == 0 for d, c in zip(stats.drafted_lengths, stats.copied_steps) if not c)
    assert any(copied) and not all(copied)  # both kinds of steps ran


def test_lookup_with_adaptive_block_size_and_sampling_runs_exactly_the_same_loop(arch):
    """Lookup steps skip the adaptive policy; seeded sampling is reproducible with lookup on."""
    model = tiny_target(arch)
    drafter = tiny_drafter(model, block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    plain = TargetAdapter(model)
    for prompt in REPETITIVE:
        policy = AdaptiveBlockSize(8, (1, 2, 4, 8))
        stats = DecodeStats(block_size=1)
        assert _decode(target, drafter, prompt, stats, policy, lookup=True) == _decode(plain, None, prompt)
        assert policy.steps == stats.steps - sum(stats.copied_steps)
    from dflashkit.decoding.sampling import SamplingParams

    runs = [
        _decode(target, drafter, REPETITIVE[0], lookup=True, sampling=SamplingParams(1.0), seed=7) for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_copies_are_no_longer_than_the_policys_largest_block(monkeypatch):
    """With a policy of smaller blocks (the sampled regime's), lookup steps copy at most its largest block - 1."""
    import sys

    class AlwaysCopies:  # proposes as many tokens as allowed (mostly wrong: verification rejects them, exactly)
        from_store = False

        def __init__(self, tokens, store=None):
            pass

        def propose(self, limit):
            return [7] * limit

        def extend(self, tokens):
            pass

    monkeypatch.setattr(
        sys.modules["dflashkit.decoding.loop"], "NgramLookup", AlwaysCopies
    )  # the module, not the function
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=8)
    target, plain = TargetAdapter(model, drafter.config.target_layer_ids), TargetAdapter(model)
    for policy, longest in ((None, 7), (AdaptiveBlockSize(8), 7), (AdaptiveBlockSize(4, (1, 2, 4)), 3)):
        stats = DecodeStats(block_size=1)
        assert _decode(target, drafter, REPETITIVE[0], stats, policy, lookup=True) == _decode(
            plain, None, REPETITIVE[0]
        )
        copies = [d for d, c in zip(stats.drafted_lengths, stats.copied_steps) if c]
        assert max(copies) == longest
