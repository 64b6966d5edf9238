"""Warm starts: a drafter initialised from the target's layers, or grown from a smaller drafter (deeper, wider)."""

from __future__ import annotations

import torch

from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import InvalidInputError


def init_from_target(drafter: DFlashDrafter, model: torch.nn.Module) -> None:
    """Start from the target: its last N decoder layers, fc reading the deepest feature layer, its final norm.

    Measured (training-notes) to start at a lower loss and learn faster than random initialisation.
    """
    layers = model.get_decoder().layers
    src_layers = layers[len(layers) - len(drafter.layers) :]
    with torch.no_grad():
        for dst, src in zip(drafter.layers, src_layers):
            src_state = src.state_dict()
            for name, p in dst.state_dict().items():
                if name in src_state and src_state[name].shape == p.shape:
                    p.copy_(src_state[name])
        H = drafter.config.hidden_size
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -H:] = torch.eye(H)
        first_norm = getattr(src_layers[0], "input_layernorm", None)  # the context plays that layer's input
        if first_norm is not None and first_norm.weight.shape == drafter.hidden_norm.weight.shape:
            drafter.hidden_norm.weight.copy_(first_norm.weight)
        final_norm = getattr(model.get_decoder(), "norm", None)
        if final_norm is not None and final_norm.weight.shape == drafter.norm.weight.shape:
            drafter.norm.weight.copy_(final_norm.weight)
        if drafter.mask_embedding is not None:
            drafter.mask_embedding.copy_(model.get_input_embeddings().weight.float().mean(0))


def deepened(drafter: DFlashDrafter, num_layers: int) -> DFlashDrafter:
    """`drafter` with layers appended up to `num_layers`, computing exactly what it computed.

    Each new layer copies one of the existing layers (the last ones first) with its attention and MLP output
    projections zeroed: its residual branches add nothing until training moves those projections, so a run
    continues from the trained drafter's own drafts with more depth to learn with.
    """
    have = drafter.config.num_hidden_layers
    if num_layers < have:
        raise InvalidInputError(f"cannot deepen a {have}-layer drafter to {num_layers} layers")
    grown = DFlashDrafter(drafter.config.replace(num_hidden_layers=num_layers)).to(drafter.fc.weight.device)
    state = drafter.state_dict()
    for new in range(have, num_layers):
        donor = have - 1 - (new - have) % have
        for name, value in drafter.layers[donor].state_dict().items():
            zero = name in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
            state[f"layers.{new}.{name}"] = torch.zeros_like(value) if zero else value.clone()
    grown.load_state_dict(state)
    return grown


def adds_layers_only(have: list[int], want: list[int]) -> bool:
    """Whether feature layers ``want`` hold each of ``have`` and others, each once (what :func:`widened` can do)."""
    return set(have) <= set(want) and len(set(want)) == len(want)


def widened(drafter: DFlashDrafter, target_layer_ids: list[int]) -> DFlashDrafter:
    """`drafter` fed by more target layers (a superset of its own, in any order), computing exactly what it computed.

    The fusion ``fc`` [H, n_feat*H] gets the new layers' columns as zeros, each old layer's block of columns moved to
    that layer's place in the new order: the fused context is unchanged until training moves the new columns, so a
    run continues from the trained drafter's own drafts with more of the target to read (the paper's ablation: 5
    feature layers over 3, +3-5% τ).
    """
    have = list(drafter.config.target_layer_ids)
    if not adds_layers_only(have, target_layer_ids):
        raise InvalidInputError(
            f"cannot widen a drafter fed by target layers {have} to {target_layer_ids}: the new "
            "list must hold each of its layers (once) and may only add others"
        )
    grown = DFlashDrafter(drafter.config.replace(target_layer_ids=list(target_layer_ids))).to(drafter.fc.weight.device)
    state = drafter.state_dict()
    H = drafter.config.hidden_size
    old = state["fc.weight"]  # [H, len(have)*H]
    fc = torch.zeros(old.shape[0], len(target_layer_ids) * H, dtype=old.dtype, device=old.device)
    for j, layer in enumerate(have):
        i = target_layer_ids.index(layer)
        fc[:, i * H : (i + 1) * H] = old[:, j * H : (j + 1) * H]
    state["fc.weight"] = fc
    grown.load_state_dict(state)
    return grown
