"""Plain callables for the fast decode paths: a prepacked matrix product, RMS norm, rotary embedding.

A decoding step of a small model on a CPU runs a few hundred tiny operations, and each costs a few
microseconds of framework time on top of its arithmetic. These callables are plain objects (no
``nn.Module.__call__``, no hooks, no per-call checks): the fast target forward (:mod:`dflashkit.fast_target`)
and the drafter's fast path build them once from a model's parameters and call them every step. They hold
copies or views of the weights taken when built: build them again after the weights change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import packing_supported


class Matmul:
    """``x @ weight.T + bias`` with the weight prepacked for oneDNN where that runs (else ``F.linear``)."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        self.weight = weight.detach()  # [out, in]
        self.bias = bias.detach() if bias is not None else None
        self.packed = None
        if packing_supported(self.weight.device, self.weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)

    @classmethod
    def of(cls, linear: nn.Module) -> Matmul:
        return cls(linear.weight, linear.bias)

    @classmethod
    def fused(cls, linears: list[nn.Module]) -> Matmul:
        """One product for several layers that read the same input: weights (and biases) stacked by rows."""
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = None
        if any(m.bias is not None for m in linears):
            bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])
                              for m in linears])  # fmt: skip
        return cls(weight, bias)

    def __call__(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm:
    """RMS norm as transformers' Llama/Qwen3 and the drafter compute it: normalise in fp32, scale in the input
    dtype (``weight * (x / rms(x)).to(dtype)``)."""

    __slots__ = ("weight", "eps")

    def __init__(self, weight: Tensor, eps: float) -> None:
        self.weight = weight.detach()
        self.eps = float(eps)

    def __call__(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, rotate-half convention: x [..., seq, head_dim] with cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
