"""Prepacked oneDNN linear layers (the CPU fast path): same products, same parameters, same decoded tokens."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_drafter, tiny_target
from dflashkit.adaptive import AdaptiveBlockSize
from dflashkit.decode import DecodeOptions, decode
from dflashkit.linear import PackedLinear, has_packed_linears, pack_linears, packing_supported, unpack_linears
from dflashkit.sampling import SamplingParams
from dflashkit.target import TargetAdapter

needs_bf16 = pytest.mark.skipif(not packing_supported("cpu", torch.bfloat16), reason="no oneDNN bf16 on this CPU")
needs_fp32 = pytest.mark.skipif(not packing_supported("cpu", torch.float32), reason="no oneDNN on this CPU")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_product_is_bitwise_the_eager_one(rows, bias):
    g = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, rows, 96, generator=g).to(torch.bfloat16)  # [batch, rows, in]
    with torch.inference_mode():
        expected = F.linear(x, linear.weight, linear.bias)
        got = PackedLinear.from_linear(linear)(x)
    assert got.shape == (1, rows, 160) and got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


@needs_bf16
def test_bf16_rows_do_not_depend_on_each_other():
    """A 16-row verify pass and 16 one-row steps compute the same linear outputs."""
    layer = PackedLinear(torch.randn(200, 64).to(torch.bfloat16))
    x = torch.randn(16, 64).to(torch.bfloat16)
    with torch.inference_mode():
        together = layer(x)
        one_by_one = torch.cat([layer(x[i : i + 1]) for i in range(16)])
    assert torch.equal(together, one_by_one)


@needs_fp32
def test_fp32_product_matches_to_rounding():
    linear = nn.Linear(64, 48)
    x = torch.randn(3, 7, 64)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear.from_linear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


@needs_fp32
def test_a_weight_changed_after_packing_is_packed_again():
    linear = nn.Linear(32, 16, bias=False)
    packed = PackedLinear.from_linear(linear)
    x = torch.randn(2, 32)
    with torch.inference_mode():
        packed(x)
    with torch.no_grad():
        linear.weight.mul_(-2.0)  # the shared parameter, in place
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), x @ linear.weight.T)


@needs_fp32
def test_gradients_flow_through_a_packed_layer():
    """Training through packed modules (e.g. a drafter packed for evaluation) still backpropagates."""
    linear = nn.Linear(8, 4)
    packed = PackedLinear.from_linear(linear)
    x = torch.randn(3, 8, requires_grad=True)
    packed(x).square().sum().backward()
    assert linear.weight.grad is not None and x.grad is not None
    expected = torch.autograd.grad(F.linear(x, linear.weight, linear.bias).square().sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)


@needs_fp32
def test_pack_keeps_parameters_state_dict_and_ties(arch):
    model = tiny_target(arch, tie_word_embeddings=True)
    keys = list(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model) == linears and has_packed_linears(model)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert list(model.state_dict()) == keys
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    assert pack_linears(model) == 0  # already packed
    assert unpack_linears(model) == linears and not has_packed_linears(model)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    first = model.model.layers[0].self_attn.q_proj
    pack_linears(model)
    again = model.model.layers[0].self_attn.q_proj
    assert isinstance(again, PackedLinear) and again.original is first  # the packing is reused, not redone


def test_nothing_is_packed_where_it_cannot_run():
    model = tiny_target("llama", dtype=torch.float16)
    assert pack_linears(model) == 0 and not has_packed_linears(model)


def _decode(target, drafter, prompt, **kw):
    policy = kw.pop("policy", None)
    options = DecodeOptions(**{"max_new_tokens": 24, **kw})
    return [t for s in decode(target, drafter, prompt, options, block_policy=policy) for t in s.tokens]


def _fast_and_eager(arch, dtype=torch.float32, block_size=8):
    """The same tiny target + drafter twice: on packed linears (fast path) and on eager nn.Linear layers."""
    model = tiny_target(arch, dtype=dtype)
    drafter = tiny_drafter(model, block_size=block_size).to(dtype)
    eager_model, eager_drafter = copy.deepcopy(model), copy.deepcopy(drafter)
    fast = TargetAdapter(model, drafter.config.target_layer_ids)
    pack_linears(drafter)
    eager = TargetAdapter(eager_model, drafter.config.target_layer_ids, packed_weights=False)
    assert fast.packed_weights and not eager.packed_weights and not has_packed_linears(eager_drafter)
    return (fast, drafter), (eager, eager_drafter)


PROMPTS = [[5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6], [42], list(range(10, 40))]


@needs_fp32
def test_fast_and_eager_paths_decode_the_same_tokens_in_fp32(arch):
    (fast, fast_drafter), (eager, eager_drafter) = _fast_and_eager(arch)
    for prompt in PROMPTS:
        plain = _decode(eager, None, prompt)
        assert _decode(fast, None, prompt) == plain
        assert _decode(fast, fast_drafter, prompt) == _decode(eager, eager_drafter, prompt) == plain
        sampling = SamplingParams(temperature=1.0)
        assert (_decode(fast, fast_drafter, prompt, sampling=sampling, seed=7)
                == _decode(eager, eager_drafter, prompt, sampling=sampling, seed=7))  # fmt: skip


@needs_fp32
def test_fast_and_eager_paths_agree_when_the_block_size_changes_mid_generation():
    """The adaptive policy changes the block size from step to step: both paths follow the same sizes."""
    (fast, fast_drafter), (eager, eager_drafter) = _fast_and_eager("llama", block_size=8)
    for prompt in PROMPTS:
        runs = []
        for target, drafter in ((fast, fast_drafter), (eager, eager_drafter)):
            policy = AdaptiveBlockSize(8, explore_every=3)
            sizes: list[int] = []
            choose = policy.choose
            policy.choose = lambda: sizes.append(choose()) or sizes[-1]
            runs.append((_decode(target, drafter, prompt, max_new_tokens=40, policy=policy), sizes))
        (fast_out, fast_sizes), (eager_out, _) = runs
        assert fast_out == eager_out == _decode(eager, None, prompt, max_new_tokens=40)
        assert len(set(fast_sizes)) >= 3, fast_sizes  # the size really changed


@needs_bf16
def test_bf16_fast_path_gives_the_eager_logits_bitwise(arch):
    """In bf16 packing changes nothing in the numbers: a verify pass gives the eager path's logits exactly."""
    (fast, _), (eager, _) = _fast_and_eager(arch, dtype=torch.bfloat16)
    ids = torch.tensor([PROMPTS[3]])
    got, got_feats = fast.forward(ids, 0, fast.new_cache(), logits_rows=ids.shape[1])
    expected, exp_feats = eager.forward(ids, 0, eager.new_cache(), logits_rows=ids.shape[1])
    assert torch.equal(got, expected) and torch.equal(got_feats, exp_feats)


@needs_fp32
def test_use_packed_weights_switches_both_ways():
    model = tiny_target("llama")
    target = TargetAdapter(model)
    assert target.packed_weights
    target.use_packed_weights(False)
    assert not target.packed_weights and type(target.lm_head) is nn.Linear
    target.use_packed_weights(True)
    assert target.packed_weights and isinstance(target.lm_head, PackedLinear)


@needs_fp32
def test_a_packed_model_can_be_copied_and_converted():
    model = tiny_target("llama")
    TargetAdapter(model)
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        expected = model(ids).logits
        twin = copy.deepcopy(model)
        torch.testing.assert_close(twin(ids).logits, expected)
        if packing_supported("cpu", torch.bfloat16):
            torch.testing.assert_close(twin.to(torch.bfloat16)(ids).logits.float(), expected, rtol=0.1, atol=0.1)
