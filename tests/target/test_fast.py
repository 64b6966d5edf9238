"""The fast target forward: transformers' numbers, the same decoded tokens as the eager path, a static KV cache
whose bookkeeping after every accepted length equals a fresh prefill."""

from __future__ import annotations

import copy

import pytest
import torch

from dflashkit.decoding.adaptive import AdaptiveBlockSize
from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.sampling import SamplingParams
from dflashkit.decoding.stats import DecodeStats
from dflashkit.errors import InvalidInputError
from dflashkit.kernels.linear import has_packed_linears, pack_linears
from dflashkit.target.adapter import TargetAdapter
from dflashkit.target.fast import FastTargetForward, StaticKVCache, unsupported_reason
from tests.conftest import VOCAB, tiny_drafter, tiny_target

ARCHS = ["llama", "qwen2", "qwen3"]
PROMPTS = [[5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6], [42], list(range(10, 40))]


@pytest.fixture(params=ARCHS)
def any_arch(request) -> str:
    return request.param


def engines(arch: str, dtype=torch.float32, block_size: int = 8, **overrides):
    """The same tiny target + drafter three times: fast forward, transformers + prepacked linears, eager."""
    model = tiny_target(arch, dtype=dtype, **overrides)
    drafter = tiny_drafter(model, block_size=block_size).to(dtype)
    layers = drafter.config.target_layer_ids
    packed_model, eager_model = copy.deepcopy(model), copy.deepcopy(model)
    packed_drafter, eager_drafter = copy.deepcopy(drafter), copy.deepcopy(drafter)
    fast = TargetAdapter(model, layers)
    drafter.use_fast_path(True)
    packed = TargetAdapter(packed_model, layers, fast=False)
    packed.use_packed_linears(True)
    pack_linears(packed_drafter)  # transformers' forward + packed modules, drafter's modules packed too
    eager = TargetAdapter(eager_model, layers, fast=False)
    assert fast.fast_forward is not None and packed.fast_forward is None and has_packed_linears(packed_model)
    assert not eager.fast and not has_packed_linears(eager_drafter) and not eager_drafter.fast
    return {"fast": (fast, drafter), "packed": (packed, packed_drafter), "eager": (eager, eager_drafter)}


def run(target, drafter, prompt, stats=None, policy=None, **kw) -> list[int]:
    options = DecodeOptions(**{"max_new_tokens": 24, **kw})
    return [t for s in decode(target, drafter, prompt, options, stats, block_policy=policy) for t in s.tokens]


def test_supported_architectures(any_arch):
    assert unsupported_reason(tiny_target(any_arch)) is None


def test_unsupported_models_keep_transformers_forward():
    model = tiny_target("llama", hidden_act="gelu")
    assert "activation" in unsupported_reason(model)
    target = TargetAdapter(model)
    assert target.fast_forward is None and target.engine == "transformers forward, prepacked linear layers"
    with pytest.raises(InvalidInputError, match="does not cover"):
        FastTargetForward(model)


def test_logits_and_features_equal_transformers_in_fp32(any_arch):
    """One prefill and a few multi-token passes: logits and feature-layer states equal transformers' forward."""
    model = tiny_target(any_arch)
    reference = TargetAdapter(copy.deepcopy(model), [0, 2, 5], fast=False)
    fast = TargetAdapter(model, [0, 2, 5])
    ids = torch.tensor([list(range(4, 40))])
    ref_cache, fast_cache = reference.new_cache(), fast.new_cache(capacity=8)  # small: the buffers must grow
    for start, end in ((0, 20), (20, 21), (21, 29), (29, 36)):
        chunk = ids[:, start:end]
        ref_logits, ref_feats = reference.forward(chunk, start, ref_cache, logits_rows=end - start)
        got_logits, got_feats = fast.forward(chunk, start, fast_cache, logits_rows=end - start)
        torch.testing.assert_close(got_logits, ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_feats, ref_feats, rtol=1e-4, atol=1e-4)
    for (k_got, v_got), (k_ref, v_ref) in zip(
        fast.cached_key_values(fast_cache), reference.cached_key_values(ref_cache)
    ):
        torch.testing.assert_close(k_got, k_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v_got, v_ref, rtol=1e-4, atol=1e-4)


def test_training_pass_over_whole_sequences_equals_transformers_in_fp32(any_arch):
    """The target pass training runs (right-padded sequences from position 0, no cache): features and top-K
    log-probabilities through the fast forward equal transformers' forward with hooks; so do prompt log-probs."""
    model = tiny_target(any_arch)
    reference = TargetAdapter(copy.deepcopy(model), [0, 2, 5], fast=False)
    fast = TargetAdapter(model, [0, 2, 5])
    ids = torch.randint(3, VOCAB, (3, 17), generator=torch.Generator().manual_seed(2))
    ids[1, 11:] = 0  # right padding
    ref = reference.features_and_top_logprobs(ids, 6, chunk=5)
    got = fast.features_and_top_logprobs(ids, 6, chunk=5)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-4)  # features
    assert torch.equal(got[1], ref[1])  # top ids
    torch.testing.assert_close(got[2], ref[2], rtol=1e-4, atol=1e-4)  # their log-probabilities
    torch.testing.assert_close(fast.features(ids), ref[0], rtol=1e-4, atol=1e-4)
    prompt = ids[0].tolist()
    for a, b in zip(fast.prompt_logprobs(prompt, 3), reference.prompt_logprobs(prompt, 3)):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    plain = TargetAdapter(copy.deepcopy(model))  # no feature layers: an empty feature tensor
    assert plain.features(ids).shape == (3, 17, 0)


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_rotary_variants_follow_the_models_own_rotary_module(rope):
    overrides = {}
    if rope == "llama3":
        overrides["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    model = tiny_target("llama", **overrides)
    reference = TargetAdapter(copy.deepcopy(model), fast=False)
    fast = TargetAdapter(model)
    ids = torch.tensor([list(range(4, 90))])
    ref, _ = reference.forward(ids, 0, reference.new_cache(), logits_rows=86)
    got, _ = fast.forward(ids, 0, fast.new_cache(), logits_rows=86)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rope", ["default", "llama3", "dynamic"])
def test_steps_rotary_rows_are_the_models_own_at_every_position(rope):
    """Steps of 1 and 2 rows past 256 positions (where the kept tables grow): logits equal transformers' forward in
    fp32; fixed rotaries read the kept tables, a dynamic one (rescaled with the length) computes its rows per call."""
    params = {
        "llama3": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    }.get(rope)
    model = tiny_target("llama", **({"rope_parameters": params} if params else {}))
    reference, fast = TargetAdapter(copy.deepcopy(model), fast=False), TargetAdapter(model)
    assert fast.fast_forward.static_rope == (rope != "dynamic")
    ids = torch.randint(3, VOCAB, (1, 262), generator=torch.Generator().manual_seed(5))
    caches = [reference.new_cache(), fast.new_cache(capacity=300)]
    for adapter, cache in zip((reference, fast), caches):
        adapter.forward(ids[:, :250], 0, cache, logits_rows=1)
    pos = 250
    for rows in (1, 2, 1, 2, 1, 2, 1, 2):  # steps of 1 and 2 rows across position 256
        ref, _ = reference.forward(ids[:, pos : pos + rows], pos, caches[0], logits_rows=rows)
        got, _ = fast.forward(ids[:, pos : pos + rows], pos, caches[1], logits_rows=rows)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        pos += rows
    if fast.fast_forward.static_rope:
        assert fast.fast_forward._rope[0].shape[0] >= 512  # grown past its first 256 positions


def test_fast_packed_and_eager_paths_decode_the_same_tokens_in_fp32(any_arch):
    paths = engines(any_arch)
    for prompt in PROMPTS:
        plain = run(*paths["eager"][:1], None, prompt)
        sampling = SamplingParams(temperature=1.0)
        for name, (target, drafter) in paths.items():
            assert run(target, None, prompt) == plain, name
            assert run(target, drafter, prompt) == plain, name
        sampled = [run(t, d, prompt, sampling=sampling, seed=7) for t, d in paths.values()]
        assert sampled[0] == sampled[1] == sampled[2]


def test_paths_agree_when_the_block_size_changes_mid_generation():
    """The adaptive policy changes the block size from step to step; every path gives the plain output."""
    paths = engines("llama", block_size=8)
    for prompt in PROMPTS:
        plain = run(paths["eager"][0], None, prompt, max_new_tokens=40)
        for name, (target, drafter) in paths.items():
            policy = AdaptiveBlockSize(8, explore_every=3)
            sizes: list[int] = []
            choose = policy.choose
            policy.choose = lambda choose=choose, sizes=sizes: sizes.append(choose()) or sizes[-1]
            assert run(target, drafter, prompt, policy=policy, max_new_tokens=40) == plain, name
            assert len(set(sizes)) >= 3, sizes  # the size really changed


def test_bf16_speculative_parts_from_plain_only_at_ties(arch):
    from tests.decoding.test_loop import assert_bf16_parts_only_at_ties

    model = tiny_target(arch, dtype=torch.bfloat16)
    drafter = tiny_drafter(model, block_size=8)
    assert TargetAdapter(model).fast_forward is not None
    assert_bf16_parts_only_at_ties(model, drafter, [p for p in PROMPTS])


def test_static_cache_after_every_accepted_length_equals_a_fresh_prefill(any_arch):
    """After each step (every accepted length 0..B-1 occurs), the static cache's valid rows equal a fresh
    prefill of the verified text, and its length is the verified length."""
    from tests.decoding.test_loop import OracleDrafter

    model = tiny_target(any_arch)
    base = tiny_drafter(model, block_size=6)
    target = TargetAdapter(model, base.config.target_layer_ids)
    caches: list[StaticKVCache] = []
    new_cache = target.new_cache
    target.new_cache = lambda capacity=None: caches.append(new_cache(capacity)) or caches[-1]
    prompt = [7, 3, 9, 12, 5]
    plain = run(TargetAdapter(copy.deepcopy(model), fast=False), None, prompt, max_new_tokens=40)
    oracle = OracleDrafter(base.config, {})
    oracle.load_state_dict(base.state_dict())
    oracle.current = full = prompt + plain
    emitted: list[int] = []
    checked = 0

    def observer(_logits, tokens):
        nonlocal checked
        emitted.extend(tokens)
        verified = len(prompt) + len(emitted) - 1  # the last emitted token is not yet in the target
        cache = caches[-1]
        assert cache.length == verified
        fresh = new_cache()
        target.forward(torch.tensor([full[:verified]]), 0, fresh, logits_rows=1)
        for (k, v), (k_exp, v_exp) in zip(target.cached_key_values(cache), target.cached_key_values(fresh)):
            torch.testing.assert_close(k, k_exp, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, v_exp, rtol=1e-4, atol=1e-4)
        checked += 1

    stats = DecodeStats(6)
    out = [
        t for s in decode(target, oracle, prompt, DecodeOptions(max_new_tokens=40), stats, observer) for t in s.tokens
    ]
    assert out == plain
    assert set(stats.accepted_lengths) == set(range(6)), stats.accepted_lengths
    assert checked == stats.steps + 1


def test_the_cache_must_hold_exactly_the_positions_before_the_tokens():
    target = TargetAdapter(tiny_target("llama"))
    cache = target.new_cache()
    target.forward(torch.tensor([[5, 6, 7]]), 0, cache, logits_rows=1)
    with pytest.raises(InvalidInputError, match="holds 3 positions"):
        target.forward(torch.tensor([[8]]), 5, cache, logits_rows=1)
    target.crop(cache, 1)
    assert cache.length == 1
    logits, _ = target.forward(torch.tensor([[6]]), 1, cache, logits_rows=1)
    assert logits.shape == (1, VOCAB)


def test_a_static_cache_needs_the_fast_forward():
    fast, eager = TargetAdapter(tiny_target("llama")), TargetAdapter(tiny_target("llama"), fast=False)
    with pytest.raises(InvalidInputError, match="fast forward"):
        eager.forward(torch.tensor([[5]]), 0, fast.new_cache(), logits_rows=1)


def test_fast_drafter_forward_equals_the_modules_in_fp32(any_arch):
    model = tiny_target(any_arch)
    drafter = tiny_drafter(model, block_size=8)
    feats = torch.randn(1, 11, drafter.config.num_features * model.config.hidden_size)
    with torch.inference_mode():
        ref_ctx = drafter.context_key_values(feats, torch.arange(11))
        drafter.use_fast_path(True)
        fast = drafter._fast_forward()
        got_ctx = fast.context_key_values(feats, torch.arange(11))
        for (k, v), (k_ref, v_ref) in zip(got_ctx, ref_ctx):
            torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)
        block = torch.randn(1, 8, model.config.hidden_size)
        torch.testing.assert_close(
            fast(block, torch.arange(11, 19), got_ctx),
            drafter(block, torch.arange(11, 19), ref_ctx),
            rtol=1e-5,
            atol=1e-5,
        )


def test_fast_drafter_forward_follows_changed_weights():
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=4)
    drafter.use_fast_path(True)
    first = drafter._fast_forward()
    assert drafter._fast_forward() is first
    with torch.no_grad():
        drafter.fc.weight.mul_(0.5)
    assert drafter._fast_forward() is not first


def test_engine_is_reported_in_the_stats():
    target = TargetAdapter(tiny_target("llama"))
    stats = DecodeStats(1)
    run(target, None, [5, 6], stats)
    assert stats.engine == target.engine and "fast forward" in stats.engine
    assert stats.as_dict()["engine"] == stats.engine


def test_a_drafter_on_the_fast_path_can_be_copied():
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=4)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    drafter.use_fast_path(True)
    out = run(target, drafter, [5, 6, 7])
    twin = copy.deepcopy(drafter)
    assert twin.fast and run(target, twin, [5, 6, 7]) == out


def test_int8_targets_run_on_the_fast_forward(arch):
    """A weight-only int8 target: the fast forward keeps the int8 products and gives transformers' int8 logits."""
    from dflashkit.kernels.quantize import quantize_model

    model = quantize_model(tiny_target(arch), "int8")
    reference = TargetAdapter(copy.deepcopy(model), [1, 4], fast=False)
    fast = TargetAdapter(model, [1, 4])
    assert fast.fast_forward is not None and fast.weights.startswith("int8")
    ids = torch.tensor([list(range(4, 30))])
    ref, ref_feats = reference.forward(ids, 0, reference.new_cache(), logits_rows=26)
    got, got_feats = fast.forward(ids, 0, fast.new_cache(), logits_rows=26)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_feats, ref_feats, rtol=1e-4, atol=1e-4)
    drafter = tiny_drafter(model, block_size=4)
    drafter.use_fast_path(True)
    fast.set_feature_layers(drafter.config.target_layer_ids)
    for prompt in PROMPTS[:2]:
        assert run(fast, drafter, prompt) == run(reference, None, prompt)


def test_rms_norm_kernel_equals_the_spelled_out_formula():
    from dflashkit.kernels.ops import RMSNorm

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for width, scale in ((64, 5.0), (576, 1.0), (576, 300.0)):
            weight = torch.randn(width, generator=g).to(dtype)
            x = torch.randn(3, 7, width, generator=g) * scale
            x[..., 3] *= 40  # a massive activation, as in real residual streams
            x = x.to(dtype)
            xf = x.float()
            expected = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
            got = RMSNorm(weight, 1e-6)(x)
            assert got.dtype == dtype and got.shape == x.shape
            torch.testing.assert_close(
                got, expected, rtol=0 if dtype == torch.bfloat16 else 1e-5, atol=0 if dtype == torch.bfloat16 else 1e-5
            )


def test_rotate_equals_rotate_half_bitwise():
    from dflashkit.kernels.ops import rotate, signed_sin

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1, 5, 7, 16, generator=g).to(dtype)
        angle = torch.randn(1, 1, 7, 16, generator=g)
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        expected = x * cos + torch.cat((-x[..., 8:], x[..., :8]), dim=-1) * sin
        assert torch.equal(rotate(x, cos, signed_sin(sin)), expected)


def test_attention_results_in_a_gpus_memory_layout_decode_the_same_tokens(monkeypatch):
    """A GPU's attention kernels return [batch, seq, heads, dim] storage behind the [batch, heads, seq, dim] shape
    (CPU kernels: contiguous). Every path reshapes the result rather than viewing it (a view fails on that
    layout; seen on an H200): with such results, each path decodes the same tokens as before."""
    paths = engines("qwen3")
    want = {name: [run(t, d, p) for p in PROMPTS] for name, (t, d) in paths.items()}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def gpu_layout(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides as a GPU kernel's

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", gpu_layout)
    got = {name: [run(t, d, p) for p in PROMPTS] for name, (t, d) in paths.items()}
    assert got == want


def test_keep_rows_moves_the_kept_rows_to_the_next_positions():
    """After a tree's pass from `start`, the kept rows (increasing, the anchor's 0 first) become positions start,
    start+1, ...: as a gather of those rows would leave them, rows before start untouched; non-increasing rows
    refused."""
    for rows in ([0], [0, 1, 2], [0, 2], [0, 1, 5], [0, 3, 6, 8, 9], [0, 1, 2, 3, 7]):
        cache = StaticKVCache(3, 2, 4, 32, torch.float32, torch.device("cpu"))
        cache.keys.copy_(torch.randn(cache.keys.shape))
        cache.values.copy_(torch.randn(cache.values.shape))
        start, cache.length = 7, 7 + 10
        before_k, before_v = cache.keys.clone(), cache.values.clone()
        cache.keep_rows(start, rows)
        index = torch.tensor(rows) + start
        assert cache.length == start + len(rows)
        assert torch.equal(cache.keys[:, :, start : start + len(rows)], before_k[:, :, index])
        assert torch.equal(cache.values[:, :, start : start + len(rows)], before_v[:, :, index])
        assert torch.equal(cache.keys[:, :, :start], before_k[:, :, :start])
    with pytest.raises(InvalidInputError, match="increasing"):
        cache.keep_rows(start, [0, 2, 2])
