"""The drafter's modules: RMS norm, rotary embedding, attention with injected context keys/values, MLP, layer, block
mask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.context import KV

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class BlockMask:
    """Training attention for N blocks of `block_size` queries, computed block-sparsely: a query of block n
    sees the context keys that `context` [batch, N*B, ctx_len] allows and all B keys of block n, nothing
    else (equal to the dense mask of train.training_attention_mask for real blocks, without its
    (N*B)^2 cross-block work)."""

    context: Tensor
    block_size: int


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Plain RoPE on absolute positions (rotate-half convention, as Qwen3/Llama in transformers)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [..., seq, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., seq, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim] or [batch, seq, head_dim]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.head_dim).transpose(1, 2)  # [batch, heads, seq, head_dim]

    def key_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> KV:
        """Keys (k_norm + RoPE) and values of hidden states x [batch, seq, hidden]."""
        k = apply_rotary(self.k_norm(self._heads(self.k_proj(x), self.n_kv)), cos, sin)
        v = self._heads(self.v_proj(x), self.n_kv)
        return k, v

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, context: KV, attn_mask: Tensor | BlockMask | None = None
    ) -> Tensor:
        """x: block hidden states [batch, q_len, hidden]; context: injected K/V; mask: bool [.., q, ctx+q]."""
        q = apply_rotary(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), cos, sin)
        k_blk, v_blk = self.key_values(x, cos, sin)
        if isinstance(attn_mask, BlockMask):
            return self._block_sparse(q, k_blk, v_blk, context, attn_mask)
        k = torch.cat((context[0], k_blk), dim=2)  # [batch, kv_heads, ctx+q_len, head_dim]
        v = torch.cat((context[1], v_blk), dim=2)
        b, h, s, d = q.shape
        if attn_mask is None:  # inference: the block sees everything; query heads packed per K/V head, no copy
            packed = q.reshape(b, self.n_kv, (h // self.n_kv) * s, d)  # [batch, kv_heads, group*q_len, head_dim]
            out = F.scaled_dot_product_attention(packed, k, v).reshape(b, h, s, d)
        else:
            if self.n_kv != h:
                k, v = k.repeat_interleave(h // self.n_kv, dim=1), v.repeat_interleave(h // self.n_kv, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, h * d))

    def _block_sparse(self, q: Tensor, k_blk: Tensor, v_blk: Tensor, context: KV, mask: BlockMask) -> Tensor:
        """Training attention; query heads grouped by their K/V head ([S, kv, group, ...]) so K/V are never copied."""
        S, h, Q, d = q.shape
        B, kv = mask.block_size, self.n_kv
        N, group = Q // B, h // kv
        k_ctx, v_ctx = context  # [S, kv, ctx, d]
        ctx_len = k_ctx.shape[2]
        scale = d**-0.5
        qg = q.reshape(S, kv, group * Q, d)
        s_ctx = (qg @ k_ctx.transpose(-1, -2)) * scale  # [S, kv, group*Q, ctx]
        s_ctx = s_ctx.view(S, kv, group, Q, ctx_len).masked_fill(~mask.context[:, None, None], float("-inf"))
        qb = q.reshape(S, kv, group, N, B, d)
        kb, vb = k_blk.view(S, kv, 1, N, B, d), v_blk.view(S, kv, 1, N, B, d)
        s_blk = (qb @ kb.transpose(-1, -2)) * scale  # [S, kv, group, N, B, B]: own block only
        scores = torch.cat((s_ctx.view(S, kv, group, N, B, ctx_len), s_blk), dim=-1)
        p = scores.float().softmax(-1).to(q.dtype)  # never empty: own block
        out_ctx = p[..., :ctx_len].reshape(S, kv, group * Q, ctx_len) @ v_ctx  # [S, kv, group*Q, d]
        out_blk = p[..., ctx_len:] @ vb  # [S, kv, group, N, B, d]
        out = out_ctx.view(S, h, Q, d) + out_blk.reshape(S, h, Q, d)
        return self.o_proj(out.transpose(1, 2).reshape(S, Q, h * d))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(
        self, h: Tensor, cos: Tensor, sin: Tensor, context: KV, attn_mask: Tensor | BlockMask | None = None
    ) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))
