"""Prepacked oneDNN linear layers (the CPU fast path): same products, same parameters, same decoded tokens."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.kernels.linear import PackedLinear, has_packed_linears, pack_linears, packing_supported, unpack_linears
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import tiny_target

needs_bf16 = pytest.mark.skipif(not packing_supported("cpu", torch.bfloat16), reason="no oneDNN bf16 on this CPU")
needs_fp32 = pytest.mark.skipif(not packing_supported("cpu", torch.float32), reason="no oneDNN on this CPU")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_product_is_bitwise_the_eager_one(rows, bias, monkeypatch):
    monkeypatch.setenv("DFLASHKIT_CPU_GEMM", "onednn")  # the AVX512-BF16 kernel: tests/test_row_kernels.py
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


@needs_fp32
def test_use_packed_linears_switches_transformers_forward_both_ways():
    model = tiny_target("llama")
    target = TargetAdapter(model, fast=False)
    assert target.engine == "transformers forward (eager)" and not target.fast
    target.use_packed_linears(True)
    assert target.engine == "transformers forward, prepacked linear layers" and isinstance(target.lm_head, PackedLinear)
    target.use_packed_linears(False)
    assert not has_packed_linears(model) and type(target.lm_head) is nn.Linear


@needs_fp32
def test_a_packed_model_can_be_copied_and_converted():
    model = tiny_target("llama")
    pack_linears(model)
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        expected = model(ids).logits
        twin = copy.deepcopy(model)
        torch.testing.assert_close(twin(ids).logits, expected)
        if packing_supported("cpu", torch.bfloat16):
            torch.testing.assert_close(twin.to(torch.bfloat16)(ids).logits.float(), expected, rtol=0.1, atol=0.1)
