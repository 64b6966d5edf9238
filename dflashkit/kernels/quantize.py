"""Weight-only quantized targets: ``quantize_model(model, "int8" | "int4")`` and what the rest of dflashkit asks of one.

* ``int8`` (:mod:`dflashkit.kernels.int8`): int8 weights, one scale per output channel, activations as they are.
* ``int4`` (:mod:`dflashkit.kernels.int4`): 4-bit weights per block of 32 inputs, activations quantized to int8 per
  block inside each product (as llama.cpp runs its 4-bit GGUFs).

Either is a different model from the floating-point one, and the losslessness contract holds with respect to the
quantized model: every call, a one-token step or a multi-token verify pass, computes each row the same way, so
speculative output equals plain decoding of the quantized target. Stats, the server and benchmarks declare it
(:func:`target_weights`).
"""

from __future__ import annotations

import torch
from torch import nn

from dflashkit.errors import InvalidInputError
from dflashkit.kernels.int4 import INT4_WEIGHTS, Int4Linear
from dflashkit.kernels.int8 import INT8_WEIGHTS, Int8Linear, check_supported

METHODS = ("int8", "int4")
LAYERS: dict[str, type[Int8Linear] | type[Int4Linear]] = {"int8": Int8Linear, "int4": Int4Linear}
WEIGHT_ONLY = (Int8Linear, Int4Linear)  # the layers quantize_model puts in place of nn.Linear
DESCRIPTIONS = {"int8": INT8_WEIGHTS, "int4": INT4_WEIGHTS}


def check_method(method: str | None) -> str | None:
    """The quantization method, checked (None: none). Raises InvalidInputError for an unknown one."""
    if method is None or method == "none":
        return None
    if method not in METHODS:
        raise InvalidInputError(f"unknown quantization {method!r}: choose from {', '.join(METHODS)} (or none)")
    return method


def check_device(method: str, device: torch.device | str, dtype: torch.dtype) -> None:
    """Refuse (InvalidInputError) a device or dtype the method's products do not run on."""
    if method == "int8":
        check_supported(device, dtype)
    elif torch.device(device).type != "cpu":
        raise InvalidInputError(f"int4 weights run on CPUs only (got {device}); use --quantize int8 or none there")


def quantize_model(model: nn.Module, method: str | None = "int8", *, lm_head: bool = True) -> nn.Module:
    """Quantize a causal LM in place; returns it. None/"none": leave it as it is.

    Every ``nn.Linear`` under the decoder becomes the method's layer (:data:`LAYERS`), and with ``lm_head`` the
    output head too (untied from the embedding, which stays in the model's dtype for lookups). The model records what
    was done in ``model.dflashkit_quantization`` (read by :func:`target_weights`). int4 needs every layer's input
    size to be a multiple of 32 (true of Llama / Qwen shapes); a model with another is refused before any change.
    """
    method = check_method(method)
    if method is None:
        return model
    if getattr(model, "dflashkit_quantization", None):
        raise InvalidInputError(f"the model is already quantized ({model.dflashkit_quantization})")
    embed = model.get_input_embeddings()
    dtype, device = embed.weight.dtype, embed.weight.device
    check_device(method, device, dtype)
    layer = LAYERS[method]
    decoder = model.get_decoder()
    linears = [
        (module, name, child)
        for module in decoder.modules()
        for name, child in module.named_children()
        if type(child) is nn.Linear
    ]
    if not linears:
        raise InvalidInputError(f"{type(model).__name__}: no nn.Linear layers in its decoder to quantize")
    head = model.get_output_embeddings() if lm_head else None
    if method == "int4":
        layers = [child for *_, child in linears] + ([head] if head is not None else [])
        odd = sorted({m.in_features for m in layers if m.in_features % 32})
        if odd:
            raise InvalidInputError(f"int4 needs layer input sizes that are multiples of 32; this model has {odd}")
    for module, name, child in linears:
        setattr(module, name, layer.from_linear(child, dtype))
    if head is not None:
        model.set_output_embeddings(layer.from_linear(head, dtype))
        if getattr(model.config, "tie_word_embeddings", False):
            model.config.tie_word_embeddings = False  # the head now has its own (quantized) weights
    model.dflashkit_quantization = DESCRIPTIONS[method] + (", LM head included" if head is not None else "")
    return model


def is_quantized(weights: str | None) -> bool:
    """Whether a `target_weights` description (stats, bench settings) names a quantized target."""
    return bool(weights) and weights.startswith(tuple(DESCRIPTIONS.values()))


def target_weights(model: nn.Module) -> str:
    """What the target computes with: "int8 weight-only (per-channel)...", "int4 weight-only..." or its floating
    dtype ("bfloat16")."""
    quant = getattr(model, "dflashkit_quantization", None)
    if quant:
        return quant
    return str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")
