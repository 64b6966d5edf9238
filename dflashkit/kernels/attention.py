"""Grouped-query attention that is fast on a CPU, registered as a transformers attention implementation.

transformers' "sdpa" attention hands grouped-query models (SmolLM2: 9 query heads, 3 key/value heads) to
``scaled_dot_product_attention`` with ``enable_gqa=True``; on the CPU that path is slow for short queries
(on a 2-core AMD EPYC with AVX512-BF16, bf16, 400 cached positions: 0.21 ms per layer for one sequence and one
new token, 12.3 ms for a batch of 64), and "eager" copies every key/value head ``group`` times.
Packing the query heads that share a key/value head into one longer query block
(``[batch, heads, q, dim] -> [batch, kv_heads, group*q, dim]``) gives the same attention with plain
SDPA and no copy of the cache: 0.05 ms and 2.1 ms for the cases above. The maths is unchanged (fp32
accumulation inside SDPA); only the kernel's work layout differs.

Use :func:`use_packed_gqa` on a loaded model; other devices and unusual calls (attention sinks, masks with
per-head entries) fall back to transformers' own SDPA function.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTENTION_NAME = "packed_gqa"  # no "flash" in the name: transformers would look for a flash kernel


def packed_gqa_attention(
    module: nn.Module,
    query: Tensor,  # [batch, heads, q_len, head_dim]
    key: Tensor,  # [batch, kv_heads, kv_len, head_dim]
    value: Tensor,  # [batch, kv_heads, kv_len, head_dim]
    attention_mask: Tensor | None,  # bool [batch, 1, q_len, >= kv_len] (True = attend) or None (causal)
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: SDPA over packed query groups; returns [batch, q_len, heads, head_dim]."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    per_head_mask = attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1)
    if (
        query.device.type != "cpu"
        or heads % kv_heads
        or per_head_mask
        or kwargs.get("s_aux") is not None
        or attention_mask is not None
        and attention_mask.dtype != torch.bool
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    group = heads // kv_heads
    mask = attention_mask
    if mask is not None:
        mask = mask[..., :kv_len]
    elif q_len > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        # query i sits at position kv_len - q_len + i and sees keys up to it
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)[None, None]
    if mask is not None and group > 1 and q_len > 1:
        rows = mask.shape[0]
        mask = mask[:, :, None].expand(rows, 1, group, q_len, kv_len).reshape(rows, 1, group * q_len, kv_len)
    packed = query.reshape(batch, kv_heads, group * q_len, head_dim)  # [batch, kv_heads, group*q_len, head_dim]
    out = F.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, scale=scaling, dropout_p=dropout if module.training else 0.0
    )
    out = out.reshape(batch, heads, q_len, head_dim).transpose(1, 2).contiguous()  # [batch, q_len, heads, head_dim]
    return out, None


def register() -> None:
    """Register :func:`packed_gqa_attention` with transformers under :data:`ATTENTION_NAME` (a dictionary entry:
    idempotent). Done by :func:`use_packed_gqa`, never on import."""
    AttentionInterface.register(ATTENTION_NAME, packed_gqa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_packed_gqa(model: PreTrainedModel) -> bool:
    """Switch ``model`` from transformers' "sdpa" attention to :func:`packed_gqa_attention`.

    Only models that use "sdpa" are switched (eager, flash or flex choices are the user's); returns whether
    the model now uses the packed implementation.
    """
    current = getattr(model.config, "_attn_implementation", None)
    if current == ATTENTION_NAME:
        return True
    if current != "sdpa":
        return False
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    return model.config._attn_implementation == ATTENTION_NAME
