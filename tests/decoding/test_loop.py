"""The decode loop: speculative greedy == plain greedy (fp32, token for token), cache invariants, stops."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.sampling import SamplingParams
from dflashkit.decoding.stats import DecodeStats
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import InvalidInputError
from dflashkit.kernels import row_kernels
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_drafter, tiny_target

N_PROMPTS = 20
MAX_NEW = 24


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def run(target: TargetAdapter, drafter, prompt: list[int], stats: DecodeStats | None = None, **kw) -> list[int]:
    options = DecodeOptions(**{"max_new_tokens": MAX_NEW, **kw})
    return [t for step in decode(target, drafter, prompt, options, stats) for t in step.tokens]


class OracleDrafter(DFlashDrafter):
    """Proposes the target's own greedy continuation, with one deliberate mistake at a varying offset.

    The mistake's offset cycles over 0..k+2, so every accepted length from 0 to k (full blocks) occurs.
    """

    def __init__(self, config, reference: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__(config)
        self.reference = reference  # prompt -> full greedy sequence (prompt + continuation)
        self.current: list[int] = []
        self.calls = 0

    def draft_scores(self, context, new_features, new_start, anchor, pos, k, embed_tokens, lm_head):
        super().draft_scores(context, new_features, new_start, anchor, pos, k, embed_tokens, lm_head)
        logits = torch.zeros(k, VOCAB)
        wrong_at = self.calls % (k + 3)
        self.calls += 1
        for j in range(k):
            i = pos + 1 + j
            token = self.current[i] if i < len(self.current) else 0
            if j == wrong_at:
                token = (token + 1) % VOCAB
            logits[j, token] = 10.0
        return logits, None  # over the whole vocabulary


def assert_oracle_and_drafter_match_plain(
    model, drafter, block_size: int, prompt_list: list[list[int]], oracle_dtype: torch.dtype = torch.float32
) -> DecodeStats:
    """Speculative greedy == plain greedy for every prompt, with `drafter` and with an oracle drafter (same
    weights) that reaches every accepted length; returns the oracle's stats."""
    target, plain = TargetAdapter(model, drafter.config.target_layer_ids), TargetAdapter(model)
    oracle = OracleDrafter(drafter.config, {}).to(oracle_dtype).eval()
    oracle.load_state_dict(drafter.state_dict())
    oracle_stats = DecodeStats(block_size)
    for prompt in prompt_list:
        expected = run(plain, None, prompt)
        assert run(target, drafter, prompt) == expected
        oracle.current = prompt + expected
        assert run(target, oracle, prompt, oracle_stats) == expected
    return oracle_stats


@functools.cache
def plain_outputs(arch: str) -> tuple[tuple[int, ...], ...]:
    """Plain greedy continuations of the shared prompts (computed once per architecture)."""
    plain = TargetAdapter(tiny_target(arch))
    return tuple(tuple(run(plain, None, p)) for p in prompts(N_PROMPTS))


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_speculative_equals_plain(arch, block_size):
    model = tiny_target(arch)
    drafter = tiny_drafter(model, block_size=block_size)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    oracle = OracleDrafter(drafter.config, {})
    oracle.load_state_dict(drafter.state_dict())
    oracle_stats = DecodeStats(block_size)
    for prompt, expected in zip(prompts(N_PROMPTS), plain_outputs(arch)):
        expected = list(expected)
        assert run(target, drafter, prompt) == expected
        oracle.current = prompt + expected
        assert run(target, oracle, prompt, oracle_stats) == expected
    # The oracle exercised every accepted length, full blocks included.
    hist = oracle_stats.acceptance_histogram
    assert all(count > 0 for count in hist), hist


def test_greedy_speculative_equals_plain_qwen2():
    model = tiny_target("qwen2")
    drafter = tiny_drafter(model, block_size=8)
    target, plain = TargetAdapter(model, drafter.config.target_layer_ids), TargetAdapter(model)
    for prompt in prompts(10, seed=11):
        assert run(target, drafter, prompt) == run(plain, None, prompt)


def assert_bf16_parts_only_at_ties(model, drafter, prompt_list: list[list[int]]) -> None:
    """Speculative greedy output on a bf16 model equals plain decoding or parts at a numerical tie (judged on
    the plain step's logits by the core rule), for every prompt."""
    from dflashkit.decoding.lossless import DivergenceRecorder

    target = TargetAdapter(model, drafter.config.target_layer_ids)
    for prompt in prompt_list:
        spec = run(target, drafter, prompt)
        recorder = DivergenceRecorder(spec, torch.bfloat16)
        options = DecodeOptions(max_new_tokens=MAX_NEW)
        plain = [t for s in decode(TargetAdapter(model), None, prompt, options, observer=recorder) for t in s.tokens]
        divergence = recorder.result(plain)
        assert divergence is None or divergence.tie, divergence


def test_greedy_equality_in_bfloat16_allows_only_ties(arch):
    model = tiny_target(arch, dtype=torch.bfloat16)
    assert_bf16_parts_only_at_ties(model, tiny_drafter(model, block_size=8), prompts(4, seed=3))


@pytest.mark.skipif(row_kernels.kernel() is None, reason="the row-by-row AVX512-BF16 kernels do not run here")
@pytest.mark.parametrize("block_size", [4, 8])
def test_greedy_in_bfloat16_is_exact_with_the_row_by_row_kernels(arch, block_size):
    """Where verify rows are computed bitwise like one-token steps (dflashkit.kernels.row_kernels), bf16 speculative
    greedy
    equals plain greedy token for token: no ties to excuse."""
    model = tiny_target(arch, dtype=torch.bfloat16)
    drafter = tiny_drafter(model, block_size=block_size)
    assert TargetAdapter(model, drafter.config.target_layer_ids).fast_forward.row_exact
    oracle_stats = assert_oracle_and_drafter_match_plain(
        model, drafter, block_size, prompts(24, seed=5), torch.bfloat16
    )
    assert all(count > 0 for count in oracle_stats.acceptance_histogram), str(oracle_stats.acceptance_histogram)


def test_caches_equal_a_fresh_prefill_after_every_step(arch):
    """Target KV cache and drafter context after each accepted length == recomputed from the verified text."""
    model = tiny_target(arch)
    base = tiny_drafter(model, block_size=6)
    full_seq: list[int] = []
    checked = {"target": 0, "context": 0}

    class CheckingTarget(TargetAdapter):
        def new_cache(self, capacity=None):
            self.cache = super().new_cache(capacity)
            return self.cache

    target = CheckingTarget(model, base.config.target_layer_ids)
    fresh_target = TargetAdapter(model, base.config.target_layer_ids)

    def fresh(prefix: list[int]):
        cache = fresh_target.new_cache()
        _, feats = fresh_target.forward(torch.tensor([prefix]), 0, cache, logits_rows=1)
        return cache, feats

    class CheckingOracle(OracleDrafter):
        def draft_scores(self, context, new_features, new_start, anchor, pos, k, embed_tokens, lm_head):
            out = super().draft_scores(context, new_features, new_start, anchor, pos, k, embed_tokens, lm_head)
            assert context.length == pos  # context holds exactly the verified positions before the block
            _, feats = fresh(self.current[:pos])
            with torch.no_grad():
                expected = self.context_key_values(feats, torch.arange(pos))
            for (k_got, v_got), (k_exp, v_exp) in zip(context.layers(), expected):
                torch.testing.assert_close(k_got, k_exp, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(v_got, v_exp, rtol=1e-4, atol=1e-4)
            checked["context"] += 1
            return out

    drafter = CheckingOracle(base.config, {})
    drafter.load_state_dict(base.state_dict())
    prompt = prompts(1, seed=7)[0]
    plain = run(TargetAdapter(model), None, prompt, max_new_tokens=40)
    drafter.current = full_seq = prompt + plain
    stats = DecodeStats(6)
    emitted: list[int] = []

    def observer(_logits, tokens):
        emitted.extend(tokens)
        verified = len(prompt) + len(emitted) - 1  # the last emitted token is not yet in the target
        assert target.cache.get_seq_length() == verified
        expected_cache, _ = fresh(full_seq[:verified])
        got, exp = TargetAdapter.cached_key_values(target.cache), TargetAdapter.cached_key_values(expected_cache)
        for (k_got, v_got), (k_exp, v_exp) in zip(got, exp):
            torch.testing.assert_close(k_got, k_exp, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v_got, v_exp, rtol=1e-4, atol=1e-4)
        checked["target"] += 1

    out = [
        t for s in decode(target, drafter, prompt, DecodeOptions(max_new_tokens=40), stats, observer) for t in s.tokens
    ]
    assert out == plain
    assert set(stats.accepted_lengths) == set(range(6)), stats.accepted_lengths  # every accepted length 0..5
    assert checked["target"] == stats.steps + 1 and checked["context"] >= stats.steps - 1


def test_exact_max_new_tokens_and_stats(arch):
    model = tiny_target(arch)
    drafter = tiny_drafter(model, block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    for n in (1, 2, 7, 8, 9, 33):
        stats = DecodeStats(8)
        steps = list(decode(target, drafter, [5, 6, 7], DecodeOptions(max_new_tokens=n), stats))
        assert sum(len(s.tokens) for s in steps) == n == stats.new_tokens
        assert steps[-1].finished and not any(s.finished for s in steps[:-1])
        assert stats.finish_reason == "length"
        assert stats.target_forwards == stats.steps + 1
        assert all(d <= 7 for d in stats.drafted_lengths)


def test_stop_token_ends_generation_mid_block(arch):
    model = tiny_target(arch)
    drafter = tiny_drafter(model, block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    prompt = [9, 10, 11]
    plain = run(TargetAdapter(model), None, prompt, max_new_tokens=30)
    stop = plain[12]  # a token the plain output produces
    first = plain.index(stop)
    oracle = OracleDrafter(drafter.config, {})
    oracle.load_state_dict(drafter.state_dict())
    oracle.current = prompt + plain
    stats = DecodeStats(8)
    out = run(target, oracle, prompt, stats, max_new_tokens=30, stop_token_ids=frozenset({stop}))
    assert out == plain[: first + 1]
    assert stats.finish_reason == "stop"


def test_tokens_equal_to_the_mask_id_are_kept(arch):
    """A drafter whose mask id is a token the target emits: output keeps it (no value-based filtering)."""
    model = tiny_target(arch)
    prompt = [4, 8, 15, 16]
    plain = run(TargetAdapter(model), None, prompt)
    mask_id = plain[3]
    drafter = tiny_drafter(model, block_size=4, mask_token_id=mask_id)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    out = run(target, drafter, prompt)
    assert out == plain and out.count(mask_id) >= 1
    # and as a stop token it stops only where it was really generated
    stopped = run(target, drafter, prompt, stop_token_ids=frozenset({mask_id}))
    assert stopped == plain[: plain.index(mask_id) + 1]


def test_learned_mask_embedding_changes_drafts_not_output(arch):
    model = tiny_target(arch)
    drafter = tiny_drafter(model, block_size=4)  # no mask id: learned mask vector
    assert drafter.mask_embedding is not None
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    plain = run(TargetAdapter(model), None, [3, 1, 4])
    assert run(target, drafter, [3, 1, 4]) == plain


def test_block_size_override_and_plain_loop_are_the_same_function(arch):
    model = tiny_target(arch)
    drafter = tiny_drafter(model, block_size=16)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    stats = DecodeStats(1)
    out = run(target, drafter, [7, 7, 7], stats, block_size=3)
    assert stats.block_size == 3 and max(stats.drafted_lengths) == 2
    plain_stats = DecodeStats(1)
    assert out == run(TargetAdapter(model), None, [7, 7, 7], plain_stats)
    assert plain_stats.tau == 1.0 and plain_stats.steps == MAX_NEW - 1


def test_draft_vocabulary_restricts_proposals_not_output(arch):
    model = tiny_target(arch)
    base = tiny_drafter(model, block_size=4)
    vocab = list(range(0, VOCAB, 3))
    drafter = DFlashDrafter(base.config.replace(draft_vocab=vocab))
    drafter.load_state_dict(base.state_dict())
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    with torch.no_grad():
        hidden = torch.randn(5, model.config.hidden_size)
        logits = drafter.logits(hidden, model.get_output_embeddings())
        full = model.get_output_embeddings()(hidden)
    assert torch.isinf(logits[:, [i for i in range(VOCAB) if i not in vocab]]).all()
    torch.testing.assert_close(logits[:, vocab], full[:, vocab])
    for prompt in prompts(5, seed=9):
        assert run(target, drafter, prompt) == run(TargetAdapter(model), None, prompt)
    sampled = run(
        target, drafter, [5, 6], max_new_tokens=12, seed=0, proposal="sample", sampling=SamplingParams(temperature=1.0)
    )
    assert len(sampled) == 12


def test_the_proposal_temperature_reaches_the_drafters_proposals(monkeypatch):
    """Sampled drafts are drawn at the drafter's config.proposal_temperature times the request's temperature, and
    DecodeOptions.proposal_temperature overrides it; the coupled sampler's drafter scores keep the request's
    temperature; greedy decoding ignores it; bad values are refused. (That
    any proposal temperature keeps the target's distribution: test_sampling's oracle-sharp cases.)"""
    decode_module = importlib.import_module("dflashkit.decoding.loop")  # the package's `decode` is the function

    model = tiny_target("llama")
    base = tiny_drafter(model, block_size=4)
    drafter = DFlashDrafter(base.config.replace(proposal_temperature=0.5))
    drafter.load_state_dict(base.state_dict())
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    temperatures, coupled = [], []

    def recording(fn, into):  # fn, noting the temperature of the SamplingParams it is given
        def recorded(*args, **kwargs):
            into.append(next(a for a in (*args, *kwargs.values()) if isinstance(a, SamplingParams)).temperature)
            return fn(*args, **kwargs)

        return recorded

    propose_module = importlib.import_module("dflashkit.decoding.propose")
    monkeypatch.setattr(propose_module, "propose", recording(propose_module.propose, temperatures))
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    for ratio, expected in ((None, 0.4), (1.0, 0.8), (1.5, 1.2)):
        temperatures.clear()
        out = run(target, drafter, [5, 6, 7], max_new_tokens=10, seed=0, sampling=sampling, proposal_temperature=ratio)
        assert len(out) == 10 and temperatures and all(t == pytest.approx(expected) for t in temperatures)
    assert run(target, drafter, [5, 6, 7], proposal_temperature=0.3) == run(TargetAdapter(model), None, [5, 6, 7])
    # coupled: the drafter's noisy scores keep the request's temperature, as the target's do (there a sharper
    # proposal lowered τ), and the output stays plain coupled sampling's for the seed
    for name in ("scores", "argmax"):  # every noisy score: the drafter's and the target's decisions
        monkeypatch.setattr(
            decode_module.PositionNoise, name, recording(getattr(decode_module.PositionNoise, name), coupled)
        )
    plain = run(TargetAdapter(model), None, [5, 6, 7], max_new_tokens=10, seed=3, sampling=sampling, sampler="coupled")
    assert set(coupled) == {0.8}
    for ratio, expected in ((None, {0.8}), (1.5, {0.8})):
        coupled.clear()
        out = run(
            target,
            drafter,
            [5, 6, 7],
            max_new_tokens=10,
            seed=3,
            sampling=sampling,
            sampler="coupled",
            proposal_temperature=ratio,
        )
        assert out == plain and {round(t, 6) for t in coupled} == expected
    for bad in (0, -1.0, float("nan"), "0.5", True):
        with pytest.raises(InvalidInputError, match="proposal temperature"):
            DecodeOptions(proposal_temperature=bad)


def test_a_draft_window_changes_drafts_not_output(arch, monkeypatch):
    """The drafter's own context window applies by default, DecodeOptions.draft_window overrides it (0: the whole
    context); greedy output stays plain greedy output whatever the window, and bad values are refused."""
    model = tiny_target(arch)
    base = tiny_drafter(model, block_size=4)
    drafter = DFlashDrafter(base.config.replace(context_window=3))
    drafter.load_state_dict(base.state_dict())
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    windows = []
    new_context = drafter.new_context

    def recording(capacity, window):
        windows.append(window)
        return new_context(capacity, window)

    monkeypatch.setattr(drafter, "new_context", recording)
    for prompt in prompts(4, seed=5):
        plain = run(TargetAdapter(model), None, prompt)
        for window, used in ((None, 3), (0, None), (1, 1), (5, 5)):
            stats = DecodeStats(4)
            assert run(target, drafter, prompt, stats, draft_window=window) == plain
            assert stats.draft_window == used and stats.as_dict()["draft_window"] == used
    assert windows == [3, None, 1, 5] * 4
    for bad in (-1, 2.5, True):
        with pytest.raises(InvalidInputError, match="draft_window"):
            DecodeOptions(draft_window=bad)
