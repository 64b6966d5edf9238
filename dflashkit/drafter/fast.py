"""The drafter's fast inference forward: fused prepacked products and plain callables, rebuilt when its weights
change."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit.drafter.context import KV, ContextCache
from dflashkit.drafter.layers import DrafterLayer, RMSNorm
from dflashkit.kernels import ops as kernels
from dflashkit.kernels import row_kernels
from dflashkit.kernels.ops import Matmul, rotate, signed_sin

# Parameters registered on any module since the first drafter's fast forward asked: a drafter's cached parameter list
# (DFlashDrafter._fast_forward) is taken again when this changes, since one of its parameters may have been replaced
# rather than updated in place. The hook is process-wide, so it is installed on first use, never on import.
_registrations = 0
_hook: object | None = None


def _count_registration(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    global _registrations
    _registrations += 1


def registrations() -> int:
    """How many parameters any module has registered since the first call (which installs the counting hook)."""
    global _hook
    if _hook is None:
        _hook = torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
    return _registrations


@dataclass
class DraftStep:
    """One sequence's drafting step (see :meth:`DFlashDrafter.draft_scores`): its context cache, its verified target
    features not yet in it ([1, n, F] at positions ``new_start``.., or None), the anchor token at ``pos``, the
    k drafts to compute after it and the gap before a last row (see :meth:`DFlashDrafter.block_plan`)."""

    context: ContextCache
    new_features: Tensor | None
    new_start: int
    anchor: int
    pos: int
    k: int
    gap: int = 0  # > 0: one more row after the k drafts, this many positions further (the trained block's last row)

    @property
    def rows(self) -> int:
        """Block rows after the anchor: the k drafts, and the last row where there is a gap."""
        return self.k + (self.gap > 0)


class FastDrafterForward:
    """The drafter's inference forward (batch 1, no mask) on plain callables: q/k/v and gate/up fused into one
    product each, every product prepacked for oneDNN (:mod:`dflashkit.kernels.ops`). Same maths as the modules;
    built from the drafter's parameters as they are now."""

    def __init__(self, drafter: nn.Module) -> None:
        first = drafter.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = first.n_heads, first.n_kv, first.head_dim
        self.fc = Matmul.of(drafter.fc)
        self.hidden_norm, self.norm = _plain(drafter.hidden_norm), _plain(drafter.norm)
        self.rotary = drafter.rotary
        self.layers = [_FastDrafterLayer(layer) for layer in drafter.layers]
        attns = [layer.self_attn for layer in drafter.layers]
        # the injected context's keys and values of every layer in one product: [k_0 v_0 k_1 v_1 ...] rows
        self.context_kv = Matmul.fused([proj for a in attns for proj in (a.k_proj, a.v_proj)])
        # every layer's k_norm in one call: its weight per (layer, kv head) row of the context's keys
        self.context_k_norm = _per_head_norm([(a.k_norm, self.kv_heads) for a in attns])
        self.fused_weights = self._fused_weights(drafter)
        self.row_limit = row_kernels.max_rows(self.fc.weight.device)  # blocks of more rows: the Python layers
        # the one-call step (row_kernels.drafter_step_batch): the context's products and norms, the final norm
        self.step_weights = None
        if self.fused_weights is not None and self.fc.small is not None and self.context_kv.small is not None:
            self.step_weights = (
                self.fc.small,
                self.hidden_norm.weight,
                self.hidden_norm.eps,
                self.context_kv.small,
                self.norm.weight,
                self.norm.eps,
            )
        self.mask_token_id = drafter.config.mask_token_id
        self.learned_mask = drafter.mask_embedding.detach() if drafter.mask_embedding is not None else None
        self._mask_row: tuple[tuple, Tensor] | None = None  # (the embedding table it was taken from, [H])
        self._rotary: tuple[Tensor, Tensor] | None = None  # cos, signed sin [P, head_dim] for positions 0..P-1

    def _fused_weights(self, drafter: nn.Module) -> list[Tensor] | None:
        """The layer tensors of the one-call step (8 per layer, as ``row_kernels.decoder_layers`` takes them) where its
        kernels run, else None."""
        layers = drafter.layers
        eps = {
            norm.eps
            for layer in layers
            for norm in (
                layer.input_layernorm,
                layer.post_attention_layernorm,
                layer.self_attn.q_norm,
                layer.self_attn.k_norm,
            )
        }
        fast = self.layers
        if (
            len(eps) != 1
            or not row_kernels.attention_usable(self.fc.weight.dtype, self.fc.weight.device, self.head_dim)
            or any(getattr(m, "small", None) is None for f in fast for m in (f.qkv, f.o, f.gate_up, f.down))
        ):
            return None
        self.eps = eps.pop()
        weights = []
        for layer, f in zip(layers, fast):
            weights += row_kernels.layer_weights(
                f.input_norm.weight,
                f.qkv.small,
                None,
                f.o.small,
                f.post_norm.weight,
                f.gate_up.small,
                f.down.small,
                layer.self_attn.q_norm.weight,
                layer.self_attn.k_norm.weight,
            )
        return weights

    def can_step(self, context: object, embed_tokens: nn.Module, new_features: Tensor | None = None) -> bool:
        """Whether :meth:`step` runs drafting steps here: the kernels run the drafter, the context is a plain
        :class:`ContextCache`, the features are bf16 and the target's embedding table is a bf16 [V, hidden] CPU table.
        (Blocks of more than ``row_limit`` rows run the Python layers after it has taken their context rows.)"""
        weight = getattr(embed_tokens, "weight", None)
        return (
            self.step_weights is not None
            and self.fused_weights is not None
            and isinstance(context, ContextCache)
            and (new_features is None or new_features.dtype == torch.bfloat16)
            and isinstance(weight, Tensor)
            and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.shape[1] == self.hidden_norm.weight.shape[0]
            and weight.is_contiguous()
        )

    def step(self, drafts: list[DraftStep], embed: Tensor) -> Tensor:
        """Drafting steps of several sequences in one C++ call (:func:`row_kernels.drafter_step_batch`; each one
        :meth:`can_step`, its block at most ``row_limit`` rows): their new features enter their contexts, their
        blocks run through every layer (k = 0: no block, the context rows only). Returns the final-normed hidden
        rows of every step's k drafts (and its last row, where it has a gap), in order [sum of rows, hidden]."""
        features, writes, feature_positions, anchors, counts, positions, caches, starts, firsts, gaps = (
            [] for _ in range(10)
        )
        taken = []
        empty = embed.new_empty(0)
        for d in drafts:
            context, n = d.context, d.new_features.shape[1] if d.new_features is not None else 0
            skip = context.outside_window(n)  # rows the window has passed already: not computed
            block = d.rows + 1 if d.k > 0 else 0
            writes.append(context.prepare(n, skip, block, self.kv_heads, self.head_dim, embed.dtype, embed.device))
            features.append(d.new_features[0, skip:] if n > skip else empty)
            feature_positions.append(d.new_start + skip)
            taken.append((context, n, skip))
            length = context.length + n  # the context's length once these rows are in: the block starts there
            starts.append(length)
            firsts.append(0 if context.window is None else max(0, length - context.window))
            anchors.append(-1 if self.learned_mask is not None and d.anchor == self.mask_token_id else d.anchor)
            counts.append(block)
            positions.append(d.pos)
            gaps.append(d.gap if block else 0)
            caches.append((context.keys, context.values))
        end = max(
            max(p + c + g for p, c, g in zip(positions, counts, gaps)),
            max(p + (f.shape[0] if f.numel() else 0) for p, f in zip(feature_positions, features)),
        )
        hidden = row_kernels.drafter_step_batch(
            features,
            self.step_weights,
            writes,
            feature_positions,
            embed,
            self.mask_row(embed),
            anchors,
            counts,
            positions,
            gaps,
            self.rotary_rows(end, embed.dtype, embed.device),
            self.fused_weights,
            caches,
            starts,
            firsts,
            self.heads,
            self.kv_heads,
            self.layers[0].intermediate,
            self.eps,
            self.head_dim**-0.5,
        )
        for context, n, skip in taken:
            context.commit(n, skip)
        return hidden

    def mask_row(self, embed: Tensor) -> Tensor:
        """The block's mask row [hidden]: the learned mask vector, or the mask token's row of the embedding table."""
        key = (embed.data_ptr(), embed.shape)
        if self._mask_row is None or self._mask_row[0] != key:
            row = self.learned_mask if self.learned_mask is not None else embed[self.mask_token_id]
            self._mask_row = (key, row.to(embed.dtype).contiguous())
        return self._mask_row[1]

    def rotary_rows(self, positions: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and signed sin tables covering positions 0..positions-1 (grown by doubling, kept between steps)."""
        if self._rotary is None or self._rotary[0].shape[0] < positions or self._rotary[0].dtype != dtype:
            size = max(256, 1 << (positions - 1).bit_length())
            cos, sin = self.rotary_tables(size, dtype, device)
            self._rotary = (cos.contiguous(), sin.contiguous())
        return self._rotary

    def context_key_values(self, target_features: Tensor, positions: Tensor) -> list[KV]:
        ctx = self.hidden_norm(self.fc(target_features))  # [1, n, hidden]
        cos, sin = self.rotary(positions, ctx.dtype)
        sin = signed_sin(sin)
        n, kv, d, layers = ctx.shape[1], self.kv_heads, self.head_dim, len(self.layers)
        kvs = self.context_kv(ctx).view(1, n, layers, 2, kv, d)  # every layer's keys and values, one product
        k = self.context_k_norm(kvs[:, :, :, 0].reshape(1, n, layers * kv, d))  # [1, n, layers*kv_heads, d]
        k = rotate(k.transpose(1, 2), cos, sin)  # [1, layers*kv_heads, n, d]
        v = kvs[:, :, :, 1].transpose(1, 3)  # [1, kv_heads, layers, n, d]
        return [(k[:, i * kv : (i + 1) * kv], v[:, :, i]) for i in range(layers)]

    def __call__(self, block_embeddings: Tensor, positions: Tensor, context: list[KV]) -> Tensor:
        """Final-normed hidden states [1, q_len, hidden] of the block (see DFlashDrafter.forward)."""
        cos, sin = self.rotary(positions, block_embeddings.dtype)
        return self.run(block_embeddings, cos, signed_sin(sin), context)

    def rotary_tables(self, positions: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and signed sin [positions, head_dim] of positions 0..positions-1 (row p = what a step at p uses)."""
        cos, sin = self.rotary(torch.arange(positions, device=device), dtype)
        return cos, signed_sin(sin)

    def run(
        self, block_embeddings: Tensor, cos: Tensor, sin: Tensor, context: list[KV], mask: Tensor | None = None
    ) -> Tensor:
        """The layers over the block [1, s, hidden] with rotary cos and signed sin [s, head_dim]; ``mask``
        (additive, [1, 1, group*s, ctx+s]) hides context rows, None: every context row is valid."""
        h, (heads, kv, d) = block_embeddings, (self.heads, self.kv_heads, self.head_dim)
        s = h.shape[1]
        for layer, (k_ctx, v_ctx) in zip(self.layers, context):
            qkv = layer.qkv(layer.input_norm(h))  # [1, s, (heads + 2*kv_heads) * d]
            # q_norm and k_norm in one call (a weight per head row), then one rotation of queries and keys
            qk = layer.qk_norm(qkv[..., : (heads + kv) * d].view(1, s, heads + kv, d))
            qk = rotate(qk.transpose(1, 2), cos, sin)  # [1, heads + kv_heads, s, d]
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[..., (heads + kv) * d :]
            keys = torch.cat((k_ctx, k), dim=2)  # [1, kv_heads, ctx+s, d]
            values = torch.cat((v_ctx, v.view(1, s, kv, d).transpose(1, 2)), dim=2)
            packed = q.reshape(1, kv, (heads // kv) * s, d)  # query heads per K/V head, no K/V copy
            out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask).reshape(1, heads, s, d)
            h = h + layer.o(out.transpose(1, 2).reshape(1, s, heads * d))
            gate_up = layer.gate_up(layer.post_norm(h))
            h = h + layer.down(F.silu(gate_up[..., : layer.intermediate]) * gate_up[..., layer.intermediate :])
        return self.norm(h)


class _FastDrafterLayer:
    def __init__(self, layer: DrafterLayer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = Matmul.fused([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = Matmul.of(attn.o_proj)
        self.gate_up = Matmul.fused([mlp.gate_proj, mlp.up_proj])
        self.intermediate = mlp.gate_proj.weight.shape[0]
        self.down = Matmul.of(mlp.down_proj)
        self.input_norm, self.post_norm = _plain(layer.input_layernorm), _plain(layer.post_attention_layernorm)
        self.qk_norm = _per_head_norm([(attn.q_norm, attn.n_heads), (attn.k_norm, attn.n_kv)])


def _plain(norm: RMSNorm) -> kernels.RMSNorm:
    return kernels.RMSNorm(norm.weight, norm.eps)


def _per_head_norm(norms: list[tuple[RMSNorm, int]]) -> kernels.RMSNorm:
    """Several per-head RMS norms as one call over stacked heads: norm i's weight repeated for its `count` head
    rows ([sum of counts, head_dim]), so x [..., sum of counts, head_dim] is normed head by head."""
    if len({norm.eps for norm, _ in norms}) != 1:
        raise ValueError("per-head norms with different eps cannot be stacked")
    weight = torch.cat([norm.weight.detach()[None].expand(count, -1) for norm, count in norms])
    return kernels.RMSNorm(weight, norms[0][0].eps)
