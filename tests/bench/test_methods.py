"""Benchmark methods of dflashkit's own loop, and the target session they share with the peers."""

from __future__ import annotations

import torch

from dflashkit.bench.methods import Autoregressive, DFlash, Request, TargetSession, Unavailable
from dflashkit.decoding.loop import decode
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import tiny_drafter, tiny_target, word_tokenizer

PROMPT = [1, 5, 9, 17, 33, 5, 9, 40]


def request(temperature: float = 0.0, max_new_tokens: int = 20) -> Request:
    return Request(PROMPT, max_new_tokens, temperature, seed=3, stop_token_ids=frozenset({2}))


def session(dtype: torch.dtype = torch.float32) -> TargetSession:
    return TargetSession(tiny_target("llama", dtype=dtype), word_tokenizer())


def test_transformers_mode_restores_transformers_attention_for_a_while() -> None:
    s = session()
    assert s.original_attention == "sdpa" and s.model.config._attn_implementation == "packed_gqa"
    s.adapter.set_feature_layers([1, 3])
    with s.transformers_mode() as model:
        assert model.config._attn_implementation == "sdpa" and s.adapter.feature_layer_ids == []
    assert s.model.config._attn_implementation == "packed_gqa"


def test_autoregressive_is_the_decode_loop_without_drafter() -> None:
    s = session()
    rec = Autoregressive(s).generate(request())
    expected = [t for step in decode(TargetAdapter(s.model), None, PROMPT, _opts()) for t in step.tokens]
    assert rec.tokens == expected and 0 < rec.ttft_s <= rec.total_s
    assert rec.block_size == 1 and set(rec.accepted_lengths) <= {0}
    assert {"prefill", "draft", "verify", "other"} <= set(rec.phases_s)


def _opts():
    from dflashkit.bench.methods import options_for

    return options_for(request())


def test_dflash_matches_the_baseline_in_fp32_and_logs_steps() -> None:
    s = session()
    drafter = tiny_drafter(s.model, block_size=8)
    base = Autoregressive(s).generate(request())
    for block in (4, 8, 12):
        m = DFlash(s, drafter, block, "tiny")
        rec = m.generate(request())
        assert m.name == f"dflash-b{block}" and rec.tokens == base.tokens
        assert rec.block_size == block and len(rec.accepted_lengths) == len(rec.drafted_lengths) > 0
        assert max(rec.drafted_lengths) <= block - 1
        assert ("beyond its trained block size" in m.note) == (block > 8)
    assert Autoregressive(s).generate(request()).tokens == base.tokens  # the drafter's hooks are gone again
    tree = DFlash(s, drafter, 8, "tiny", lookup=True, tree=6)
    rec = tree.generate(request())
    assert tree.name == "dflash-lookup-tree6" and "token trees of up to 6 nodes" in tree.note
    assert rec.tokens == base.tokens and rec.block_size == 8


def test_tree_methods_follow_the_block_size_asked_for(monkeypatch) -> None:
    """Trees with --block-sizes auto are sized per step by the adaptive policies (their copies too: at T=1 the sampled
    policy copies at most 3 tokens, where trees at the trained block size copied up to 15), at another block size go
    no deeper than it; greedy output stays the baseline's either way."""
    import sys

    from dflashkit.decoding.adaptive import AdaptiveBlockSize

    methods = sys.modules["dflashkit.bench.methods"]
    policies: list = []
    real_decode = methods.decode

    def spy(target, drafter, ids, options, stats=None, observer=None, block_policy=None, *rest):
        policies.append((options.tree, options.block_size, block_policy))
        return real_decode(target, drafter, ids, options, stats, observer, block_policy, *rest)

    monkeypatch.setattr(methods, "decode", spy)
    s = session()
    drafter = tiny_drafter(s.model, block_size=8)
    base = Autoregressive(s).generate(request())
    auto, four = DFlash(s, drafter, "auto", "tiny", lookup=True, tree=5), DFlash(s, drafter, 4, "tiny", tree=5)
    assert (auto.name, four.name) == ("dflash-lookup-auto-tree5", "dflash-b4-tree5")
    assert "block size chosen per step" in auto.note and "block size 4" in four.note
    for method in (auto, four):
        rec = method.generate(request())
        assert rec.tokens == base.tokens
    (tree_a, block_a, policy_a), (tree_b, block_b, policy_b) = policies[-2:]
    assert tree_a == tree_b == 5 and isinstance(policy_a, AdaptiveBlockSize) and block_a is None
    assert policy_b is None and block_b == 4
    assert policy_a is auto.policy.get(True, tree=True)  # the run's greedy tree policy: estimates carry over
    sampled = auto.policy.get(False, tree=True)
    auto.generate(request(temperature=1.0))
    assert policies[-1][2] is sampled and sampled.max_block == 4 and sampled.steps > 0


def test_default_method_keeps_copies_as_chains_in_the_default_trees(monkeypatch) -> None:
    """The bench's default method runs what the library does by default: under coupled sampling, trees of
    COUPLED_TREE nodes whose copied steps stay chains; a tree method asked for puts the copies in its trees."""
    import dataclasses
    import sys

    from dflashkit.decoding.defaults import COUPLED_TREE
    from tests.conftest import record_decode_options

    seen = record_decode_options(monkeypatch, sys.modules["dflashkit.bench.methods"], "tree", "tree_copies")
    s = session()
    drafter = tiny_drafter(s.model, block_size=8)
    coupled = dataclasses.replace(request(temperature=1.0), sampler="coupled")
    DFlash(s, drafter, "auto", "tiny", lookup=True).generate(coupled)
    DFlash(s, drafter, 8, "tiny", lookup=True, tree=6).generate(coupled)
    assert seen == [(COUPLED_TREE, False), (6, True)]


def test_sampling_is_seeded() -> None:
    s = session()
    a, b = (Autoregressive(s).generate(request(temperature=1.0)) for _ in range(2))
    assert a.tokens == b.tokens


def test_unavailable_placeholder() -> None:
    m = Unavailable("dflash-b4", "dflashkit", "no drafter")
    assert m.unavailable() == "no drafter" and m.describe()["name"] == "dflash-b4"


def test_eager_session_runs_dflashkit_methods_on_the_eager_path_with_the_same_tokens() -> None:
    fast, eager = session(), TargetSession(tiny_target("llama"), word_tokenizer(), fast=False)
    assert "fast forward" in fast.adapter.engine and eager.adapter.engine == "transformers forward (eager)"
    drafters = [tiny_drafter(s.model, block_size=4) for s in (fast, eager)]
    methods = [DFlash(s, d, 4, "tiny") for s, d in zip((fast, eager), drafters)]
    assert drafters[0].fast and not drafters[1].fast
    assert methods[0].generate(request()).tokens == methods[1].generate(request()).tokens
    with fast.transformers_mode() as model:  # transformers' own modules for the peers
        assert not any(type(m).__name__ == "PackedLinear" for m in model.modules())


def test_prompt_lookup_drafts_from_a_store_of_answers_and_keeps_the_baseline_tokens(tmp_path, monkeypatch) -> None:
    """`bench --lookup-store`: the `lookup` method's decode loop gets the store; tokens stay the baseline's."""
    import dflashkit.bench.methods as methods
    from dflashkit.bench.command import load_lookup_store
    from dflashkit.drafter.ngram_store import NgramStore

    s = session()
    base = Autoregressive(s).generate(request(max_new_tokens=24))
    store = NgramStore.build([PROMPT + base.tokens] * 2, n=3, min_count=2)  # the baseline's own answer, seen twice
    store.save(tmp_path / "ngram_store.safetensors")
    loaded = load_lookup_store(str(tmp_path))  # a folder holding the store, as `dflashkit ngram-store --out` writes
    assert len(loaded) == len(store) and load_lookup_store(None) is None
    seen = []
    real_decode = methods.decode

    def spy(target, drafter, prompt, options, *args, **kw):
        seen.append(options.lookup_store)
        return real_decode(target, drafter, prompt, options, *args, **kw)

    monkeypatch.setattr(methods, "decode", spy)
    m = methods.PromptLookup(s, store=loaded)
    assert m.generate(request(max_new_tokens=24)).tokens == base.tokens and "n-gram store" in m.note
    assert methods.PromptLookup(s).generate(request(max_new_tokens=24)).tokens == base.tokens
    assert seen == [loaded, None]
