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

import functools
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from .attention import use_packed_gqa
from .errors import InvalidInputError
from .cuda_graphs import Capture, cuda_capture
from .fast_target import FastTargetForward, ForwardCall, StaticKVCache, masked_sdpa
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


GRAPH_CHECKS = 2  # replays of the static step checked against the eager step
GRAPH_CHECK_TOLERANCE = 0.1  # graph vs eager logits: max |difference| / max |logit|


@torch.inference_mode()
def generate_static(forward: FastTargetForward, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    eos_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                    generator: torch.Generator | None = None, graph: Capture | None | str = "auto",
                    prefill_rows: int = 64, check_every: int = 8) -> list[list[int]]:
    """Continue every prompt until an eos token (kept) or ``max_new_tokens``, as one fixed-shape batch; returns the
    new ids. The GPU's data path.

    transformers' decoder spends ~110 ms of host time per decode step of SmolLM2-135M on an H100 whatever the batch
    (256 rows: ~2.3K tok/s, 512: ~4.7K), far above the GPU's work. Here the prompts are left-padded into one
    preallocated cache (keys and values [layers, rows, kv_heads, capacity, head_dim]) and prefilled ``prefill_rows``
    at a time through the fast forward's layers; every decode step then has the same shapes (one token per row,
    written at the same cache column for all rows, attention over the whole capacity under a mask of the columns
    each row holds), so on CUDA it is recorded once as a CUDA graph and replayed (``graph``: "auto" = on CUDA;
    None = eager steps; a :data:`dflashkit.cuda_graphs.Capture` = record with it). The host reads the device only
    every ``check_every`` steps (have all rows ended?) and at the end; ended rows stay in the batch (their later
    tokens dropped). The graph's first two replays are checked against the eager step, and
    the graph dropped for eager steps if they differ. Greedy answers are the fast forward's (a test checks them against
    :func:`generate_batch` in fp32); sampled ones draw from ``generator`` on the batch's device.
    """
    if max_new_tokens < 1 or prefill_rows < 1 or check_every < 1:
        raise InvalidInputError("max_new_tokens, prefill_rows and check_every must be >= 1")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidInputError("need at least one prompt, each of at least one token")
    device, dtype = forward.device, forward.dtype
    if graph == "auto":
        graph = cuda_capture if device.type == "cuda" else None
    elif graph is cuda_capture and device.type != "cuda":
        raise InvalidInputError("CUDA graphs need the target on a CUDA device")
    rows, width = len(prompts), max(len(p) for p in prompts)
    capacity = -(-(width + max_new_tokens - 1) // 16) * 16  # the last token is never written; SDPA likes x16
    layers, kv_heads, head_dim = len(forward.layers), forward.kv_heads, forward.head_dim
    group = forward.heads // kv_heads
    keys = torch.zeros(layers, rows, kv_heads, capacity, head_dim, dtype=dtype, device=device)
    values = torch.zeros_like(keys)
    ids = torch.zeros(rows, width, dtype=torch.long)
    held = torch.zeros(rows, capacity, dtype=torch.bool)  # the cache columns that hold one of the row's tokens
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        held[r, width - len(p) : width] = True
    ids, held = ids.to(device), held.to(device)
    positions = (held[:, :width].cumsum(-1) - 1).clamp(min=0)  # [rows, width]: padding shares position 0
    cos_table, sin_table = forward.rotary_tables(capacity + 1)  # [capacity + 1, head_dim]: every position used

    def choose(logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows]
        return argmax(logits) if sampling.greedy else sample(warp(logits, sampling), generator)

    # prefill: rows a..b-1 at a time; query j sees the row's tokens up to j (and itself, so that padding rows,
    # which see nothing else, stay finite)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    own = torch.eye(width, dtype=torch.bool, device=device)
    tokens = torch.empty(rows, dtype=torch.long, device=device)
    for a in range(0, rows, prefill_rows):
        b = min(rows, a + prefill_rows)
        visible = causal[None] & (held[a:b, None, :width] | own[None])  # [chunk, width, width]
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        mask = mask[:, None, None].expand(b - a, 1, group, width, width).reshape(b - a, 1, group * width, width)
        cos = cos_table[positions[a:b]][:, None]  # [chunk, 1, width, head_dim]
        sin = sin_table[positions[a:b]][:, None]

        def write_prefill(i: int, k: torch.Tensor, v: torch.Tensor, a: int = a, b: int = b
                          ) -> tuple[torch.Tensor, torch.Tensor]:  # k, v: [chunk, kv_heads, width, head_dim]
            keys[i, a:b, :, :width], values[i, a:b, :, :width] = k, v
            return k, v

        x, _ = forward.run_layers(forward.embed(ids[a:b]), cos, sin, functools.partial(masked_sdpa, mask=mask),
                                  write_prefill, [])
        tokens[a:b] = choose(forward.head(forward.final_norm(x[:, -1])))  # [chunk]

    # decode: the step's state lives in tensors, so that a graph of it replays at every step
    position = positions[:, -1] + 1  # [rows]: the position of the token being decoded
    column = torch.full((1,), width, dtype=torch.long, device=device)  # the cache column it is written at
    mask = torch.zeros(rows, 1, 1, capacity, dtype=dtype, device=device)  # additive: 0 = a column the row holds
    mask.masked_fill_(~held[:, None, None], float("-inf"))
    logits = torch.empty(rows, forward.head.weight.shape[0], dtype=dtype, device=device)  # the step's output

    def step() -> None:
        mask.index_fill_(-1, column, 0.0)
        cos, sin = cos_table[position][:, None, None], sin_table[position][:, None, None]  # [rows, 1, 1, head_dim]

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, kv, 1, d]
            keys[i].index_copy_(2, column, k)
            values[i].index_copy_(2, column, v)
            return keys[i], values[i]

        x, _ = forward.run_layers(forward.embed(tokens[:, None]), cos, sin, functools.partial(masked_sdpa, mask=mask),
                                  write, [])
        logits.copy_(forward.head(forward.final_norm(x[:, 0])))  # [rows, vocab]

    # the step only writes the cache column and mask entry of the current state and the logits, so running it
    # again (eagerly, to check a replay) changes nothing else
    replay = graph(step, None) if graph is not None and max_new_tokens > 1 else None
    checks = GRAPH_CHECKS
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    ended = torch.isin(tokens, eos)  # [rows]
    generated = [tokens.clone()]
    for s in range(1, max_new_tokens):
        if s % check_every == 0 and bool(ended.all()):
            break
        if replay is None:
            step()
        else:
            replay()
            if checks:  # the first replays, at the capture's state and at the next one
                checks -= 1
                replayed = logits.to(torch.float32, copy=True)  # (.float() of fp32 logits is the buffer itself)
                step()
                scale = logits.float().abs().max().clamp(min=1e-6)
                if float((replayed - logits.float()).abs().max() / scale) > GRAPH_CHECK_TOLERANCE:
                    warnings.warn("generate_static: a CUDA graph's step disagreed with the eager step; decoding "
                                  "without the graph", RuntimeWarning, stacklevel=2)
                    replay = None
        tokens.copy_(choose(logits))
        generated.append(tokens.clone())
        ended |= torch.isin(tokens, eos)
        position += 1
        column += 1
    table = torch.stack(generated, dim=1).tolist()  # [rows, steps]: the one read of the tokens
    eos_set = set(eos_ids)
    outputs = []
    for answer in table:
        end = next((j + 1 for j, t in enumerate(answer) if t in eos_set), len(answer))
        outputs.append(answer[:end])
    return outputs
