"""Prompt prefix cache: a chat's next turn restores the earlier turn's keys and values and prefills only the rest,
with the output unchanged (fp32, token for token)."""

from __future__ import annotations

import pytest
import torch

from dflashkit import PrefixCache, SpeculativeGenerator
from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.prefix_cache import CachedSequence
from dflashkit.decoding.sampling import SamplingParams
from dflashkit.decoding.stats import DecodeStats
from dflashkit.errors import InvalidInputError
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_drafter, tiny_target, word_tokenizer


def sequence(ids: list[int], features: bool = True, layers: tuple[int, ...] = (1,)) -> CachedSequence:
    n = len(ids)
    return CachedSequence(
        tuple(ids),
        torch.zeros(2, 1, n, 4),
        torch.zeros(2, 1, n, 4),
        torch.zeros(1, n, 8) if features else None,
        layers if features else (),
    )


def test_prefix_cache_matches_the_longest_prefix_and_keeps_within_its_budget():
    cache = PrefixCache(max_bytes=8_000, min_reuse=4)  # 96 bytes per token of these sequences
    a, b = list(range(10, 30)), list(range(10, 20)) + list(range(50, 60))
    cache.add(sequence(a))
    cache.add(sequence(b))
    seq, n = cache.match(list(range(10, 25)) + [99], feature_layers=(1,))
    assert seq.token_ids == tuple(a) and n == 15
    assert cache.match(list(range(10, 13)) + [7] * 10) is None  # 3 shared tokens: below min_reuse
    assert cache.match(a, feature_layers=(1,))[1] == len(a) - 1  # the whole sequence: its last token runs again
    assert cache.match(a, feature_layers=(2,)) is None  # features of other layers cannot serve this drafter
    cache.add(sequence(a + [1, 2, 3]))  # the next turn of `a`'s conversation replaces it
    assert len(cache) == 2 and cache.match(a + [1, 2, 3, 4])[1] == len(a) + 3
    cache.add(sequence(list(range(100, 160))))  # past the budget: the least recently used goes
    assert (
        cache.nbytes <= cache.max_bytes and cache.match(b)[1] == 10 and cache.match(a + [1, 2, 3, 4]) is not None
    )  # b gone: only what it shares with a
    cache.add(sequence(list(range(200, 400))))  # larger than the whole budget: not kept
    assert cache.match(list(range(200, 400))) is None
    cache.bind(object)
    with pytest.raises(InvalidInputError, match="another target model"):
        cache.bind(int)
    with pytest.raises(InvalidInputError):
        PrefixCache(max_bytes=-1)
    assert PrefixCache.of_mib(0) is None and PrefixCache.of_mib(1).max_bytes == 2**20


def test_an_owner_matches_only_its_own_sequences():
    """A scoped view matches and keeps its owner's sequences only: one owner's prompt restores nothing another kept,
    however it begins; the cache used directly is owner "" and sees neither view's sequences."""
    cache = PrefixCache(max_bytes=1 << 20, min_reuse=4)
    a, b = cache.scoped("a"), cache.scoped("b")
    secret = list(range(10, 40))
    a.add(sequence(secret))
    assert a.match(secret + [1], feature_layers=(1,))[1] == len(secret)
    assert b.match(secret + [1], feature_layers=(1,)) is None and cache.match(secret + [1]) is None
    assert b.max_bytes == cache.max_bytes and b.min_reuse == 4
    b.add(sequence(secret[:20]))  # b's own copy of the first 20: it does not replace a's longer one
    assert len(cache) == 2 and b.match(secret)[1] == 20 and a.match(secret)[1] == len(secret) - 1
    a.add(sequence(secret + [1, 2]))  # extends a's: drops a's, not b's
    assert len(cache) == 2 and b.match(secret)[1] == 20
    cache.add(sequence(list(range(100, 120))))  # owner ""
    assert cache.match(list(range(100, 121)))[1] == 20 and a.match(list(range(100, 121))) is None
    assert cache.hits == 5 and cache.misses == 3  # one set of counters for all owners
    with pytest.raises(InvalidInputError, match="PrefixCache"):
        PrefixCache.scoped({}, "a")
    with pytest.raises(InvalidInputError, match="owner"):
        cache.scoped(3)


def test_owners_share_one_budget_and_one_least_recently_used_order():
    """Room for two sequences: a third, of any owner, drops the least recently used of all (a match counts as a
    use), so the cache never holds more than its size however many owners use it."""
    cache = PrefixCache(max_bytes=2 * 20 * 96, min_reuse=4)  # 96 bytes per token: two 20-token sequences
    a, b = cache.scoped("a"), cache.scoped("b")
    first, second, third = (list(range(s, s + 20)) for s in (10, 100, 200))
    a.add(sequence(first))
    b.add(sequence(second))
    assert a.match(first + [0]) is not None  # a's is now the more recent
    b.add(sequence(third))  # over budget: b's older sequence goes, not a's
    assert len(cache) == 2 and cache.nbytes <= cache.max_bytes
    assert b.match(second + [0]) is None and a.match(first + [0]) is not None and b.match(third + [0]) is not None
    cache.scoped("c").add(sequence(list(range(300, 320))))  # a third owner: a's, now least recently used, goes
    assert a.match(first + [0]) is None and b.match(third + [0]) is not None and len(cache) == 2


def test_a_scoped_view_decodes_the_same_tokens_and_reuses_only_its_owners_prefix():
    """Through the generator, as the server uses it: the same prompt decodes the same tokens with either owner's
    view; the owner that ran it before restores its prefix, the other restores nothing."""
    model = tiny_target("llama")
    gen = SpeculativeGenerator(model, word_tokenizer(), tiny_drafter(model, block_size=4))
    cache = PrefixCache(max_bytes=1 << 26)
    prompt = list(range(10, 40))
    first = gen.generate(prompt, prefix_cache=cache.scoped("a"), max_new_tokens=12)
    again = gen.generate(prompt, prefix_cache=cache.scoped("a"), max_new_tokens=12)
    other = gen.generate(prompt, prefix_cache=cache.scoped("b"), max_new_tokens=12)
    plain = gen.generate(prompt, max_new_tokens=12)
    assert first.stats.cached_prompt_tokens == 0 and other.stats.cached_prompt_tokens == 0
    assert again.stats.cached_prompt_tokens == len(prompt) - 1
    assert first.token_ids == again.token_ids == other.token_ids == plain.token_ids


def run(target, drafter, prompt, cache=None, **kw) -> tuple[list[int], DecodeStats]:
    stats = DecodeStats(block_size=1)
    options = DecodeOptions(**{"max_new_tokens": 20, **kw})
    return [
        t for step in decode(target, drafter, prompt, options, stats, prefix_cache=cache) for t in step.tokens
    ], stats


@pytest.mark.parametrize("arch, fast, tree", [("llama", True, None), ("qwen3", True, 4), ("llama", False, None)])
def test_next_turn_restores_the_cached_prefix_and_decodes_the_same_tokens(arch, fast, tree):
    """Turn 1 is kept; turn 2 (turn 1 + its answer + a new message) restores all of it but the answer's last
    token, and its greedy output equals an uncached plain run, speculative (chain or tree) and plain alike."""
    model = tiny_target(arch)
    drafter = tiny_drafter(model, block_size=4)
    target = TargetAdapter(model, drafter.config.target_layer_ids, fast=fast)
    fresh = TargetAdapter(model, fast=fast)
    g = torch.Generator().manual_seed(3)
    turn1 = torch.randint(3, VOCAB, (30,), generator=g).tolist()
    cache = PrefixCache(max_bytes=1 << 26)
    out1, stats1 = run(target, drafter, turn1, cache, tree=tree)
    assert stats1.cached_prompt_tokens == 0 and len(cache) == 1
    assert out1 == run(fresh, None, turn1)[0]
    turn2 = turn1 + out1 + torch.randint(3, VOCAB, (7,), generator=g).tolist()
    out2, stats2 = run(target, drafter, turn2, cache, tree=tree)
    assert stats2.cached_prompt_tokens == len(turn1) + len(out1) - 1
    assert out2 == run(fresh, None, turn2)[0]
    plain2, plain_stats = run(fresh, None, turn2, PrefixCache(max_bytes=1 << 26))
    assert plain2 == out2 and plain_stats.cached_prompt_tokens == 0
    # sampled with a seed: the same draws as without the cache
    sampled = {"sampling": SamplingParams(temperature=1.0), "seed": 5}
    assert run(target, drafter, turn2, cache, **sampled)[0] == run(target, drafter, turn2, None, **sampled)[0]


def test_restored_keys_and_values_are_those_of_a_fresh_prefill():
    model = tiny_target("qwen3")
    target = TargetAdapter(model, (1, 3))
    ids = torch.randint(3, VOCAB, (1, 25), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(64)
    target.forward(ids, 0, cache, logits_rows=1)
    keys, values = target.snapshot(cache, 25)
    restored = target.restore(keys, values, 20, capacity=64)
    assert restored.length == 20
    for (k, v), (k0, v0) in zip(TargetAdapter.cached_key_values(restored), TargetAdapter.cached_key_values(cache)):
        assert torch.equal(k, k0[:, :20]) and torch.equal(v, v0[:, :20])
    cache.crop(10)
    assert target.snapshot(cache, 25) is None  # positions it does not hold


def test_a_generation_stopped_early_is_kept_consistently():
    """A stream closed between steps (a stop string, a client gone) keeps what its cache holds: the next turn
    reuses it and still decodes the uncached tokens."""
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=4)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    prompt = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = PrefixCache(max_bytes=1 << 26)
    steps = decode(target, drafter, prompt, DecodeOptions(max_new_tokens=30), prefix_cache=cache)
    got = [t for _, step in zip(range(3), steps) for t in step.tokens]
    steps.close()
    assert len(cache) == 1 and len(next(iter(cache._kept.values())).token_ids) == len(prompt) + len(got) - 1
    turn2 = prompt + got + [5, 6, 7]
    out, stats = run(target, drafter, turn2, cache)
    assert stats.cached_prompt_tokens == len(prompt) + len(got) - 1
    assert out == run(TargetAdapter(model), None, turn2)[0]


def test_generator_reuses_a_chat_and_refuses_a_cache_of_another_model():
    model = tiny_target("llama")
    tokenizer = word_tokenizer()
    gen = SpeculativeGenerator(model, tokenizer, tiny_drafter(model, block_size=4))
    cache = PrefixCache(max_bytes=1 << 26)
    first = gen.generate(" ".join(f"w{i}" for i in range(10, 40)), chat=False, prefix_cache=cache, max_new_tokens=12)
    prompt2 = gen.encode_prompt(" ".join(f"w{i}" for i in range(10, 40)), chat=False) + first.token_ids + [9, 9]
    second = gen.generate(prompt2, prefix_cache=cache, max_new_tokens=12, compare_ar=True)
    assert second.stats.cached_prompt_tokens == len(prompt2) - 3 and second.stats.as_dict()["cached_prompt_tokens"] > 0
    assert second.token_ids == second.ar.token_ids and second.ar.stats.cached_prompt_tokens == 0
    other = SpeculativeGenerator(tiny_target("llama", seed=5), tokenizer)
    with pytest.raises(InvalidInputError, match="another target model"):
        other.generate(prompt2, prefix_cache=cache, max_new_tokens=4)
    with pytest.raises(InvalidInputError, match="PrefixCache"):
        gen.generate(prompt2, prefix_cache={}, max_new_tokens=4)


def test_a_sequence_past_the_budget_is_not_kept(monkeypatch):
    """Nor copied: the size is checked on one position first."""
    model = tiny_target("llama")
    target = TargetAdapter(model)
    prompt = list(range(10, 40))
    cache = PrefixCache(max_bytes=1 << 26)
    run(target, None, prompt, cache)
    per_token = cache.nbytes // len(next(iter(cache._kept.values())).token_ids)
    small = PrefixCache(max_bytes=per_token * 20)  # room for 20 positions, not 49
    copies = []
    snapshot = TargetAdapter.snapshot
    monkeypatch.setattr(TargetAdapter, "snapshot", lambda self, c, n: copies.append(n) or snapshot(self, c, n))
    run(target, None, prompt, small)
    assert len(small) == 0 and copies == [1]
