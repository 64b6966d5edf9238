"""Packed grouped-query attention gives transformers' SDPA results (fp32), in every call shape the engine makes."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from dflashkit.kernels.attention import ATTENTION_NAME, use_packed_gqa
from dflashkit.target.adapter import TargetAdapter
from dflashkit.target.loading import cache_kwargs
from tests.conftest import tiny_target


def _pair(arch: str, **overrides):
    reference = tiny_target(arch, **overrides)
    packed = tiny_target(arch, **overrides)
    assert use_packed_gqa(packed) and packed.config._attn_implementation == ATTENTION_NAME
    assert reference.config._attn_implementation == "sdpa"
    return reference, packed


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_full_sequence_and_left_padding(arch, kv_heads):
    reference, packed = _pair(arch, num_key_value_heads=kv_heads)
    ids = torch.randint(4, 96, (3, 21))
    mask = torch.ones(3, 21, dtype=torch.long)
    mask[0, :7] = 0
    mask[2, :1] = 0
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
        a, b = packed(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("new_tokens", [1, 5, 16])
def test_cached_continuation(arch, new_tokens):
    """A prefill then a span of new tokens on the cache (a decode step or a verify block)."""
    reference, packed = _pair(arch)
    ids = torch.randint(4, 96, (1, 30 + new_tokens))
    outputs = []
    for model in (reference, packed):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :30], use_cache=True, **cache_kwargs(model, cache))
            outputs.append(model(ids[:, 30:], use_cache=True, **cache_kwargs(model, cache)).logits)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-5)
    with torch.no_grad():
        whole = reference(ids).logits[:, 30:]
    torch.testing.assert_close(outputs[1], whole, rtol=0, atol=1e-4)


def test_adapter_switches_only_sdpa_models():
    model = tiny_target("llama")
    TargetAdapter(model)
    assert model.config._attn_implementation == ATTENTION_NAME
    kept = tiny_target("llama")
    TargetAdapter(kept, packed_attention=False)
    assert kept.config._attn_implementation == "sdpa"
    eager = tiny_target("llama")
    eager.set_attn_implementation("eager")
    assert not use_packed_gqa(eager) and eager.config._attn_implementation == "eager"
