"""Batched autoregressive generation for training-data regeneration, lean enough for a 2-core CPU.

transformers' ``generate`` spends most of a batched CPU run on things that are not the model: at batch 57
with ~290-token prompts (SmolLM2-135M, bf16, 2 threads), its prefill took 17 s, 6.4 s of it copying the LM
head weight once per row (``logits_to_keep`` slices the hidden states into a non-contiguous view, and
``linear`` then falls back to a batched matmul over an expanded weight); finished rows keep being computed
until the longest one ends. This loop runs the decoder, applies the LM head to the contiguous last
hidden states only, and drops finished rows from the batch and the cache (``Cache.batch_select_indices``).
Attention uses :mod:`dflashkit.kernels.attention`. Greedy results equal per-prompt ``generate`` (a test checks).

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

from dflashkit.decoding.sampling import SamplingParams, argmax, sample, warp
from dflashkit.errors import InvalidInputError
from dflashkit.kernels.attention import use_packed_gqa
from dflashkit.kernels.cuda_graphs import Capture, cuda_capture
from dflashkit.kernels.linear import pack_linears
from dflashkit.target.fast import FastTargetForward, ForwardCall, StaticKVCache, masked_sdpa
from dflashkit.target.loading import cache_kwargs


@torch.inference_mode()
def generate_batch(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    sampling: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    compact_fraction: float | None = None,
) -> list[list[int]]:
    """Continue every prompt (token ids) until an eos token (kept) or ``max_new_tokens``; returns the new ids.

    Prompts are left-padded into one batch. Finished rows leave the batch once they are at least
    ``compact_fraction`` of it (None: 0 on a CPU, i.e. as soon as each ends; 0.25 elsewhere); greedy outputs do
    not depend on it (sampled ones are drawn from the same distributions, with other random numbers).
    """
    use_packed_gqa(model)
    pack_linears(model)  # bf16 products unchanged, ~2x faster GEMMs at these batch sizes (dflashkit.kernels.linear)
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
    hidden = decoder(
        input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache_kwargs(decoder, cache)
    ).last_hidden_state[:, -1]  # [rows, hidden]
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
        hidden = decoder(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=next_position[:, None],
            use_cache=True,
            **cache_kwargs(decoder, cache),
        ).last_hidden_state[:, -1]
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
def generate_continuous(
    forward: FastTargetForward,
    prompts: Sequence[Sequence[int]],
    *,
    slots: int,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    sampling: SamplingParams = SamplingParams(),
    seeds: Sequence[int] | None = None,
) -> Iterator[tuple[int, list[int]]]:
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
        calls = [
            ForwardCall(torch.tensor([[a.tokens[-1]]], device=device), a.cache.length, a.cache, 1) for a in answering
        ]
        limit = max(1, forward.batch_row_limit)
        logits = torch.cat(
            [rows for c in range(0, len(calls), limit) for rows, _ in forward.batch(calls[c : c + limit], [])]
        )  # [slots in use, vocab]
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
def generate_static(
    forward: FastTargetForward,
    prompts: Sequence[Sequence[int]],
    *,
    slots: int,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    sampling: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    graph: Capture | None | str = "auto",
    prefill_rows: int = 64,
    check_every: int = 8,
) -> Iterator[tuple[int, list[int]]]:
    """Yields (prompt index, new ids) as each answer ends (an eos token, kept, or ``max_new_tokens``), ``slots``
    prompts decoding together in one fixed-shape batch, an ended prompt's slot taking the next prompt. The GPU's
    data path.

    transformers' decoder spends ~100 ms of host time per decode step of SmolLM2-135M on a GPU whatever the batch
    (H100: 256 rows ~2.3K tok/s, 512 rows ~4.7K). Here every slot has one row of a preallocated cache (keys and
    values [layers, slots, kv_heads, capacity, head_dim]) used as a ring: every decode step writes each slot's token
    at the same column, the next one each step, and attends over the whole ring under a mask of the columns the slot
    holds (a prompt of L tokens plus its answer never spans more than the capacity, so nothing it holds is
    overwritten while it runs). The step's shapes never change, so on CUDA it is recorded once as a CUDA graph and
    replayed (``graph``: "auto" = on CUDA; None = eager steps; a :data:`dflashkit.kernels.cuda_graphs.Capture` = record
    with
    it); its first two replays are checked against the eager step and the graph dropped if they differ. The host
    reads the tokens every ``check_every`` steps: answers that ended are yielded and their slots prefilled
    (``prefill_rows`` prompts at a time, through the fast forward's layers) with the next prompts at the columns just
    before the next step's; slots without a prompt left idle. A slot steps on for up to ``check_every - 1`` tokens
    after its answer ends (dropped). Greedy answers are the fast forward's (tests check them against transformers'
    generate in fp32); sampled ones draw from ``generator`` on the batch's device, so they depend on the slots.
    """
    if slots < 1 or max_new_tokens < 1 or prefill_rows < 1 or check_every < 1:
        raise InvalidInputError("slots, max_new_tokens, prefill_rows and check_every must be >= 1")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidInputError("need at least one prompt, each of at least one token")
    device, dtype = forward.device, forward.dtype
    if graph == "auto":
        graph = cuda_capture if device.type == "cuda" else None
    elif graph is cuda_capture and device.type != "cuda":
        raise InvalidInputError("CUDA graphs need the target on a CUDA device")
    rows = min(slots, len(prompts))
    longest = max(len(p) for p in prompts)
    capacity = -(-(longest + max_new_tokens - 1) // 16) * 16  # ring columns; x16 suits SDPA's kernels
    layers, kv_heads, head_dim = len(forward.layers), forward.kv_heads, forward.head_dim
    group = forward.heads // kv_heads
    keys = torch.zeros(layers, rows, kv_heads, capacity, head_dim, dtype=dtype, device=device)
    values = torch.zeros_like(keys)
    cos_table, sin_table = forward.rotary_tables(longest + max_new_tokens + check_every)  # [positions, head_dim]
    tokens = torch.zeros(rows, dtype=torch.long, device=device)  # each slot's token to decode next
    position = torch.zeros(rows, dtype=torch.long, device=device)  # its position
    column = torch.zeros(1, dtype=torch.long, device=device)  # the ring column the next step writes
    mask = torch.zeros(rows, 1, 1, capacity, dtype=dtype, device=device)  # additive: 0 = a column the slot holds
    logits = torch.empty(rows, forward.head.weight.shape[0], dtype=dtype, device=device)  # the step's output

    def choose(scores: torch.Tensor) -> torch.Tensor:  # [n, vocab] -> [n]
        return argmax(scores) if sampling.greedy else sample(warp(scores, sampling), generator)

    def prefill(slots_: list[int], batch: list[Sequence[int]], at: int) -> torch.Tensor:
        """Write the prompts into the slots' rows at the ring columns just before ``at``; their first tokens."""
        width = max(len(p) for p in batch)
        n = len(batch)
        ids = torch.zeros(n, width, dtype=torch.long)
        real = torch.zeros(n, width, dtype=torch.bool)
        for j, p in enumerate(batch):
            ids[j, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            real[j, width - len(p) :] = True
        ids, real = ids.to(device), real.to(device)
        where = torch.nonzero(real)  # [tokens, 2]: (prompt j, its column in the padded batch), row-major
        lengths = real.sum(-1)  # [n]
        target_rows = torch.tensor(slots_, device=device)[where[:, 0]]
        target_cols = (at - width + where[:, 1]) % capacity  # a prompt's last token just before column `at`
        positions = (real.cumsum(-1) - 1).clamp(min=0)  # [n, width]: padding shares position 0
        visible = torch.ones(width, width, dtype=torch.bool, device=device).tril()[None] & (
            real[:, None, :] | torch.eye(width, dtype=torch.bool, device=device)[None]
        )  # padding sees itself
        scores = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        scores = scores[:, None, None].expand(n, 1, group, width, width).reshape(n, 1, group * width, width)

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # k, v: [n, kv_heads, width, head_dim] -> the slots' ring columns, real tokens only
            keys[i][target_rows, :, target_cols] = k.transpose(1, 2)[where[:, 0], where[:, 1]]
            values[i][target_rows, :, target_cols] = v.transpose(1, 2)[where[:, 0], where[:, 1]]
            return k, v

        cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]  # [n, 1, width, head_dim]
        x, _ = forward.run_layers(forward.embed(ids), cos, sin, functools.partial(masked_sdpa, mask=scores), write, [])
        index = torch.tensor(slots_, device=device)
        held = torch.full((n, capacity), float("-inf"), dtype=dtype, device=device)
        held[where[:, 0], target_cols] = 0.0
        mask[index] = held[:, None, None]
        position[index] = lengths
        first = choose(forward.head(forward.final_norm(x[:, -1])))  # [n]
        tokens[index] = first
        return first

    def step() -> None:
        mask.index_fill_(-1, column, 0.0)
        cos, sin = cos_table[position][:, None, None], sin_table[position][:, None, None]  # [slots, 1, 1, head_dim]

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [slots, kv, 1, d]
            keys[i].index_copy_(2, column, k)
            values[i].index_copy_(2, column, v)
            return keys[i], values[i]

        x, _ = forward.run_layers(
            forward.embed(tokens[:, None]), cos, sin, functools.partial(masked_sdpa, mask=mask), write, []
        )
        logits.copy_(forward.head(forward.final_norm(x[:, 0])))  # [slots, vocab]

    eos = set(eos_ids)
    waiting = deque(range(len(prompts)))
    answering: list[int | None] = [None] * rows  # each slot's prompt index (None: idle)
    answers: dict[int, list[int]] = {}

    def fill(free: list[int], at: int) -> Iterator[tuple[int, list[int]]]:
        """Give the free slots the next prompts (yielding answers that end with their first token)."""
        while free and waiting:
            taken = [(free.pop(0), waiting.popleft()) for _ in range(min(len(free), prefill_rows, len(waiting)))]
            first = prefill([r for r, _ in taken], [prompts[i] for _, i in taken], at).tolist()
            for (r, i), t in zip(taken, first):
                answering[r], answers[i] = i, [t]
                if t in eos or max_new_tokens == 1:
                    answering[r] = None
                    free.append(r)
                    yield i, answers.pop(i)

    yield from fill(list(range(rows)), 0)
    replay, checks = None, GRAPH_CHECKS
    if graph is not None and any(a is not None for a in answering):
        replay = graph(step, None)  # the step writes only its state's column, mask entry and the logits: rerunnable
    recent: list[torch.Tensor] = []
    while any(a is not None for a in answering):
        for _ in range(check_every):
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
                        warnings.warn(
                            "generate_static: a CUDA graph's step disagreed with the eager step; decoding "
                            "without the graph",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                        replay = None
            tokens.copy_(choose(logits))
            recent.append(tokens.clone())
            position += 1
            column.add_(1).remainder_(capacity)
        block = torch.stack(recent, dim=1).tolist()  # [slots, check_every]: the check's one read of the tokens
        recent.clear()
        free = []
        for r, i in enumerate(answering):
            if i is None:
                continue
            answer = answers[i]
            for t in block[r]:
                answer.append(t)
                if t in eos or len(answer) == max_new_tokens:
                    answering[r] = None
                    free.append(r)
                    yield i, answers.pop(i)
                    break
        idle = [r for r, i in enumerate(answering) if i is None]
        position[torch.tensor(idle, dtype=torch.long, device=device)] = 0  # keeps idle slots inside the tables
        yield from fill(free, int(column))
