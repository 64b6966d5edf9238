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

Per-layer GEMM time, median µs per call, 1 thread, torch 2.13.0+cpu, 2-core AMD EPYC (AVX-512,
AVX512-BF16, no AMX), while other jobs kept both cores busy (``docs/experiments.md --threads 1
--torchao``; torchao 0.18's ``Int8WeightOnlyConfig`` converts the int8 weight to bf16 and runs a bf16
matmul on every call on a CPU: slower than plain bf16, so dflashkit does not use it):

| layer (out x in) | M = 1 | 2 | 4 | 8 | 16 |
|---|---:|---:|---:|---:|---:|
| q, o (576 x 576) | 50 / 10 | 32 / 14 | 33 / 21 | 38 / 39 | 50 / 78 |
| k, v (192 x 576) | 19 / 5 | 20 / 6 | 20 / 8 | 21 / 15 | 25 / 27 |
| gate, up (1536 x 576) | 65 / 25 | 66 / 34 | 68 / 52 | 84 / 103 | 116 / 204 |
| down (576 x 1536) | 66 / 24 | 65 / 31 | 67 / 46 | 83 / 91 | 116 / 181 |
| LM head (49152 x 576) | 3479 / 1435 | 3610 / 1511 | 3727 / 1972 | 4200 / 3885 | 5278 / 7694 |

(bf16 / int8.) torchao at M = 1 / 16: q 86 / 109, gate 187 / 236, LM head 31371 / 33206. The int8
kernel costs about its M = 1 time per row: 2.5-4x faster than bf16 for one row, about even at M = 8,
slower from there (1.5-1.8x at M = 16). One decoding step's GEMMs at M = 1 (30 layers + head): bf16 ~13.5 ms,
int8 ~4.5 ms. Multi-token passes pay: a 16-token verify's GEMMs cost more than in bf16, and so does the
prefill of a long prompt (time to first token). The LM head is worth quantizing (2 ms of a ~25 ms step).
With fp32 activations the kernel is exact but unvectorised here (gate at M = 1: 666 µs, ~25x its bf16
time): use bf16.

On AVX2-only CPUs (most laptops; the 2-core Zen 1 VM of sessions 13-14) ``aten._weight_int8pack_mm`` has no fast
path: the int8 target decoded at 18.7 tok/s plain, 19.5 speculative, against ~48 / ~63 in bf16 on the AVX2 row
kernels, and its verify rows were not bitwise its one-token steps (a tie divergence on the README prompt). There
:class:`Int8Linear` and the fast forward's int8 products run on :mod:`dflashkit.kernels.row_kernels`'s AVX2 int8 product
instead (``pack_int8``: int8 panels + fp32 scales; each row on its own, so speculative greedy output of the int8
target is bitwise its plain output). Interleaved in one process, the README prompt + 2 prompts per set, 128
tokens (docs/experiments.md): int8 plain 49.3 tok/s, bf16 47.5;
speculative int8 46.1, bf16 62.9 (medians; a second run with ``--limit 1``: plain 42.9 / 49.2, speculative 47.0 /
61.5). So on Zen 1 int8 pays no speed: unpacking 16 int8 weights to fp32 costs
more than streaming 16 more bytes (1 row: the LM head 2.95 ms int8 vs 2.81 bf16; 4 rows: 4.7 vs 4.3), it only
halves the weights' memory. On AMX CPUs the AMX row kernel takes the same int8 panels (1.4x the bf16 target's plain
decoding on the Xeon VM of session 24), and since session 36 so does the AVX512-BF16 one (the table above is torch's
int8 kernel, which AVX512-BF16 CPUs without AMX ran until then): a pair of int8 weight rows becomes bf16 pairs in
registers for ``vdpbf16ps``. On the Zen 4 VM a whole SmolLM2 step at 1 / 4 / 8 / 16 rows takes 5.4 / 6.7 / 10.1 / 18.8
ms against 9.8 / 10.1 / 12.5 / 17.7 in bf16 (``scripts/step_cost.py --quantize int8``), and ``docs/experiments.md
--limit 2 --threads 2`` gave medians of int8 plain 151.2 tok/s, speculative 241.9, against bf16 82.7 / 188.4.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflashkit.errors import InvalidInputError
from dflashkit.kernels import row_kernels
from dflashkit.kernels.row_kernels import RowKernelProduct

METHODS = ("int8",)
INT8_WEIGHTS = "int8 weight-only (per-channel)"
QMAX = 127


def check_method(method: str | None) -> str | None:
    """The quantization method, checked (None: none). Raises InvalidInputError for an unknown one."""
    if method is None or method == "none":
        return None
    if method not in METHODS:
        raise InvalidInputError(f"unknown quantization {method!r}: choose from {', '.join(METHODS)} (or none)")
    return method


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
        key = tuple(
            (t.data_ptr(), -1 if t.is_inference() else t._version)  # inference tensors: no version
            for t in (self.qweight, self.scale, *((self.bias,) if self.bias is not None else ()))
        )
        cached = self.__dict__.get("_cached_product")
        if cached is None or cached[0] != key:
            cached = (key, Int8Matmul(self.qweight, self.scale, self.bias))
            self.__dict__["_cached_product"] = cached
        return cached[1]

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


def quantize_model(model: nn.Module, method: str | None = "int8", *, lm_head: bool = True) -> nn.Module:
    """Quantize a causal LM in place (see the module docs); returns it. None/"none": leave it as it is.

    Every ``nn.Linear`` under the decoder becomes an :class:`Int8Linear`, and with ``lm_head`` the output
    head too (untied from the embedding, which stays in the model's dtype). The model records what was
    done in ``model.dflashkit_quantization`` (read by :func:`target_weights`).
    """
    method = check_method(method)
    if method is None:
        return model
    if getattr(model, "dflashkit_quantization", None):
        raise InvalidInputError(f"the model is already quantized ({model.dflashkit_quantization})")
    embed = model.get_input_embeddings()
    dtype, device = embed.weight.dtype, embed.weight.device
    check_supported(device, dtype)
    decoder = model.get_decoder()
    replaced = 0
    for name, module in list(decoder.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, Int8Linear.from_linear(child, dtype))
                replaced += 1
    if replaced == 0:
        raise InvalidInputError(f"{type(model).__name__}: no nn.Linear layers in its decoder to quantize")
    head = model.get_output_embeddings()
    if lm_head and head is not None:
        model.set_output_embeddings(Int8Linear.from_linear(head, dtype))
        if getattr(model.config, "tie_word_embeddings", False):
            model.config.tie_word_embeddings = False  # the head now has its own (int8) weights
    model.dflashkit_quantization = INT8_WEIGHTS + (", LM head included" if lm_head and head is not None else "")
    return model


def is_quantized(weights: str | None) -> bool:
    """Whether a `target_weights` description (stats, bench settings) names a quantized target."""
    return bool(weights) and weights.startswith(INT8_WEIGHTS)


def target_weights(model: nn.Module) -> str:
    """What the target computes with: "int8 weight-only (per-channel)..." or its floating dtype ("bfloat16")."""
    quant = getattr(model, "dflashkit_quantization", None)
    if quant:
        return quant
    return str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")


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
