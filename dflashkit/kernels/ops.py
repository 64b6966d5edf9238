"""Plain callables for the fast decode paths: a prepacked matrix product, RMS norm, rotary embedding.

A decoding step of a small model on a CPU runs a few hundred tiny operations, and each costs a few
microseconds of framework time on top of its arithmetic. These callables are plain objects (no
``nn.Module.__call__``, no hooks, no per-call checks): the fast target forward (:mod:`dflashkit.target.fast`)
and the drafter's fast path build them once from a model's parameters and call them every step. They hold
copies or views of the weights taken when built: build them again after the weights change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit.kernels import row_kernels
from dflashkit.kernels.int4 import Int4Linear, Int4Matmul
from dflashkit.kernels.int8 import Int8Linear, Int8Matmul
from dflashkit.kernels.linear import packing_supported
from dflashkit.kernels.row_kernels import RowKernelProduct


class Matmul(RowKernelProduct):
    """``x @ weight.T + bias``: up to :func:`row_kernels.max_rows` rows on :mod:`dflashkit.kernels.row_kernels`'s
    kernel where
    it runs (more rows through ``F.linear``); elsewhere with the weight prepacked for oneDNN where that runs
    (else ``F.linear``)."""

    __slots__ = ("packed", "weight")

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        self.weight = weight.detach()  # [out, in]
        self.bias = bias.detach() if bias is not None else None
        self.out_features = self.weight.shape[0]
        self.packed = None
        usable = row_kernels.usable(self.weight)
        self._rows_kernel(row_kernels.pack(self.weight) if usable else None)  # no oneDNN copy besides: prefills
        if not usable and packing_supported(self.weight.device, self.weight.dtype):  # reorder per call
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)

    @classmethod
    def of(cls, linear: nn.Module) -> Matmul | Int8Matmul | Int4Matmul:
        """The product of an ``nn.Linear`` (or PackedLinear), or of an :class:`Int8Linear` / :class:`Int4Linear`
        (kept quantized)."""
        return cls.fused([linear])

    @classmethod
    def fused(cls, linears: list[nn.Module]) -> Matmul | Int8Matmul | Int4Matmul:
        """One product for several layers that read the same input: weights (and biases) stacked by rows.
        Weight-only quantized layers stay quantized (their scales are per output row, so stacking changes
        nothing)."""
        kinds = {type(m) if isinstance(m, (Int8Linear, Int4Linear)) else nn.Linear for m in linears}
        if len(kinds) > 1:
            raise ValueError("cannot fuse layers of different weights (int8, int4, floating point) into one product")
        kind = kinds.pop()
        rows = [m.out_features for m in linears]
        bias = None
        if any(m.bias is not None for m in linears):
            like = next(m.bias for m in linears if m.bias is not None)
            bias = torch.cat(
                [m.bias.detach() if m.bias is not None else like.new_zeros(r) for m, r in zip(linears, rows)]
            )
        if kind is Int8Linear:
            return Int8Matmul(torch.cat([m.qweight for m in linears]), torch.cat([m.scale for m in linears]), bias)
        if kind is Int4Linear:
            stacked = (torch.cat([getattr(m, name) for m in linears]) for name in ("codes", "scale", "low"))
            return Int4Matmul(*stacked, bias)
        return cls(torch.cat([m.weight.detach() for m in linears]), bias)

    def _fallback(self, x: Tensor) -> Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm:
    """RMS norm as transformers' Llama/Qwen3 and the drafter compute it: normalise in fp32, scale in the input
    dtype (``weight * (x / rms(x)).to(dtype)``)."""

    __slots__ = ("eps", "weight")

    def __init__(self, weight: Tensor, eps: float) -> None:
        self.weight = weight.detach()
        self.eps = float(eps)

    def __call__(self, x: Tensor) -> Tensor:
        # Normalise in fp32 and round once to x's dtype: the same numbers as the spelled-out x.float() *
        # rsqrt(mean(x²) + eps) then .to(dtype) (bitwise in bf16, tested). On a CPU torch's rms_norm is a
        # composite of small ops (~11 µs for one 576-wide bf16 row on a 2-core CPU), while layer_norm is one fused
        # kernel: [x, -x] has mean 0 and the mean square of x, so the first half of its layer norm is x / rms(x)
        # (~6 µs with the cat; 61 norms per SmolLM2 step: ~0.4 ms of ~11 ms).
        d = x.shape[-1]
        if x.device.type != "cpu":
            return self.weight * F.rms_norm(x, (d,), eps=self.eps)
        return self.weight * F.layer_norm(torch.cat((x, -x), -1), (2 * d,), eps=self.eps)[..., :d]


def signed_sin(sin: Tensor) -> Tensor:
    """The sine table for :func:`rotate`: negated over the first half of the head dimension."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotary embedding, rotate-half convention: x [..., seq, head_dim]; cos and ``signed_sin(sin)``
    broadcastable to it. ``roll`` by half the head dimension with the sign folded into the sine table is
    ``cat(-x2, x1) * sin`` to the bit (a sign flip is exact) in 4 ops instead of 7 (~5 µs less per call)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
