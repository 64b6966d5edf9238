"""Opt-in weight-only 4-bit targets: what closes the gap to llama.cpp's 4-bit GGUFs on a CPU.

A one-token step of a 1.5B target reads every weight once: 3.1 GB in bf16, 1.6 GB in int8, about 1 GB at 4-5 bits
per weight, and on a 2-core CPU that read is most of the step. ``quantize_model(model, "int4")``
(:mod:`dflashkit.kernels.int8`) replaces the decoder's Linear layers and the LM head by :class:`Int4Linear`:

* **Weights**: per output column and block of 32 inputs, ``w ~ scale * code + low`` with ``code`` in 0..15 and
  ``scale``, ``low`` in fp16 (an asymmetric code, as llama.cpp's Q4_1: 5 bits per weight with the scales). The code
  is rounded against the stored fp16 scale and low.
* **Activations**: each row of a product's input is quantized per block of 32 to int8 on the way in
  (``s = max|x| / 127``, ``round(x / s)``), as llama.cpp does for its 4-bit products, so that the products are
  integer dot products (AVX512-VNNI ``vpdpbusd``, or AVX2 ``vpmaddubsw``) at twice the multiply rate of bf16 ones:
  a verify pass of several rows costs much less than in int8 or bf16, where the products are compute-bound beyond
  a row or two on a 2-core CPU.

The quantized target is one deterministic function (``csrc/row_int4.h``): every row is quantized and summed on its
own, in the same order, whatever rows run beside it, so speculative output is bitwise the plain output of the 4-bit
target. It is a different model from the bf16 one (as llama.cpp's Q4 GGUF is); stats, the server and benchmarks
declare it (``target_weights``). Where no row kernel runs (``DFLASHKIT_CPU_GEMM=onednn``, non-x86 CPUs), the same
math runs in torch (:func:`reference`): exact integers, the fp32 terms summed in another order, so it agrees with the
kernel to fp32 rounding, and it is slow (it exists for correctness, not speed).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflashkit.kernels import row_kernels
from dflashkit.kernels.row_kernels import RowKernelProduct, cached_product

BLOCK = 32  # inputs per scale
LEVELS = 15  # codes 0..15
XMAX = 127  # activation codes -127..127
INT4_WEIGHTS = "int4 weight-only (blocks of 32, int8 activations)"


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 4-bit per block of 32 inputs: (codes [out, in] uint8 in 0..15, scale and low [out, in/32] fp16)
    with ``weight ~ scale * code + low``. Scale and low are rounded to fp16 first and the codes rounded against
    them. ``in`` must be a multiple of 32."""
    out, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"4-bit weights need the input size to be a multiple of {BLOCK}, got {k}")
    w = weight.detach().float().view(out, k // BLOCK, BLOCK)
    lo, hi = w.amin(-1), w.amax(-1)
    low = lo.to(torch.float16)
    scale = ((hi - low.float()) / LEVELS).to(torch.float16)
    s = scale.float()
    codes = torch.where(s[..., None] > 0, torch.round((w - low.float()[..., None]) / s[..., None]), 0)
    codes = codes.clamp_(0, LEVELS).to(torch.uint8).view(out, k)
    return codes.contiguous(), scale.contiguous(), low.contiguous()


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """A product's input rows [M, K] as the kernel quantizes them: codes [M, K/32, 32] (fp32 holding integers in
    -127..127) and scales [M, K/32] (fp32), ``x ~ s * code`` per block."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    s = blocks.abs().amax(-1) / XMAX
    codes = torch.where(s[..., None] > 0, torch.round(blocks / s[..., None]), 0).clamp_(-XMAX, XMAX)
    return codes, s


def reference(x: Tensor, codes: Tensor, scale: Tensor, low: Tensor, bias: Tensor | None = None) -> Tensor:
    """The 4-bit product in torch: ``x`` [..., K] -> [..., N] in x's dtype, the kernel's math (exact integer dot
    products per block; the fp32 terms summed in another order). Rows in chunks of 16: the per-block products of a
    chunk are [16, N, K/32] floats."""
    shape, k = x.shape, x.shape[-1]
    flat = x.reshape(-1, k)
    n, blocks = codes.shape[0], k // BLOCK
    w = codes.float().view(n, blocks, BLOCK)
    d, m = scale.float(), low.float()  # [N, B]
    out = []
    for rows in flat.split(16):
        q, s = quantize_rows(rows)  # [R, B, 32], [R, B]
        dots = torch.einsum("rbk,nbk->rnb", q, w)  # exact: integers below 2^24
        y = (dots * (d[None] * s[:, None]) + m[None] * (s * q.sum(-1))[:, None]).sum(-1)  # [R, N]
        if bias is not None:
            y = y + bias.float()
        out.append(y.to(x.dtype))
    y = torch.cat(out) if out else flat.new_empty(0, n)
    return y.view(*shape[:-1], n)


class Int4Linear(nn.Module):
    """A Linear layer with 4-bit weights (see the module docs): ``codes`` [out, in] uint8, ``scale`` and ``low``
    [out, in/32] fp16, ``bias`` as the layer's. Activations stay in the model's dtype; the output has their dtype."""

    def __init__(self, codes: Tensor, scale: Tensor, low: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("low", low)
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear | nn.Module, dtype: torch.dtype | None = None) -> Int4Linear:
        codes, scale, low = quantize_weight(linear.weight)
        bias = getattr(linear, "bias", None)
        dtype = dtype or linear.weight.dtype
        return cls(codes, scale, low, bias.to(dtype) if bias is not None else None)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weights this layer stands for, [out, in] in ``dtype`` (the product also quantizes its input)."""
        n, k = self.codes.shape
        w = self.codes.float().view(n, k // BLOCK, BLOCK) * self.scale.float()[..., None] + self.low.float()[..., None]
        return w.view(n, k).to(dtype)

    def rows(self, ids: Tensor) -> Int4Linear:
        """A layer of the output channels ``ids`` only (e.g. a drafter's draft vocabulary of the LM head)."""
        ids = ids.to(self.codes.device)
        bias = self.bias[ids] if self.bias is not None else None
        return Int4Linear(self.codes[ids].contiguous(), self.scale[ids].contiguous(), self.low[ids].contiguous(), bias)

    def forward(self, x: Tensor) -> Tensor:
        return self._product()(x)

    def _product(self) -> Int4Matmul:
        """The product of these weights, built on first use and again only when a weight changes."""
        tensors = (self.codes, self.scale, self.low, *((self.bias,) if self.bias is not None else ()))
        return cached_product(self, tensors, lambda: Int4Matmul(self.codes, self.scale, self.low, self.bias))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int4"


class Int4Matmul(RowKernelProduct):
    """The 4-bit product of :class:`Int4Linear` (which calls one): every row count on the row kernel where it runs,
    else :func:`reference`."""

    __slots__ = ("codes", "low", "scale")

    def __init__(self, codes: Tensor, scale: Tensor, low: Tensor, bias: Tensor | None = None) -> None:
        self.codes, self.scale, self.low = codes.contiguous(), scale.contiguous(), low.contiguous()
        self.bias = bias.detach() if bias is not None else None
        self.out_features = self.codes.shape[0]
        usable = row_kernels.int4_usable(self.codes)
        packed = row_kernels.pack_int4(self.codes, self.scale, self.low) if usable else None
        self._rows_kernel(packed, row_kernels.ANY_ROWS)

    def _fallback(self, x: Tensor) -> Tensor:
        return reference(x, self.codes, self.scale, self.low, self.bias)
