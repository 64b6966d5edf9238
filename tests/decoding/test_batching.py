"""Batched generation (dflashkit.decoding.batching): several sequences' target passes in one, outputs unchanged."""

from __future__ import annotations

import threading

import pytest
import torch

from dflashkit import SpeculativeGenerator
from dflashkit.decoding.batching import ComputeThread, ForwardBatcher, member_thread
from dflashkit.decoding.tree import build_tree
from dflashkit.drafter.fast import FastDrafterForward
from dflashkit.errors import InvalidInputError
from dflashkit.kernels import row_kernels
from dflashkit.target.adapter import TargetAdapter
from dflashkit.target.fast import FastTargetForward, ForwardCall
from tests.conftest import VOCAB, tiny_drafter, tiny_target, word_tokenizer

needs_kernels = pytest.mark.skipif(row_kernels.kernel() is None, reason="the CPU row kernels do not run here")


def _prefilled(forward: FastTargetForward, prompts: list[torch.Tensor]):
    caches = []
    for p in prompts:
        cache = forward.new_cache(64)
        forward(p, 0, cache, 1, [1, 3])
        caches.append(cache)
    return caches


@needs_kernels
@pytest.mark.parametrize("rows", [(5, 1, 3), (9, 16, 12)], ids=["15-rows", "44-rows"])
def test_batched_pass_is_bitwise_each_call_alone(arch, rows, monkeypatch):
    """FastTargetForward.batch over chains of 1-16 rows and a token tree equals each call run alone: logits,
    features, the cache rows written and the cache lengths (bf16, the row kernels' one-call path), also when the
    calls' rows add up to more than one call may have (44: on AMX CPUs batched steps take up to 64 rows)."""
    # AMX's batch limit, on any CPU with the kernels (whose products and attention all compute each row alone): the
    # batch limit and the LM head's rows on the kernel
    monkeypatch.setattr(row_kernels, "max_batch_rows", lambda device=None: 64)
    model = tiny_target(arch, dtype=torch.bfloat16)
    forward = FastTargetForward(model)
    assert forward.fused_weights is not None and forward.batch_row_limit == 64
    passes = []
    one_call = row_kernels.decoder_layers_batch
    monkeypatch.setattr(row_kernels, "decoder_layers_batch", lambda *a, **k: passes.append(1) or one_call(*a, **k))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, VOCAB, (1, n), generator=g) for n in (9, 23, 4, 15)]
    scores = torch.randn(3, VOCAB, generator=g)
    tree = build_tree(scores.log_softmax(-1), None, 5)
    tree_shape = (tree.position_offsets(torch.device("cpu")), tree.attention_mask(torch.device("cpu")))
    steps = [torch.randint(4, VOCAB, (1, n), generator=g) for n in rows] + [torch.tensor([[7] + tree.tokens])]
    trees = [None, None, None, tree_shape]
    alone, together = _prefilled(forward, prompts), _prefilled(forward, prompts)
    expected = [forward(s, p.shape[1], c, s.shape[1], [1, 3], t) for s, p, c, t in zip(steps, prompts, alone, trees)]
    got = forward.batch(
        [ForwardCall(s, p.shape[1], c, s.shape[1], t) for s, p, c, t in zip(steps, prompts, together, trees)], [1, 3]
    )
    assert passes == [1]  # one pass for all four calls
    for (l1, f1), (l2, f2), c1, c2 in zip(expected, got, alone, together):
        assert torch.equal(l1, l2) and torch.equal(f1, f2)
        assert c1.length == c2.length
        assert torch.equal(c1.keys[:, :, : c1.length], c2.keys[:, :, : c2.length])
        assert torch.equal(c1.values[:, :, : c1.length], c2.values[:, :, : c2.length])


@needs_kernels
def test_batched_steps_keep_each_sequence_within_the_row_limit():
    """A batched step runs as one pass only while each sequence's rows fit the one-call limit (its attention runs
    row by row) and all of them the batch limit; otherwise the calls run one after another."""
    forward = FastTargetForward(tiny_target(dtype=torch.bfloat16))
    forward.row_limit, forward.batch_row_limit = 16, 64
    assert forward.batches([16, 16, 16, 16]) and forward.batches([1, 2])
    assert not forward.batches([17, 1])  # one sequence past 16 rows
    assert not forward.batches([16, 16, 16, 16, 1])  # 65 rows in all


@needs_kernels
def test_batched_pass_refuses_a_cache_out_of_step():
    model = tiny_target(dtype=torch.bfloat16)
    adapter = TargetAdapter(model, [1, 3])
    caches = [adapter.new_cache(32), adapter.new_cache(32)]
    calls = [ForwardCall(torch.tensor([[5, 6]]), 0, caches[0], 1), ForwardCall(torch.tensor([[5]]), 3, caches[1], 1)]
    with pytest.raises(InvalidInputError, match="holds 0 positions"):
        adapter.forward_batch(calls)


def _generator(dtype: torch.dtype, block_size: int = 4) -> SpeculativeGenerator:
    model = tiny_target(dtype=dtype)
    return SpeculativeGenerator(model, word_tokenizer(), tiny_drafter(model, block_size=block_size))


PROMPTS = [[1, 5, 9, 11, 5, 9, 11], [1, 40, 41, 42], [1, 7] * 6, [1, 60, 61, 62, 63, 64, 65, 66, 67, 68]]


def _count_batched_passes(monkeypatch) -> list[int]:
    sizes: list[int] = []
    original = TargetAdapter.forward_batch

    def counting(self, calls):
        sizes.append(len(calls))
        return original(self, calls)

    monkeypatch.setattr(TargetAdapter, "forward_batch", counting)
    return sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "options",
    [
        {"block_size": 4, "lookup": False},  # greedy, drafter chains
        {},  # the defaults: adaptive block size, prompt lookup
        {"tree": 5},
        {"temperature": 1.0, "block_size": 4, "lookup": False, "sampler": "rejection"},
        {"temperature": 1.0},  # seeded: coupled sampling, whatever blocks the adaptive policy picks
        # a fixed schedule, so that the logprobs come off verify passes of the same shapes (bitwise equal)
        {"temperature": 0.8, "top_p": 0.9, "logprobs": 2, "block_size": 4, "lookup": False},
    ],
    ids=["greedy", "defaults", "tree", "t1-rejection", "t1-coupled", "t08-logprobs"],
)
def test_generate_batch_equals_each_prompt_alone(dtype, options, monkeypatch):
    """Each result of generate_batch is token for token the prompt's own `generate` (greedy, or sampled with its
    seed), with sequences of different lengths ending at different rounds; the rounds really were batched."""
    if dtype == torch.bfloat16 and row_kernels.kernel() is None:
        pytest.skip("bf16 on this CPU without the row kernels is slow and not batched")
    gen = _generator(dtype)
    seeds = [11, 12, 13, 14]
    lengths = [24, 9, 17, 3]
    expected = []
    for prompt, seed, n in zip(PROMPTS, seeds, lengths):
        expected.append(gen.generate(prompt, max_new_tokens=n, seed=seed, **options))
    sizes = _count_batched_passes(monkeypatch)
    one_call_drafts: list[int] = []  # sequences per one-call drafting step (bf16 on the kernels)
    step = FastDrafterForward.step
    monkeypatch.setattr(
        FastDrafterForward,
        "step",
        lambda self, drafts, embed: one_call_drafts.append(len(drafts)) or step(self, drafts, embed),
    )
    results = [None] * len(PROMPTS)
    # generate_batch takes one set of options; members of one batcher may each have their own (here: lengths)
    compute = ComputeThread()  # served by this thread below, as generate_batch does
    batcher = ForwardBatcher(gen.target, compute)
    members = [batcher.join() for _ in PROMPTS]
    streams = [
        gen.stream(p, max_new_tokens=n, seed=s, batch=m, **options)
        for p, n, s, m in zip(PROMPTS, lengths, seeds, members)
    ]

    def run(i: int) -> None:
        member_thread(compute)
        try:
            for _ in streams[i]:
                pass
            results[i] = streams[i].result
        finally:
            batcher.leave(members[i])
            compute.wake()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    compute.serve(until=lambda: batcher.members == 0)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a batched generation hung"
    for r, e in zip(results, expected):
        assert r is not None and r.token_ids == e.token_ids
        if options.get("logprobs"):
            assert [x.logprob for x in r.logprobs] == [x.logprob for x in e.logprobs]
    assert max(sizes) == len(PROMPTS)  # the first rounds had every sequence in them
    assert batcher.passes < batcher.calls
    if "block_size" in options or "tree" in options:  # (the adaptive policy times plain steps first: none here)
        assert 0 < batcher.draft_rounds < batcher.drafts  # drafting steps ran together too
        if dtype == torch.bfloat16:  # ... in one call of the drafter's kernels
            assert max(one_call_drafts) > 1


def test_generate_batch_api(monkeypatch):
    gen = _generator(torch.float32)
    sizes = _count_batched_passes(monkeypatch)
    results = gen.generate_batch(PROMPTS, max_new_tokens=12, temperature=1.0, seeds=[3, 4, 5, 6], lookup=True)
    assert [r.token_ids for r in results] == [
        gen.generate(p, max_new_tokens=12, temperature=1.0, seed=s, lookup=True).token_ids
        for p, s in zip(PROMPTS, [3, 4, 5, 6])
    ]
    assert sizes and max(sizes) == len(PROMPTS)
    with pytest.raises(InvalidInputError, match="one per prompt"):
        gen.generate_batch(PROMPTS, seeds=[1])
    with pytest.raises(InvalidInputError, match="at least one prompt"):
        gen.generate_batch([])


def test_a_failing_member_does_not_stall_the_others():
    """A prompt too long for the target's context fails in its thread; the others finish and the error is raised."""
    gen = _generator(torch.float32)
    too_long = [1] + [5] * 600  # tiny targets hold 512 positions
    done = []

    def call() -> None:
        with pytest.raises(InvalidInputError, match="no room"):
            gen.generate_batch([PROMPTS[0], too_long, PROMPTS[1]], max_new_tokens=8)
        done.append(True)

    t = threading.Thread(target=call)
    t.start()
    t.join(120)
    assert done == [True]


@needs_kernels
def test_member_threads_leave_the_compute_threads_torch_threads_alone():
    """A member's one torch thread must not become the compute thread's: torch.set_num_threads also sets the
    process default, which the row kernels' library reads at a thread's first parallel loop there (found when a
    server with --max-batch 4 decoded at 39 tok/s instead of 65 with one client)."""
    previous = torch.get_num_threads()
    compute = ComputeThread(threads=2).start()  # a fresh thread: the kernels' first loop in it comes below
    try:
        seen = []

        def member() -> None:
            member_thread(compute)
            seen.append(torch.get_num_threads())

        t = threading.Thread(target=member)
        t.start()
        t.join(30)
        assert seen == [1]  # the member computes on one thread
        # the compute thread's first row-kernel loop runs on its 2 threads
        assert compute.call(lambda: row_kernels.kernel().parallel_threads()) == 2
        assert compute.call(torch.get_num_threads) == 2
    finally:
        compute.stop()
        torch.set_num_threads(previous)
