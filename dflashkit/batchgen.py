"""Batched autoregressive generation for training-data regeneration, lean enough for a 2-core CPU.

transformers' ``generate`` spends most of a batched CPU run on things that are not the model: at batch 57
with ~290-token prompts (SmolLM2-135M, bf16, 2 threads), its prefill took 17 s, 6.4 s of it copying the LM
head weight once per row (``logits_to_keep`` slices the hidden states into a non-contiguous view, and
``linear`` then falls back to a batched matmul over an expanded weight); finished rows keep being computed
until the longest one ends. This loop runs the decoder, applies the LM head to the contiguous last
hidden states only, and drops finished rows from the batch and the cache (``Cache.batch_select_indices``).
Attention uses :mod:`dflashkit.attention`. Greedy results equal per-prompt ``generate`` (a test checks).

Dropping rows copies the whole KV cache. On a CPU a finished row's compute costs more than that copy, so rows
leave as soon as they end; on a GPU a step of 1,024 rows costs what a step of 512 costs (the CPU launching
kernels bounds it: SmolLM2-135M, H100, batch 256 ~2.3K tok/s, batch 512 4.7K) while a copy of a 1,024-row
cache is not free, so there finished rows stay in the batch (their tokens ignored) until a quarter of it has
ended (``compact_fraction``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from .attention import use_packed_gqa
from .linear import pack_linears
from .models import cache_kwargs
from .sampling import SamplingParams, argmax, sample, warp


@torch.inference_mode()
def generate_batch(model: PreTrainedModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   eos_ids: Sequence[int], pad_id: int, sampling: SamplingParams = SamplingParams(),
                   generator: torch.Generator | None = None,
                   compact_fraction: float | None = None) -> list[list[int]]:
    """Continue every prompt (token ids) until an eos token (kept) or ``max_new_tokens``; returns the new ids.

    Prompts are left-padded into one batch. Finished rows leave the batch once they are at least
    ``compact_fraction`` of it (None: 0 on a CPU, i.e. as soon as each ends; 0.25 elsewhere); greedy outputs do
    not depend on it (sampled ones are drawn from the same distributions, with other random numbers).
    """
    use_packed_gqa(model)
    pack_linears(model)  # bf16 products unchanged, ~2x faster GEMMs at these batch sizes (dflashkit.linear)
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    device = lm_head.weight.device
    rows, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for r, ids in enumerate(prompts):
        input_ids[r, width - len(ids) :] = torch.as_tensor(list(ids), dtype=torch.long)
        mask[r, width - len(ids) :] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [rows, width]: padding shares position 0
    eos = set(eos_ids)

    cache = DynamicCache(config=model.config)
    outputs: list[list[int]] = [[] for _ in range(rows)]
    if compact_fraction is None:
        compact_fraction = 0.0 if device.type == "cpu" else 0.25
    alive = list(range(rows))  # original row of each batch row
    done = [False] * rows  # batch rows that ended (still in the batch until the next compaction)
    next_position = positions[:, -1] + 1  # [rows]
    hidden = decoder(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                     use_cache=True, **cache_kwargs(decoder, cache)).last_hidden_state[:, -1]  # [rows, hidden]
    for step in range(max_new_tokens):
        logits = lm_head(hidden.contiguous())  # [alive, vocab]
        if sampling.greedy:
            tokens = argmax(logits)
        else:
            tokens = sample(warp(logits, sampling), generator)
        for i, (r, t) in enumerate(zip(alive, tokens.tolist())):  # the step's one read from the device
            if not done[i]:
                outputs[r].append(t)
                done[i] = t in eos
        finished = sum(done)
        if step + 1 == max_new_tokens or finished == len(done):
            break
        if finished > compact_fraction * len(done):  # drop the finished rows from the batch and the cache
            kept = [i for i, ended in enumerate(done) if not ended]
            keep = torch.tensor(kept, device=device)
            cache.batch_select_indices(keep)
            tokens, mask, next_position = tokens[keep], mask[keep], next_position[keep]
            alive, done = [alive[i] for i in kept], [False] * len(kept)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)  # [alive, seen + 1]
        hidden = decoder(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                         use_cache=True, **cache_kwargs(decoder, cache)).last_hidden_state[:, -1]
        next_position = next_position + 1
    return outputs
