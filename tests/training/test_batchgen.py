"""Batched regeneration equals per-prompt generation (greedy): transformers' decoder in static batches, rows leaving
the batch as they end, and continuous batching on the fast forward."""

from __future__ import annotations

import pytest
import torch

from dflashkit.decoding.sampling import SamplingParams
from dflashkit.errors import InvalidInputError
from dflashkit.kernels import row_kernels
from dflashkit.target.fast import FastTargetForward
from dflashkit.training.batchgen import generate_batch, generate_continuous, generate_static
from tests.conftest import ReplayCapture, frozen, tiny_target

EOS = 2
needs_kernels = pytest.mark.skipif(row_kernels.kernel() is None, reason="the CPU row kernels do not run here")


def _alone(model, ids, max_new_tokens, eos):
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    new = out[0, len(ids) :].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


def _prompts_and_eos(model, count: int = 9, seed: int = 0):
    """Random prompts of 1-29 tokens and, as "eos", the token whose first occurrences in unstopped continuations
    fall at the most different steps, so that answers end (and leave the batch) at different steps."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(4, 96, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (count,), generator=g)
    ]
    free = generate_batch(model, prompts, max_new_tokens=20, eos_ids=[0], pad_id=0)
    eos = max(range(4, 96), key=lambda t: len({row.index(t) for row in free if t in row[:-1]}))
    return prompts, eos


@pytest.mark.parametrize(
    "arch,compact_fraction", [("llama", None), ("qwen2", None), ("qwen3", None), ("llama", 0.3), ("llama", 1.0)]
)
def test_greedy_batch_equals_each_prompt_alone(arch, compact_fraction):
    """Rows leave the batch as they end (None on a CPU), once 30% have ended, or never (1.0): same tokens."""
    model = tiny_target(arch, tie_word_embeddings=False)  # a tied tiny model greedily repeats its last token
    prompts, eos = _prompts_and_eos(model)
    batched = generate_batch(
        model, prompts, max_new_tokens=20, eos_ids=[eos], pad_id=0, compact_fraction=compact_fraction
    )
    assert len({len(r) for r in batched}) > 2, "the test needs rows that end at different steps"
    for ids, got in zip(prompts, batched):
        assert got == _alone(model, ids, 20, eos)


def test_sampling_is_seeded_and_stops_at_eos():
    model = tiny_target("llama")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    params = SamplingParams(temperature=1.0, top_p=0.9)
    a = generate_batch(
        model,
        prompts,
        max_new_tokens=15,
        eos_ids=[EOS],
        pad_id=0,
        sampling=params,
        generator=torch.Generator().manual_seed(3),
    )
    b = generate_batch(
        model,
        prompts,
        max_new_tokens=15,
        eos_ids=[EOS],
        pad_id=0,
        sampling=params,
        generator=torch.Generator().manual_seed(3),
    )
    assert a == b
    for row in a:
        assert 1 <= len(row) <= 15 and EOS not in row[:-1]


# ---- continuous batching on the fast forward -----------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_continuous_greedy_equals_each_prompt_alone(arch):
    """fp32: every answer equals transformers' generate on that prompt alone, whatever the slots (1: one prompt at
    a time; 4: slots refilled as answers end; 20: all at once)."""
    model = tiny_target(arch, tie_word_embeddings=False)
    prompts, eos = _prompts_and_eos(model)
    forward = FastTargetForward(model)
    for slots in (1, 4, 20):
        answers = dict(generate_continuous(forward, prompts, slots=slots, max_new_tokens=20, eos_ids=[eos]))
        assert sorted(answers) == list(range(len(prompts)))
        assert len({len(a) for a in answers.values()}) > 2, "the test needs answers that end at different steps"
        for i, ids in enumerate(prompts):
            assert answers[i] == _alone(model, ids, 20, eos), (slots, i)


def test_continuous_answers_come_as_they_end():
    """With room for every prompt, shorter answers are yielded first."""
    model = tiny_target("llama", tie_word_embeddings=False)
    prompts, eos = _prompts_and_eos(model)
    order = [
        len(a)
        for _, a in generate_continuous(
            FastTargetForward(model), prompts, slots=len(prompts), max_new_tokens=20, eos_ids=[eos]
        )
    ]
    assert order == sorted(order)


@needs_kernels
def test_continuous_bf16_answers_are_bitwise_each_prompt_decoded_alone(monkeypatch):
    """bf16 on the row kernels: steps of several prompts run as single passes (counted), and every answer is the
    one the fast forward gives decoding that prompt alone, token by token."""
    model = tiny_target("qwen3", dtype=torch.bfloat16, tie_word_embeddings=False)
    forward = FastTargetForward(model)
    assert forward.fused_weights is not None
    prompts, eos = _prompts_and_eos(model, count=12, seed=1)
    passes = []
    one_call = row_kernels.decoder_layers_batch
    monkeypatch.setattr(row_kernels, "decoder_layers_batch", lambda *a, **k: passes.append(1) or one_call(*a, **k))
    answers = dict(generate_continuous(forward, prompts, slots=5, max_new_tokens=16, eos_ids=[eos]))
    assert passes, "no step ran as a batched pass"
    for i, ids in enumerate(prompts):
        cache, alone = forward.new_cache(64), []
        logits, _ = forward(torch.tensor([ids]), 0, cache, 1, [])
        while True:
            alone.append(int(logits.float().argmax()))
            if alone[-1] == eos or len(alone) == 16:
                break
            logits, _ = forward(torch.tensor([[alone[-1]]]), cache.length, cache, 1, [])
        assert answers[i] == alone, i


def test_continuous_sampling_draws_each_answer_with_its_own_seed():
    model = tiny_target("llama", tie_word_embeddings=False)
    forward = FastTargetForward(model)
    prompts, eos = _prompts_and_eos(model)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    seeds = [100 + i for i in range(len(prompts))]
    runs = [
        dict(
            generate_continuous(
                forward, prompts, slots=slots, max_new_tokens=15, eos_ids=[eos], sampling=params, seeds=seeds
            )
        )
        for slots in (1, 3, 9)
    ]
    assert runs[0] == runs[1] == runs[2]
    other = dict(
        generate_continuous(
            forward, prompts, slots=3, max_new_tokens=15, eos_ids=[eos], sampling=params, seeds=[s + 1 for s in seeds]
        )
    )
    assert other != runs[0]
    for answer in runs[0].values():
        assert 1 <= len(answer) <= 15 and eos not in answer[:-1]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(slots=0), "slots"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(prompts=[[5], []]), "at least one"),
        (dict(seeds=[1]), "seeds for"),
        (dict(sampling=SamplingParams(temperature=1.0)), "seed per prompt"),
    ],
)
def test_continuous_refuses_bad_arguments(kwargs, message):
    forward = FastTargetForward(tiny_target("llama"))
    call = dict(prompts=[[5, 6], [7]], slots=2, max_new_tokens=4, eos_ids=[EOS]) | kwargs
    with pytest.raises(InvalidInputError, match=message):
        list(generate_continuous(forward, call.pop("prompts"), **call))


# ---- one fixed-shape batch on the fast forward (the GPU's data path) -------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_static_greedy_equals_each_prompt_alone(arch):
    """fp32: every answer equals transformers' generate on that prompt alone, whatever the slots (1: one prompt at
    a time; 2 or 4: slots refilled as answers end, at ring columns that wrap around; 20: all at once), the prompts
    prefilled per slot or together, the host reading the tokens every step or every third or eighth, and the decode
    steps run eagerly or replayed from a (stand-in) capture."""
    model = tiny_target(arch, tie_word_embeddings=False)
    prompts, eos = _prompts_and_eos(model)
    forward = FastTargetForward(model)
    expected = [_alone(model, ids, 20, eos) for ids in prompts]
    assert len({len(a) for a in expected}) > 2, "the test needs answers that end at different steps"
    capture = ReplayCapture()
    for slots, prefill_rows, check_every, graph in (
        (1, 1, 1, None),
        (2, 1, 2, None),
        (4, 2, 3, capture),
        (20, 20, 8, None),
    ):
        got = dict(
            generate_static(
                forward,
                prompts,
                slots=slots,
                max_new_tokens=20,
                eos_ids=[eos],
                prefill_rows=prefill_rows,
                check_every=check_every,
                graph=graph,
            )
        )
        assert sorted(got) == list(range(len(prompts)))
        assert [got[i] for i in range(len(prompts))] == expected, (slots, prefill_rows, check_every)
    assert capture.captured == 1


def test_static_answers_come_as_they_end_and_slots_are_refilled():
    """Two slots for nine prompts: answers come in the order they end, and at most two prompts are in flight."""
    model = tiny_target("llama", tie_word_embeddings=False)
    prompts, eos = _prompts_and_eos(model)
    forward = FastTargetForward(model)
    prefilled = []
    original = forward.run_layers
    forward.run_layers = lambda *a, **k: (prefilled.append(a[0].shape[:2]), original(*a, **k))[1]
    order = [i for i, _ in generate_static(forward, prompts, slots=2, max_new_tokens=20, eos_ids=[eos], check_every=1)]
    assert sorted(order) == list(range(len(prompts))) and order != list(range(len(prompts)))
    prefills = [shape for shape in prefilled if shape[1] > 1 or shape[0] != 2]  # decode steps are [2, 1]
    assert sum(rows for rows, _ in prefills) == len(prompts) and max(rows for rows, _ in prefills) <= 2


def test_static_stops_once_every_answer_has_ended():
    """Answers that all end with their first token: cut at eos, and no decode step runs."""
    model = tiny_target("llama", tie_word_embeddings=False)
    prompts, eos = _prompts_and_eos(model)
    forward = FastTargetForward(model)
    first = dict(generate_static(forward, prompts, slots=4, max_new_tokens=1, eos_ids=[eos]))
    assert all(len(a) == 1 for a in first.values())
    steps = []
    original = forward.run_layers
    forward.run_layers = lambda *a, **k: (steps.append(a[0].shape[1] == 1), original(*a, **k))[1]
    answers = dict(
        generate_static(forward, prompts, slots=4, max_new_tokens=50, eos_ids=[t for a in first.values() for t in a])
    )
    assert answers == first
    assert len(steps) == 3 and not any(steps)  # three prefills of up to 4 slots (prompts of one token aside: none)


def test_a_frozen_static_graph_falls_back_to_eager_steps():
    model = tiny_target("llama", tie_word_embeddings=False)
    prompts, eos = _prompts_and_eos(model)
    forward = FastTargetForward(model)
    with pytest.warns(RuntimeWarning, match="disagreed"):
        got = dict(generate_static(forward, prompts, slots=4, max_new_tokens=20, eos_ids=[eos], graph=frozen))
    assert got == dict(generate_static(forward, prompts, slots=4, max_new_tokens=20, eos_ids=[eos], graph=None))


def test_static_sampling_is_seeded_and_stops_at_eos():
    model = tiny_target("llama", tie_word_embeddings=False)
    forward = FastTargetForward(model)
    prompts, eos = _prompts_and_eos(model)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    runs = [
        dict(
            generate_static(
                forward,
                prompts,
                slots=4,
                max_new_tokens=15,
                eos_ids=[eos],
                sampling=params,
                generator=torch.Generator().manual_seed(seed),
            )
        )
        for seed in (3, 3, 4)
    ]
    assert runs[0] == runs[1] != runs[2]
    for answer in runs[0].values():
        assert 1 <= len(answer) <= 15 and eos not in answer[:-1]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(slots=0), "slots"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(prompts=[[5], []]), "at least one"),
        (dict(prompts=[]), "at least one"),
        (dict(prefill_rows=0), "prefill_rows"),
    ],
)
def test_static_refuses_bad_arguments(kwargs, message):
    forward = FastTargetForward(tiny_target("llama"))
    call = dict(prompts=[[5, 6], [7]], slots=2, max_new_tokens=4, eos_ids=[EOS]) | kwargs
    with pytest.raises(InvalidInputError, match=message):
        list(generate_static(forward, call.pop("prompts"), **call))


def test_static_cuda_graphs_need_a_cuda_device():
    from dflashkit.kernels.cuda_graphs import cuda_capture

    with pytest.raises(InvalidInputError, match="CUDA"):
        list(
            generate_static(
                FastTargetForward(tiny_target("llama")),
                [[5, 6]],
                slots=1,
                max_new_tokens=4,
                eos_ids=[EOS],
                graph=cuda_capture,
            )
        )
