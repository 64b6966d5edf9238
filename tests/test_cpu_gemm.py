"""The AVX512-BF16 kernel for products of a few rows: right products, rows independent, used where it should be."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflashkit import cpu_gemm
from dflashkit.kernels import Matmul
from dflashkit.linear import PackedLinear

needs_kernel = pytest.mark.skipif(cpu_gemm.kernel() is None, reason="the kernel does not run here (no AVX512-BF16, "
                                  "AMX, DFLASHKIT_CPU_GEMM=onednn or no compiler)")


def bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def close_to_fp32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """got = x @ w.T + b in fp32, rounded once to bf16 (the sum order differs: allow a bf16 ulp or two)."""
    ref = x.float() @ w.float().T + (b.float() if b is not None else 0)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert ((got.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-3).all()


@needs_kernel
@pytest.mark.parametrize("n,k", [(200, 96), (64, 64), (1, 8), (130, 34), (1000, 576)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 16])
def test_product_matches_fp32_with_bias_and_ragged_columns(n, k, rows):
    w, b, x = bf16(n, k, seed=n), bf16(n, seed=k), bf16(rows, k, seed=rows)
    with torch.inference_mode():
        got = cpu_gemm.linear(x, cpu_gemm.pack(w), n, b.float())
        plain = cpu_gemm.linear(x, cpu_gemm.pack(w), n)
    close_to_fp32(got, x, w, b)
    close_to_fp32(plain, x, w, None)


@needs_kernel
def test_each_row_is_bitwise_the_same_whatever_rows_run_with_it():
    """A verify pass of 16 rows and 16 one-row steps compute the same products, bit for bit."""
    w, x = bf16(300, 128, seed=1), bf16(16, 128, seed=2)
    packed = cpu_gemm.pack(w)
    with torch.inference_mode():
        together = cpu_gemm.linear(x, packed, 300)
        for rows in (1, 3, 7, 16):
            for start in range(0, 16 - rows + 1, rows):
                assert torch.equal(cpu_gemm.linear(x[start:start + rows], packed, 300), together[start:start + rows])


@needs_kernel
def test_leading_dims_and_non_contiguous_input():
    w = bf16(70, 32, seed=3)
    x = bf16(1, 5, 64, seed=4)[..., ::2]  # [1, 5, 32], strided
    with torch.inference_mode():
        got = cpu_gemm.linear(x, cpu_gemm.pack(w), 70)
    assert got.shape == (1, 5, 70)
    close_to_fp32(got[0], x[0], w, None)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 16, 17, 40])
def test_matmul_and_packed_linear_use_the_kernel_up_to_max_rows(rows):
    w, b, x = bf16(96, 64, seed=5), bf16(96, seed=6), bf16(rows, 64, seed=7)
    with torch.inference_mode():
        kernel = cpu_gemm.linear(x, cpu_gemm.pack(w), 96, b.float())
        onednn = F.linear(x, w, b)
        for layer in (Matmul(w, b), PackedLinear(w.clone(), b.clone())):
            got = layer(x)
            close_to_fp32(got, x, w, b)
            if rows <= cpu_gemm.MAX_ROWS:
                assert torch.equal(got, kernel)
            else:
                assert torch.equal(got, onednn)


@needs_kernel
def test_packed_linear_repacks_after_the_weight_changes():
    layer = PackedLinear(bf16(32, 16, seed=8))
    x = bf16(2, 16, seed=9)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)
        after = layer(x)
    close_to_fp32(after, x, layer.weight, None)
    assert not torch.equal(before, after)


def test_the_setting_turns_the_kernel_off_and_refuses_unknown_values(monkeypatch):
    monkeypatch.setenv("DFLASHKIT_CPU_GEMM", "onednn")
    assert cpu_gemm.kernel() is None
    assert not cpu_gemm.usable(bf16(4, 4, seed=0))
    w, x = bf16(24, 40, seed=10), bf16(3, 40, seed=11)
    with torch.inference_mode():
        assert torch.equal(Matmul(w)(x), F.linear(x, w))  # oneDNN, bitwise
    monkeypatch.setenv("DFLASHKIT_CPU_GEMM", "fastest")
    with pytest.raises(ValueError, match="DFLASHKIT_CPU_GEMM"):
        cpu_gemm.kernel()


def test_weights_the_kernel_cannot_take_stay_with_onednn():
    assert not cpu_gemm.usable(bf16(8, 7, seed=0))  # odd inner size
    assert not cpu_gemm.usable(torch.randn(8, 8))  # fp32
