"""Weight-only 4-bit targets: the code's maths, the kernel against its torch reference, one function at every batch
size, losslessness with respect to the quantized target, and the opt-in surfaces."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.sampling import SamplingParams
from dflashkit.decoding.stats import DecodeStats
from dflashkit.errors import InvalidInputError
from dflashkit.kernels import row_kernels
from dflashkit.kernels.int4 import INT4_WEIGHTS, Int4Linear, Int4Matmul, quantize_rows, quantize_weight, reference
from dflashkit.kernels.ops import Matmul
from dflashkit.kernels.quantize import check_method, is_quantized, quantize_model
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_drafter, tiny_target
from tests.decoding.test_loop import assert_bf16_parts_only_at_ties, assert_oracle_and_drafter_match_plain, prompts, run

needs_kernel = pytest.mark.skipif(
    row_kernels.kernel() is None or not getattr(row_kernels.kernel(), "int4", False),
    reason="no row kernel with the 4-bit product on this CPU",
)


def int4_target(arch: str = "llama", dtype: torch.dtype = torch.float32, **kw):
    return quantize_model(tiny_target(arch, dtype=dtype, **kw), "int4")


# ---- the code -------------------------------------------------------------------------------------------


def test_weight_codes_span_each_block_and_round_against_the_stored_scales():
    torch.manual_seed(0)
    w = torch.randn(40, 96)
    codes, scale, low = quantize_weight(w)
    assert codes.dtype == torch.uint8 and scale.dtype == low.dtype == torch.float16
    assert codes.shape == (40, 96) and scale.shape == low.shape == (40, 3)
    blocks = codes.view(40, 3, 32)
    assert int(blocks.amin(-1).max()) == 0 and int(blocks.amax(-1).min()) == 15  # each block's extremes: 0 and 15
    deq = Int4Linear(codes, scale, low).dequantized().view(40, 3, 32)
    # at most half a step per weight, plus the fp16 rounding of the block's low
    err = (deq - w.view(40, 3, 32)).abs()
    assert (err <= scale.float()[..., None] / 2 + 1e-3 * w.abs().max()).all()


def test_activation_codes_are_int8_per_block():
    x = torch.tensor([[1.0] * 31 + [-127.0] + [0.0] * 32])
    codes, s = quantize_rows(x)
    assert s.tolist() == [[1.0, 0.0]]  # max |x| / 127 per block; an all-zero block has scale 0 and codes 0
    assert codes[0, 0].tolist() == [1.0] * 31 + [-127.0] and codes[0, 1].abs().sum() == 0


def test_constant_and_zero_blocks_are_exact():
    w = torch.cat((torch.full((4, 32), 0.5), torch.zeros(4, 32)), dim=1)
    layer = Int4Linear(*quantize_weight(w))
    assert torch.equal(layer.dequantized(), w)


def test_input_sizes_that_are_not_multiples_of_32_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_weight(torch.randn(4, 48))
    with pytest.raises(InvalidInputError, match="multiples of 32"):
        quantize_model(tiny_target("llama", hidden_size=48, intermediate_size=96), "int4")


def test_reference_is_close_to_the_float_product():
    torch.manual_seed(1)
    w, x = torch.randn(64, 256), torch.randn(5, 256)
    codes, scale, low = quantize_weight(w)
    y = reference(x, codes, scale, low)
    exact = x @ w.T
    # 4-bit weights and int8 activations: a few percent of the output's scale, never more
    assert (y - exact).abs().max() < 0.15 * exact.abs().max()
    dequantized = x @ Int4Linear(codes, scale, low).dequantized().T
    torch.testing.assert_close(y, dequantized, atol=0.05 * exact.abs().max(), rtol=0)


# ---- the kernel ------------------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("shape", [(40, 64), (300, 96), (1536, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_reference(shape, bias):
    """The kernel's sums are the reference's up to fp32 rounding (they add the same terms in another order)."""
    torch.manual_seed(2)
    n, k = shape
    codes, scale, low = quantize_weight(torch.randn(n, k))
    b = torch.randn(n).bfloat16() if bias else None
    product = Int4Matmul(codes, scale, low, b)
    assert product.small is not None and product.small.dtype == torch.uint8
    for m in (1, 3, 7, 16, 33):
        x = torch.randn(m, k).bfloat16()
        y, r = product(x).float(), reference(x, codes, scale, low, b).float()
        assert y.shape == (m, n)
        # one bf16 step, or fp32 rounding where the terms cancel to near zero
        torch.testing.assert_close(y, r, atol=1e-4 * float(r.abs().max()), rtol=2**-7)


@needs_kernel
def test_one_function_at_every_batch_size():
    """Rows of 1..16-row calls are bitwise the same rows of one 16-row call."""
    torch.manual_seed(3)
    layer = Int4Linear.from_linear(nn.Linear(576, 1536, bias=False).bfloat16())
    x = torch.randn(16, 576).bfloat16()
    full = layer(x)
    for m in range(1, 17):
        assert torch.equal(layer(x[:m]), full[:m]), m
        assert torch.equal(layer(x[m - 1 : m]), full[m - 1 : m]), m


@needs_kernel
def test_fused_layers_equal_the_layers_one_by_one():
    torch.manual_seed(4)
    layers = [Int4Linear.from_linear(nn.Linear(64, n, bias=True).bfloat16()) for n in (64, 32, 32)]
    fused = Matmul.fused(layers)
    assert isinstance(fused, Int4Matmul)
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(fused(x), torch.cat([layer(x) for layer in layers], dim=-1))


def test_rows_is_a_layer_of_those_output_channels():
    torch.manual_seed(5)
    layer = Int4Linear.from_linear(nn.Linear(32, 50))
    ids = torch.tensor([0, 7, 49, 3])
    x = torch.randn(4, 32)
    torch.testing.assert_close(layer.rows(ids)(x), layer(x)[:, ids])


# ---- the model ------------------------------------------------------------------------------------------


def test_quantize_model_replaces_every_linear_and_declares_it(arch):
    model = int4_target(arch)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int4Linear) and model.config.tie_word_embeddings is False
    assert TargetAdapter(model).weights == INT4_WEIGHTS + ", LM head included"
    assert is_quantized(TargetAdapter(model).weights) and not is_quantized("bfloat16")
    assert check_method("int4") == "int4"
    with pytest.raises(InvalidInputError, match="CPUs only"):
        quantize_model(tiny_target("llama").to("meta"), "int4")


# (close to, but not, the float target: tests/kernels/test_int8.py, for both methods)


# ---- losslessness with respect to the quantized target -----------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_speculative_equals_plain_on_the_int4_target(arch, block_size):
    """fp32 activations (the torch reference): token for token, with a random drafter and an oracle that exercises
    every accepted length."""
    model = int4_target(arch)
    drafter = tiny_drafter(model, block_size=block_size)
    oracle_stats = assert_oracle_and_drafter_match_plain(model, drafter, block_size, prompts(8, seed=21))
    assert sum(oracle_stats.accepted_lengths) > 0 and oracle_stats.acceptance_histogram[-1] > 0


def test_bf16_int4_target_parts_from_plain_decoding_only_at_ties(arch):
    """bf16 activations (the kernel where it runs)."""
    model = int4_target(arch, dtype=torch.bfloat16)
    assert_bf16_parts_only_at_ties(model, tiny_drafter(model, block_size=8), prompts(6, seed=3))


@needs_kernel
def test_bf16_int4_target_with_the_kernel_has_no_ties_to_report():
    """On the kernel every row is computed on its own: a verify pass gives the one-token steps' logits bitwise, so
    greedy speculative output is the plain output token for token (the fast forward, up to 16 rows)."""
    model = int4_target("qwen2", dtype=torch.bfloat16)
    drafter = tiny_drafter(model, block_size=8)
    target, plain = TargetAdapter(model, drafter.config.target_layer_ids), TargetAdapter(model)
    for prompt in prompts(6, seed=13):
        assert run(target, drafter, prompt) == run(plain, None, prompt)


def test_seeded_sampling_is_reproducible_on_the_int4_target():
    model = int4_target("llama")
    drafter = tiny_drafter(model, block_size=4)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    params = SamplingParams(1.0, top_p=0.95)

    def sample(seed: int) -> list[int]:
        options = DecodeOptions(max_new_tokens=12, sampling=params, seed=seed, proposal="sample")
        return [t for s in decode(target, drafter, [5, 6, 7], options, DecodeStats(1)) for t in s.tokens]

    runs = {seed: sample(seed) for seed in range(4)}
    assert all(sample(seed) == tokens and len(tokens) == 12 for seed, tokens in runs.items())
    assert len({tuple(t) for t in runs.values()}) > 1


def test_draft_vocabulary_reads_the_int4_head():
    from dflashkit.drafter.network import DFlashDrafter

    model = int4_target("llama")
    vocab = list(range(0, VOCAB, 3))
    base = tiny_drafter(model, block_size=4)
    drafter = DFlashDrafter(base.config.replace(draft_vocab=vocab))
    drafter.load_state_dict(base.state_dict())
    head = model.get_output_embeddings()
    with torch.inference_mode():
        hidden = torch.randn(5, model.config.hidden_size)
        torch.testing.assert_close(drafter.logits(hidden, head)[:, vocab], head(hidden)[:, vocab])
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    for prompt in prompts(3, seed=5):
        assert run(target, drafter, prompt) == run(TargetAdapter(model), None, prompt)


@pytest.mark.skipif(
    not (row_kernels.ISAS["avx2"].supported() and row_kernels.ISAS["avx512"].supported()),
    reason="needs a CPU with both the AVX2 and the AVX512-BF16 kernels",
)
def test_the_avx2_and_avx512_kernels_agree_bitwise():
    """Unlike their bf16 products, the two 4-bit products compute the same integers and the same fp32 operations in
    the same order: a 4-bit target decodes the same tokens on an AVX2 laptop and on an AVX512 server."""
    avx2, avx512 = row_kernels._load("avx2"), row_kernels._load("avx512")
    if avx2 is None or avx512 is None:
        pytest.skip("a kernel could not be built here")
    torch.manual_seed(6)
    codes, scale, low = quantize_weight(torch.randn(300, 1536))
    packed, bias = row_kernels.pack_int4(codes, scale, low), torch.randn(300)
    for m in (1, 5, 16):
        x = torch.randn(m, 1536).bfloat16()
        assert torch.equal(avx2.linear(x, packed, 300, bias), avx512.linear(x, packed, 300, bias))
