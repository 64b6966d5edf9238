"""Opt-in weight-only int8 targets: int8 weights with one scale per output channel, activations as they are.

``quantize_model(model, "int8")`` replaces the decoder's Linear layers (q/k/v/o, gate/up/down: every
``nn.Linear`` under the decoder) and, by default, the LM head with :class:`Int8Linear`. Weights are
quantized symmetrically per output channel: ``scale = max|w_row| / 127`` (kept in the model's dtype),
``q = round(w / scale)`` clamped to [-127, 127]. A layer computes ``x @ (q * scale).T`` with
``aten._weight_int8pack_mm`` (bf16, fp16 or fp32 activations; the int8 weights are read as they are, half
the bytes of bf16), the way llama.cpp runs quantized weights: less memory traffic for a
bandwidth-bound one-token step.

The quantized model is one deterministic function: every call, a one-token decode step or a multi-token
verify pass, runs the same weights through the same kernel (never dequantized weights for larger
batches), and each output row of that kernel depends on its own input row only (checked: rows of
M = 1..16 are bitwise equal to the same rows of one M = 16 call). So the losslessness contract holds
with respect to the *quantized* target: speculative output equals plain decoding of the int8 target.
It is a different model from the bf16 one, and its output is never claimed equal to the bf16 target's;
stats and the server declare it (``target_weights``).

The LM head. SmolLM2 ties it to the embedding table (49152 x 576, 56 MB in bf16): quantizing it gives
the head its own int8 copy (the embedding stays bf16 for lookups; 28 MB more memory) and unties the two.
A drafter borrows the target's head, so with a quantized head it drafts through the int8 head too.

Where one of :mod:`dflashkit.kernels.row_kernels`'s kernels runs (AMX, AVX512-BF16 or AVX2), every product of
every row count runs on its int8 product (``pack_int8``: int8 panels + fp32 scales; each row on its own, so
speculative greedy output of the int8 target is bitwise its plain output); elsewhere on
``aten._weight_int8pack_mm``. Torch's kernel costs about its one-row time per row (2.5-4x faster than bf16 for one
row, about even at 8, slower beyond; docs/experiments.md), so verify passes and long prefills pay for it; on
AVX2-only CPUs it has no fast path at all and its rows are not bitwise independent, and with fp32 activations it is
exact but unvectorised (~25x its bf16 time: use bf16). torchao's int8 weight-only configuration converts the
weights to bf16 on every call on a CPU, slower than plain bf16, so dflashkit does not use it. The LM head is worth
quantizing (~2 ms of a ~25 ms bf16 step of SmolLM2-135M).

Whether int8 pays depends on the CPU (docs/experiments.md): on AVX2-only CPUs (e.g. AMD Zen 1) unpacking int8
weights to fp32 costs what the halved bytes save, so int8 decodes at about bf16's speed and only halves the
weights' memory; on an Intel Xeon with AMX and on AMD EPYC Zen 4 (AVX512-BF16), whose kernels turn the int8 weights
into bf16 pairs in registers, plain int8 decoding ran at 1.4x and 1.8x the bf16 target's speed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflashkit.errors import InvalidInputError
from dflashkit.kernels import row_kernels
from dflashkit.kernels.row_kernels import RowKernelProduct, cached_product

INT8_WEIGHTS = "int8 weight-only (per-channel)"
QMAX = 127


def quantize_weight(weight: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: (q [out, in] int8, scale [out] in `dtype`, default weight's dtype).

    The scale is computed in fp32 and rounded to `dtype` first, then q is rounded against that stored
    scale, so that q * scale approximates the weight as well as the stored scale allows.
    """
    dtype = dtype or weight.dtype
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax)).to(dtype)
    q = torch.round(w / scale.float()[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear(nn.Module):
    """A Linear layer with int8 weights (one scale per output channel) and floating-point activations.

    ``qweight`` [out, in] int8 and ``scale`` [out] are buffers; activations must have the scale's dtype.
    The output is ``x @ (qweight * scale).T (+ bias)``, from one kernel at every batch size.
    """

    def __init__(self, qweight: Tensor, scale: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear | nn.Module, dtype: torch.dtype | None = None) -> Int8Linear:
        q, scale = quantize_weight(linear.weight, dtype)
        bias = getattr(linear, "bias", None)
        return cls(q, scale, bias.to(scale.dtype) if bias is not None else None)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weights this layer computes with, [out, in] in `dtype` (for references and tests)."""
        return (self.qweight.to(torch.float32) * self.scale.to(torch.float32)[:, None]).to(dtype)

    def rows(self, ids: Tensor) -> Int8Linear:
        """A layer of the output channels `ids` only (e.g. a drafter's draft vocabulary of the LM head)."""
        ids = ids.to(self.qweight.device)
        bias = self.bias[ids] if self.bias is not None else None
        return Int8Linear(self.qweight[ids].contiguous(), self.scale[ids].contiguous(), bias)

    def forward(self, x: Tensor) -> Tensor:
        return self._product()(x)

    def _product(self) -> Int8Matmul:
        """The product of these weights (:class:`Int8Matmul`: on the row kernel where it runs, AVX2,
        AVX512-BF16 or AMX, else ``aten._weight_int8pack_mm``), built on first use and again only when a weight
        changes."""
        tensors = (self.qweight, self.scale, *((self.bias,) if self.bias is not None else ()))
        return cached_product(self, tensors, lambda: Int8Matmul(self.qweight, self.scale, self.bias))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def check_supported(device: torch.device | str, dtype: torch.dtype) -> None:
    """Refuse (InvalidInputError) a device or dtype on which the int8 kernel does not run."""
    device = torch.device(device)
    try:
        x = torch.ones(2, 32, dtype=dtype, device=device)
        q = torch.ones(16, 32, dtype=torch.int8, device=device)
        y = torch.ops.aten._weight_int8pack_mm(x, q, torch.ones(16, dtype=dtype, device=device))
        ok = bool((y == 32).all())  # a device without real data (meta) fails here
    except (RuntimeError, NotImplementedError, TypeError) as e:
        raise InvalidInputError(
            f"int8 weight-only quantization needs aten._weight_int8pack_mm, which does not run on {device} with "
            f"{str(dtype).removeprefix('torch.')} activations here ({str(e).splitlines()[0][:200]}); "
            "use --device cpu, or drop --quantize"
        ) from e
    if not ok:
        raise InvalidInputError(f"aten._weight_int8pack_mm gives wrong results on {device}; drop --quantize")


class Int8Matmul(RowKernelProduct):
    """``x @ (qweight * scale).T + bias`` with int8 weights, as :class:`Int8Linear` computes it (which calls one):
    on the row kernel where it runs (its int8 product), else with ``aten._weight_int8pack_mm``."""

    __slots__ = ("qweight", "scale")

    def __init__(self, qweight: Tensor, scale: Tensor, bias: Tensor | None = None) -> None:
        self.qweight, self.scale = qweight.contiguous(), scale.contiguous()  # [out, in] int8, [out]
        self.bias = bias.detach() if bias is not None else None
        self.out_features = self.qweight.shape[0]
        usable = row_kernels.int8_usable(self.qweight)
        # every row count on the kernel: torch's int8 kernel rounds otherwise, and on AMX it prefilled a prompt ~2x
        # slower than the bf16 target's
        self._rows_kernel(row_kernels.pack_int8(self.qweight, self.scale) if usable else None, row_kernels.ANY_ROWS)

    def _fallback(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).contiguous(), self.qweight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)
