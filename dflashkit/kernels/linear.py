"""Linear layers with weights prepacked once for oneDNN: the same GEMM without a weight reorder per call.

On a CPU, torch runs a bf16 ``F.linear`` through oneDNN, which first reorders the weight matrix into its
blocked layout, on every call. For the small GEMMs of decoding (1 to 16 rows) that reorder costs about as
much as the product itself. :class:`PackedLinear` reorders once (``torch.ops.mkldnn._reorder_linear_weight``,
the op torch's own inductor uses when it freezes a model) and multiplies with the packed weight
(``torch.ops.mkldnn._linear_pointwise``). On a 2-core AMD EPYC with AVX512-BF16 that took about a third off
the products of SmolLM2-135M's 30 layers + LM head at 1 to 16 rows.

In bf16 the packed product is bitwise equal to the eager one (both are oneDNN with fp32 accumulation) and
each output row depends on its own input row only, so a verify pass and a one-token step compute the same
linear layers. In fp32 the two differ by float rounding (eager fp32 is MKL's sgemm).

Where one of :mod:`dflashkit.kernels.row_kernels`'s kernels runs, bf16 products of up to
:func:`~dflashkit.kernels.row_kernels.max_batch_rows` rows use it instead (a batched step's logits rows included).
AMX-BF16 (Intel's Sapphire Rapids and later): up to 64 rows, about three quarters of oneDNN's time for 1 to 16 rows
on an Intel Xeon with AMX. AVX512-BF16 (CPUs with it and no AMX, such as AMD EPYC Zen 4, where oneDNN streams the
weights well below the memory's speed): up to 16 rows, 2x faster for 1-6 rows there. AVX2 (CPUs without AVX512,
where oneDNN has no bf16 path and this class's packed product never runs): every row count. Rows stay independent
of each other, but not bitwise equal to oneDNN's (another summation order).

The layer keeps the original ``weight`` (and ``bias``) parameters, so state dicts, tied embeddings and code
that reads ``.weight`` are unchanged; the packed copy is an extra, non-persistent tensor (the weights'
size again in memory). :func:`pack_linears` swaps a module's ``nn.Linear`` children in place and
:func:`unpack_linears` swaps the originals back (e.g. to time transformers' own ``generate``).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit.kernels import row_kernels

PACKABLE_DTYPES = (torch.bfloat16, torch.float32)


def packing_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether packed oneDNN linears run here: a CPU with oneDNN, and bf16 (with hardware support) or fp32."""
    return torch.device(device).type == "cpu" and _cpu_supports(dtype)


@lru_cache
def _cpu_supports(dtype: torch.dtype) -> bool:
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return True


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with the weight prepacked for oneDNN (CPU, bf16 or fp32).

    Inputs of another dtype or device, and weights changed after packing, fall back to ``F.linear`` (correct,
    just not faster), so the layer is never wrong, only sometimes not fast.
    """

    def __init__(self, weight: nn.Parameter | Tensor, bias: nn.Parameter | Tensor | None = None) -> None:
        super().__init__()
        if not isinstance(weight, nn.Parameter):
            weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.weight = weight  # the original parameter: shared (ties), saved, read by others
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape
        self._packed: Tensor | None = None
        self._packed_key: tuple | None = None
        self._small: tuple | None = (
            None  # (key, (packed weight, fp32 bias, row limit) or None): dflashkit.kernels.row_kernels's
        )
        self.original: nn.Module | None = None  # the nn.Linear this replaced (see unpack_linears)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        layer = cls(linear.weight, linear.bias)
        object.__setattr__(layer, "original", linear)  # not a submodule: the state dict keeps its keys
        return layer

    def _key(self) -> tuple:
        w = self.weight
        return (
            w.data_ptr(),
            -1 if w.is_inference() else w._version,
            w.dtype,
            w.device,
        )  # inference tensors: no version

    def packed_weight(self) -> Tensor:
        """The oneDNN-blocked weight, packed on first use and again whenever the weight changes."""
        key = self._key()
        if self._packed is None or self._packed_key != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
            self._packed_key = key
        return self._packed

    def small_rows_weight(self) -> tuple[Tensor, Tensor | None, int] | None:
        """The weight packed for :mod:`dflashkit.kernels.row_kernels`'s kernel, the bias in fp32 and the most rows that
        kernel takes, or None where it does not run; packed on first use and again whenever the weight changes."""
        key = self._key()
        if self._small is None or self._small[0] != key:
            if row_kernels.usable(self.weight):
                bias = self.bias.detach().float().contiguous() if self.bias is not None else None
                # max_batch_rows: a batched step's logits rows (several sequences') stay on the kernel, each row
                # bitwise what its sequence alone would get
                self._small = (key, (row_kernels.pack(self.weight), bias, row_kernels.max_batch_rows()))
            else:
                self._small = (key, None)
        return self._small[1]

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed tensor out (oneDNN's opaque layout has no storage to copy); it is
        packed again on first use."""
        state = super().__getstate__().copy()
        state["_packed"], state["_packed_key"], state["_small"] = None, None, None
        return state

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in_features] -> [..., out_features]
        w = self.weight
        if (
            x.dtype != w.dtype
            or x.device.type != "cpu"
            or torch.is_grad_enabled()
            and (x.requires_grad or w.requires_grad)
        ):
            return F.linear(x, w, self.bias)
        if x.dtype == torch.bfloat16:
            small = self.small_rows_weight()
            if small is not None and row_kernels.rows_of(x) <= small[2]:
                return row_kernels.linear(x, small[0], self.out_features, small[1])
        if not _cpu_supports(x.dtype):  # bf16 without oneDNN's bf16 (an AVX2 CPU) and no row kernel
            return F.linear(x, w, self.bias)
        bias = self.bias.detach() if self.bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def pack_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``module`` (itself excluded) by a :class:`PackedLinear` sharing its
    parameters, where the weights' device and dtype allow it; returns how many were replaced."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and (
                packing_supported(child.weight.device, child.weight.dtype) or row_kernels.usable(child.weight)
            ):
                packed = getattr(child, "_dflashkit_packed", None)  # left there by unpack_linears
                if packed is None or packed.weight is not child.weight or packed.bias is not child.bias:
                    packed = PackedLinear.from_linear(child)
                if packing_supported(child.weight.device, child.weight.dtype):
                    packed.packed_weight()  # pack now (or check the old packing), not inside the first timed step
                packed.small_rows_weight()
                setattr(parent, name, packed)
                replaced += 1
    return replaced


def unpack_linears(module: nn.Module) -> int:
    """Put back the ``nn.Linear`` layers that :func:`pack_linears` replaced; returns how many."""
    restored = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear) and child.original is not None:
                object.__setattr__(child.original, "_dflashkit_packed", child)  # packing again reuses it
                setattr(parent, name, child.original)
                restored += 1
    return restored


def has_packed_linears(module: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in module.modules())
