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

:func:`generate_continuous` is the CPU's loop: decoder-only targets that :class:`FastTargetForward` covers decode
on it, every waiting prompt's next token in one pass (the weights stream from memory once for up to
``max_batch_rows`` rows, each prompt attends over its own cache) and a finished prompt's slot taking the next
prompt at once (continuous batching), so the batch stays full until the prompts run out instead of shrinking
to its longest answer's last rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from .attention import use_packed_gqa
from .errors import InvalidInputError
from .fast_target import FastTargetForward, ForwardCall, StaticKVCache
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


@dataclass
class _Answering:
    """One prompt being answered in a :func:`generate_continuous` slot."""

    index: int  # the prompt's index
    cache: StaticKVCache
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # the answer so far


@torch.inference_mode()
def generate_continuous(forward: FastTargetForward, prompts: Sequence[Sequence[int]], *, slots: int,
                        max_new_tokens: int, eos_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                        seeds: Sequence[int] | None = None) -> Iterator[tuple[int, list[int]]]:
    """Yields (prompt index, new ids) as each answer ends (an eos token, kept, or ``max_new_tokens``), up to
    ``slots`` prompts decoding together, in the order the answers end.

    Each step runs every slot's next token through :meth:`FastTargetForward.batch`, whose rows are each computed
    on their own: an answer is the one its prompt decoded alone on this forward gives, whatever the slots or the
    other prompts (greedy; sampled answers draw from a generator per prompt seeded with ``seeds[i]``, so they do
    not depend on the batching either). A prompt is prefilled when a slot takes it.
    """
    if slots < 1 or max_new_tokens < 1:
        raise InvalidInputError(f"need slots >= 1 and max_new_tokens >= 1 (got {slots}, {max_new_tokens})")
    if any(len(p) == 0 for p in prompts):
        raise InvalidInputError("every prompt needs at least one token")
    if seeds is not None and len(seeds) != len(prompts):
        raise InvalidInputError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    if not sampling.greedy and seeds is None:
        raise InvalidInputError("sampling needs a seed per prompt")
    eos = set(eos_ids)
    device = forward.device
    capacity = max((len(p) for p in prompts), default=1) + max_new_tokens
    waiting, spare = deque(range(len(prompts))), []  # prompts not yet taken; caches of finished answers
    answering: list[_Answering] = []

    def pick(logits: torch.Tensor, rows: list[_Answering]) -> list[int]:  # logits [rows, vocab]
        if sampling.greedy:
            return argmax(logits).tolist()
        return [int(sample(warp(logits[r : r + 1], sampling), a.generator)[0]) for r, a in enumerate(rows)]

    def ended(a: _Answering, token: int) -> bool:
        a.tokens.append(token)
        return token in eos or len(a.tokens) == max_new_tokens

    while waiting or answering:
        while waiting and len(answering) < slots:  # free slots take the next prompts
            i = waiting.popleft()
            cache = spare.pop() if spare else forward.new_cache(capacity)
            cache.crop(0)
            generator = None
            if seeds is not None:
                generator = torch.Generator(device=device).manual_seed(int(seeds[i]))
            a = _Answering(i, cache, generator)
            logits, _ = forward(torch.tensor([list(prompts[i])], device=device), 0, cache, 1, [])  # [1, vocab]
            if ended(a, pick(logits, [a])[0]):
                spare.append(cache)
                yield i, a.tokens
            else:
                answering.append(a)
        if not answering:
            continue
        calls = [ForwardCall(torch.tensor([[a.tokens[-1]]], device=device), a.cache.length, a.cache, 1)
                 for a in answering]
        limit = max(1, forward.batch_row_limit)
        logits = torch.cat([rows for c in range(0, len(calls), limit)
                            for rows, _ in forward.batch(calls[c : c + limit], [])])  # [slots in use, vocab]
        still = []
        for a, token in zip(answering, pick(logits, answering)):
            if ended(a, token):
                spare.append(a.cache)
                yield a.index, a.tokens
            else:
                still.append(a)
        answering = still
