"""Step graphs (dflashkit.kernels.cuda_graphs) without a GPU: the tensor-driven step equals the fast forward, decoding
through replayed steps gives the fast path's tokens, caches return to their pool, and failures fall back.

A CUDA graph replays recorded kernels on recorded memory. The stand-in capture here records nothing: it returns
the step itself, so a replay runs the step again on the same static buffers. What it checks is everything but
the recording: that every input of a step reaches it through the static buffers and every output leaves through
them. That no Python value of the step depends on the position or the tokens (the way a recording would go
wrong silently) is checked by running the step under a dispatch mode that fails on reading a tensor's value.
"""

from __future__ import annotations

import gc
from copy import deepcopy

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dflashkit.decoding.adaptive import AdaptiveBlockSize
from dflashkit.decoding.sampling import SamplingParams
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import InvalidInputError
from dflashkit.kernels.cuda_graphs import MIN_CAPACITY
from dflashkit.target.adapter import TargetAdapter
from dflashkit.target.cuda_graphs import GraphCache, GraphedSteps, unsupported_reason
from dflashkit.target.fast import StepInputs
from tests.conftest import VOCAB, ReplayCapture, frozen, tiny_drafter, tiny_target
from tests.target.test_fast import PROMPTS, run


def pair(arch: str = "llama", block_size: int = 8):
    """The same tiny target twice (fast forward; fast forward with step graphs) and a drafter."""
    model = tiny_target(arch)
    drafter = tiny_drafter(model, block_size=block_size)
    drafter.use_fast_path(True)
    drafter.block_fill = "whole"  # as on a GPU, where drafting replays graphs of whole blocks, with or without them
    layers = drafter.config.target_layer_ids
    plain, graphed = TargetAdapter(model, layers), TargetAdapter(model, layers)
    capture = ReplayCapture()
    graphed.use_step_graphs(capture)
    return plain, graphed, drafter, capture


def graphed_drafter(drafter, capture=None):
    """A copy of the drafter whose drafting steps replay through `capture` (a ReplayCapture by default)."""
    copy = deepcopy(drafter)
    copy.use_fast_path(True)
    copy.use_step_graphs(capture or ReplayCapture())
    return copy


def step_inputs(fast, capacity: int, ids: torch.Tensor, start: int, offsets=None, visible=None) -> StepInputs:
    n = ids.shape[1]
    cos, sin = fast.rotary_tables(capacity)
    return StepInputs(
        ids,
        torch.tensor([start]),
        torch.arange(n) if offsets is None else offsets,
        torch.arange(n),
        torch.ones(n, n, dtype=torch.bool).tril() if visible is None else visible,
        torch.arange(capacity),
        cos,
        sin,
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_static_step_equals_the_fast_forward(arch):
    """Chain steps of 1 and 5 rows at several positions, then a token tree: same logits, features and cache rows."""
    target = TargetAdapter(tiny_target(arch), [0, 1])
    fast = target.fast_forward
    cache = fast.new_cache(64)
    keys, values = torch.zeros_like(cache.keys), torch.zeros_like(cache.values)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 7), generator=gen)
    fast(prompt, 0, cache, 1, [0, 1])
    keys[:, :, :7], values[:, :, :7] = cache.keys[:, :, :7], cache.values[:, :, :7]  # the same prefix
    start = 7
    for n in (1, 5, 1, 3):
        ids = torch.randint(0, VOCAB, (1, n), generator=gen)
        want_logits, want_features = fast(ids, start, cache, n, [0, 1])
        logits, features = fast.static_step(step_inputs(fast, 64, ids, start), keys, values, n, [0, 1])
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(features, want_features, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(keys[:, :, : start + n], cache.keys[:, :, : start + n], rtol=1e-6, atol=1e-6)
        start += n
    # a tree: root, two children, a grandchild under the second child
    offsets = torch.tensor([0, 1, 1, 2])
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    ids = torch.randint(0, VOCAB, (1, 4), generator=gen)
    want_logits, _ = fast(ids, start, cache, 4, [0, 1], tree=(offsets, visible))
    logits, _ = fast.static_step(step_inputs(fast, 64, ids, start, offsets, visible), keys, values, 4, [0, 1])
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)


class NoValueReads(TorchDispatchMode):
    """Fails on any read of a tensor's value into Python (``item``, ``int``, ``float``, ``bool`` of a tensor)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (
            torch.ops.aten.item.default,
            torch.ops.aten._local_scalar_dense.default,
            torch.ops.aten.is_nonzero.default,
        ):
            raise AssertionError("the step read a tensor's value: a CUDA graph would replay it as a constant")
        return func(*args, **(kwargs or {}))


def test_static_step_reads_no_tensor_value():
    """No value of a tensor steers the step's Python code (a CUDA graph would replay that choice forever)."""
    fast = TargetAdapter(tiny_target("llama"), [1]).fast_forward
    keys = torch.zeros(len(fast.layers), fast.kv_heads, 32, fast.head_dim)
    values = torch.zeros_like(keys)
    inputs = step_inputs(fast, 32, torch.tensor([[5, 6, 7, 8]]), 3)
    with NoValueReads():
        fast.static_step(inputs, keys, values, 4, [1])
    with pytest.raises(AssertionError, match="read a tensor's value"), NoValueReads():
        int(inputs.start)  # the check itself works


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoding_through_graphs_gives_the_fast_paths_tokens(arch):
    """Greedy and seeded sampling, fixed and adaptive block sizes (so the step shape changes mid-generation), and
    plain decoding: every token as the fast forward decodes it; each step shape is captured once per cache."""
    plain, graphed, drafter, capture = pair(arch)
    for prompt in PROMPTS[:3]:
        for kw in ({}, {"block_size": 4}, {"sampling": SamplingParams(temperature=1.0), "seed": 3}):
            want = run(plain, drafter, prompt, **kw)
            assert run(graphed, drafter, prompt, **kw) == want
        policy = AdaptiveBlockSize(8, candidates=(1, 2, 4, 8), explore_every=2)
        want = run(plain, drafter, prompt, policy=policy)
        policy = AdaptiveBlockSize(8, candidates=(1, 2, 4, 8), explore_every=2)
        assert run(graphed, drafter, prompt, policy=policy) == want
        assert run(graphed, None, prompt) == run(plain, None, prompt)
    assert capture.captured > 0 and not graphed.graphs.failed
    assert "CUDA graphs" in graphed.engine


def test_token_trees_through_graphs():
    plain, graphed, drafter, _ = pair()
    for prompt in PROMPTS[:2]:
        assert run(graphed, drafter, prompt, tree=5) == run(plain, drafter, prompt, tree=5)


def test_cache_bookkeeping_after_replayed_steps_equals_a_fresh_prefill():
    """After a speculative generation through graphs, the cache's valid rows are the prefill of its tokens."""
    _, graphed, drafter, _ = pair()
    prompt = PROMPTS[1]
    tokens = run(graphed, drafter, prompt, block_size=4, max_new_tokens=20)
    fresh = graphed.fast_forward.new_cache(64)
    ids = torch.tensor([prompt + tokens[:-1]])
    graphed.fast_forward(ids, 0, fresh, 1, [])
    # rerun the generation, keeping its cache this time
    cache = graphed.new_cache(64)
    assert isinstance(cache, GraphCache)
    start = 0
    graphed.forward(torch.tensor([prompt]), 0, cache, 1)
    start = len(prompt)
    for t in tokens[:-1]:  # one replayed step per token
        graphed.forward(torch.tensor([[t]]), start, cache, 1)
        start += 1
    for (k, v), (fk, fv) in zip(TargetAdapter.cached_key_values(cache), TargetAdapter.cached_key_values(fresh)):
        torch.testing.assert_close(k, fk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, fv, rtol=1e-5, atol=1e-5)


def test_caches_are_pooled_and_lent_to_one_generation_at_a_time():
    _, graphed, _, capture = pair()
    steps: GraphedSteps = graphed.graphs
    a = graphed.new_cache(100)
    assert a.capacity == MIN_CAPACITY
    b = graphed.new_cache(100)
    assert b.slot is not a.slot  # two live generations never share buffers
    graphed.forward(torch.tensor([[1, 2, 3]]), 0, a, 1)
    assert capture.captured == 0  # a prefill (position 0) runs eagerly: its length changes with every prompt
    graphed.forward(torch.tensor([[4]]), 3, a, 1)
    assert capture.captured == 1
    slot = a.slot
    del a
    gc.collect()
    c = graphed.new_cache(60)
    assert c.slot is slot and c.length == 0  # reused, graphs included
    captured = capture.captured
    graphed.forward(torch.tensor([[1, 2, 3]]), 0, c, 1)
    graphed.forward(torch.tensor([[4]]), 3, c, 1)
    assert capture.captured == captured
    assert graphed.new_cache(3 * MIN_CAPACITY).capacity == 4 * MIN_CAPACITY
    with pytest.raises(InvalidInputError, match="do not fit"):
        c.reserve(MIN_CAPACITY + 1)
    assert steps.captures == capture.captured


def broken(step, pool):
    """A capture that fails, as CUDA's does when the step synchronises with the host."""
    raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("capture,warning", [(broken, "capture failed"), (frozen, "differ")])
def test_a_bad_graph_falls_back_to_the_eager_forward(capture, warning):
    """A failing capture, or a frozen recording (the second check, at another position, sees it): the shape runs
    eagerly with a warning, and the tokens are the fast path's. (A prompt whose steps' inputs vary: on one that
    repeats a token under the same drafts every step, a frozen recording is right, up to the rotary phase.)"""
    plain, graphed, drafter, _ = pair()
    graphed.use_step_graphs(capture)
    with pytest.warns(RuntimeWarning, match=warning):
        tokens = run(graphed, drafter, PROMPTS[3], block_size=4)
    assert tokens == run(plain, drafter, PROMPTS[3], block_size=4)
    assert graphed.graphs.failed


def test_graphs_need_a_cuda_device():
    target = TargetAdapter(tiny_target("llama"))
    assert target.graphs is None  # on a CPU the fast forward runs as before
    assert "CUDA" in unsupported_reason(target.fast_forward)
    with pytest.raises(InvalidInputError, match="CUDA"):
        GraphedSteps(target.fast_forward)
    eager = TargetAdapter(tiny_target("llama"), fast=False)
    with pytest.raises(InvalidInputError, match="fast forward"):
        eager.use_step_graphs(ReplayCapture())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_drafting_through_graphs_gives_the_fast_paths_tokens(arch):
    """Target and drafter both replayed: the same tokens as the fast path, greedy, sampled, adaptive, trees."""
    plain, graphed, drafter, _ = pair(arch)
    capture = ReplayCapture()
    twin = graphed_drafter(drafter, capture)
    for prompt in PROMPTS[:3]:
        for kw in ({}, {"block_size": 4}, {"sampling": SamplingParams(temperature=1.0), "seed": 5}, {"tree": 5}):
            assert run(graphed, twin, prompt, **kw) == run(plain, drafter, prompt, **kw)
        policy = AdaptiveBlockSize(8, candidates=(2, 4, 8), explore_every=2)
        want = run(plain, drafter, prompt, policy=policy)
        policy = AdaptiveBlockSize(8, candidates=(2, 4, 8), explore_every=2)
        assert run(graphed, twin, prompt, policy=policy) == want
    assert capture.captured > 0 and not twin.graphs.failed


def test_drafting_graphs_attend_to_the_context_window_only():
    """A graphed drafting step masks the context rows before the window: the eager step's scores (windowed), which
    differ from the whole context's here."""
    plain, _, drafter, _ = pair("qwen3")
    capture = ReplayCapture()
    twin = graphed_drafter(drafter, capture)
    prompt = torch.tensor([PROMPTS[0] * 3])
    _, features = plain.forward(prompt, 0, plain.new_cache(), logits_rows=1)
    n = prompt.shape[1]

    def scores(d, window):
        context = d.new_context(n + 16, window=window)
        embed, head = plain.embed_tokens, plain.lm_head
        first = d.draft_scores(context, features, 0, 7, n, 4, embed, head)[0]
        return [first] + [d.draft_scores(context, None, 0, 7, n, 4, embed, head)[0] for _ in range(3)]

    expected = scores(drafter, 3)[0]
    assert not torch.allclose(expected, scores(drafter, None)[0], atol=1e-3)
    for got in scores(twin, 3):  # the first two replays are checked against eager steps, the others not
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert capture.captured == 1 and not twin.graphs.failed


def test_graphed_drafting_scores_the_texts_own_columns():
    """With a draft vocabulary, a graphed step's scores of the draft vocabulary come from the graph and those of the
    text's tokens outside it from the hidden rows the graph kept: the fast path's scores and columns, on the checked
    replays and after them."""
    plain, _, base, _ = pair("qwen3")
    drafter = DFlashDrafter(base.config.replace(draft_vocab=list(range(0, VOCAB, 3)))).eval()
    drafter.load_state_dict(base.state_dict())
    drafter.use_fast_path(True)
    drafter.block_fill = "whole"
    twin = graphed_drafter(drafter)
    prompt = torch.tensor([PROMPTS[0] * 2])
    _, features = plain.forward(prompt, 0, plain.new_cache(), logits_rows=1)
    n = prompt.shape[1]

    def steps(d):
        context = d.new_context(n + 16)
        context.note_text(prompt[0].tolist())
        embed, head = plain.embed_tokens, plain.lm_head
        return [d.draft_scores(context, features if i == 0 else None, 0, 7, n, 4, embed, head) for i in range(4)]

    outside = [t for t in dict.fromkeys(prompt[0].tolist()) if t % 3]
    assert outside
    for (got, got_columns), (want, want_columns) in zip(steps(twin), steps(drafter)):
        assert got_columns.tolist() == want_columns.tolist() == list(range(0, VOCAB, 3)) + outside
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not twin.graphs.failed


def test_draft_contexts_are_pooled_and_fixed():
    _, _, drafter, _ = pair()
    twin = graphed_drafter(drafter)
    a = twin.new_context(100)
    assert a.capacity == MIN_CAPACITY and twin.new_context(100).slot is not a.slot
    slot = a.slot
    del a
    gc.collect()
    assert twin.new_context(10).slot is slot
    c = twin.new_context(10)
    kvs = [(torch.zeros(1, 1, MIN_CAPACITY + 1, 4), torch.zeros(1, 1, MIN_CAPACITY + 1, 4))] * len(drafter.layers)
    with pytest.raises(InvalidInputError, match="do not fit"):
        c.append(kvs)


def test_a_frozen_drafting_graph_is_caught():
    plain, _, drafter, _ = pair()
    twin = graphed_drafter(drafter, frozen)
    with pytest.warns(RuntimeWarning, match="differ"):
        tokens = run(plain, twin, PROMPTS[1], block_size=4)
    assert tokens == run(plain, drafter, PROMPTS[1], block_size=4)
    assert twin.graphs.failed


def test_drafting_graphs_need_the_fast_path_and_a_cuda_device():
    _, _, drafter, _ = pair()
    slow = deepcopy(drafter)
    slow.use_fast_path(False)
    with pytest.raises(InvalidInputError, match="fast path"):
        slow.use_step_graphs(ReplayCapture())
    with pytest.raises(InvalidInputError, match="CUDA"):
        deepcopy(drafter).use_step_graphs()


def test_drafting_step_reads_no_tensor_value():
    """The recorded drafting step steers nothing by a tensor's value (captures run it under NoValueReads)."""
    plain, _, drafter, _ = pair()

    def checking(step, pool):
        with NoValueReads():
            step()
        return step

    twin = graphed_drafter(drafter, checking)
    assert run(plain, twin, PROMPTS[1], block_size=4) == run(plain, drafter, PROMPTS[1], block_size=4)
    assert twin.graphs.captures and not twin.graphs.failed


def _storage(t: object) -> torch.UntypedStorage | None:
    """A tensor's storage; None for opaque ones (the CPU's prepacked oneDNN weights, which the modules own)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()
    except NotImplementedError:
        return None


class OuterReads(TorchDispatchMode):
    """Notes (weakly) the storage of every tensor a step reads that the step did not make itself."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()
        self.outer: dict[int, tuple[StorageWeakRef, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs)):
            storage = _storage(t)
            if storage is not None and storage.data_ptr() not in self.made:
                ref = StorageWeakRef(storage)
                self.outer.setdefault(ref.cdata, (ref, f"{func} {tuple(t.shape)}"))
        self.made |= {s.data_ptr() for s in map(_storage, tree_leaves(out)) if s is not None}
        return out


class LifetimeCapture:
    """Stand-in capture that records which outer tensors a step reads. A CUDA graph keeps their addresses but not
    the step's Python closure: a tensor that only the closure keeps alive is freed after the capture and its
    memory reused, so the replay reads garbage. ``orphans()`` drops the steps and names the tensors that died."""

    def __init__(self) -> None:
        self.steps: list = []
        self.reads: dict[int, tuple[StorageWeakRef, str]] = {}

    def __call__(self, step, pool):
        recorder = OuterReads()
        with recorder:
            step()
        self.reads.update(recorder.outer)
        index = len(self.steps)
        self.steps.append(step)
        return lambda: self.steps[index]()  # holds no reference to the step itself, as a CUDA graph

    def orphans(self) -> list[str]:
        self.steps.clear()
        gc.collect()
        return [what for ref, what in self.reads.values() if ref.expired()]


def test_graphed_steps_read_only_tensors_that_outlive_the_capture():
    """Every tensor a recorded target or drafting step reads from outside itself lives on after the capture (in
    the slot, the model or the drafter): on a GPU, the drafting step read a mask made beside it and freed."""
    plain, _, drafter, _ = pair("qwen3")
    target_capture, draft_capture = LifetimeCapture(), LifetimeCapture()
    graphed = TargetAdapter(plain.model, drafter.config.target_layer_ids)
    graphed.use_step_graphs(target_capture)
    twin = graphed_drafter(drafter, draft_capture)
    run(graphed, twin, PROMPTS[1], block_size=4, max_new_tokens=12)  # its caches return to their pools, alive
    assert target_capture.reads and draft_capture.reads
    assert target_capture.orphans() == [] and draft_capture.orphans() == []
