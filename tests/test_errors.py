"""Bad input gets a clear dflashkit error (InvalidInputError / IncompatibleDrafterError), never a raw torch error."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.sampling import SamplingParams
from dflashkit.decoding.stats import DecodeStats
from dflashkit.errors import DFlashError, IncompatibleDrafterError, InvalidInputError
from dflashkit.generator import SpeculativeGenerator
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_drafter, tiny_target, word_tokenizer

MAX_POS = 64


def tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_target("llama", max_position_embeddings=MAX_POS)


@pytest.fixture(scope="module")
def drafter(model):
    return tiny_drafter(model, block_size=4)


@pytest.fixture(scope="module")
def target(model, drafter) -> TargetAdapter:
    return TargetAdapter(model, drafter.config.target_layer_ids)


@pytest.fixture(scope="module")
def gen(model, drafter) -> SpeculativeGenerator:
    return SpeculativeGenerator(model, tokenizer(), drafter)


def run(target, drafter, prompt, **options) -> list[int]:
    """Consume a decode fully (errors surface on the first step)."""
    return [t for step in decode(target, drafter, prompt, DecodeOptions(**options)) for t in step.tokens]


# ---- prompts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    [[], torch.tensor([], dtype=torch.long), torch.zeros(1, 0, dtype=torch.long), [[]]],
    ids=["list", "tensor", "tensor-1x0", "nested"],
)
@pytest.mark.parametrize("with_drafter", [True, False])
def test_empty_prompt_tokens(target, drafter, prompt, with_drafter: bool) -> None:
    with pytest.raises(InvalidInputError, match="empty"):
        run(target, drafter if with_drafter else None, prompt, max_new_tokens=4)


@pytest.mark.parametrize("prompt", ["", [], ()], ids=["string", "list", "tuple"])
def test_empty_prompt_in_generator(gen, prompt) -> None:
    with pytest.raises(InvalidInputError, match="empty"):
        gen.generate(prompt, max_new_tokens=4)


def test_empty_chat_messages(gen) -> None:
    with pytest.raises(InvalidInputError, match="chat messages"):
        gen.encode_prompt([{"role": "user"}])


@pytest.mark.parametrize("prompt", [[5, VOCAB], [-1, 5], [5, 10_000]])
def test_prompt_ids_out_of_vocab(target, drafter, gen, prompt: list[int]) -> None:
    with pytest.raises(InvalidInputError, match=rf"\[0, {VOCAB}\)"):
        run(target, drafter, prompt, max_new_tokens=4)
    with pytest.raises(InvalidInputError, match=rf"\[0, {VOCAB}\)"):
        run(target, None, prompt, max_new_tokens=4)
    with pytest.raises(InvalidInputError):
        gen.generate(prompt, max_new_tokens=4)


@pytest.mark.parametrize("length", [MAX_POS, MAX_POS + 1, 3 * MAX_POS])
def test_prompt_longer_than_context(target, drafter, gen, length: int) -> None:
    prompt = [5 + i % 50 for i in range(length)]
    with pytest.raises(InvalidInputError, match=f"context of {MAX_POS}"):
        run(target, drafter, prompt, max_new_tokens=4)
    with pytest.raises(InvalidInputError, match=f"context of {MAX_POS}"):
        run(target, None, prompt, max_new_tokens=4)
    with pytest.raises(InvalidInputError):
        gen.generate(prompt, max_new_tokens=4)


@pytest.mark.parametrize(
    "prompt",
    [
        torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0)),
        [[5, 6, 7], [8, 9, 10]],
        torch.ones(1, 2, 3, dtype=torch.long),
    ],
    ids=["tensor-2xn", "two-lists", "tensor-3d"],
)
def test_batched_input_is_refused(target, drafter, gen, prompt) -> None:
    with pytest.raises(InvalidInputError, match="batch"):
        run(target, drafter, prompt, max_new_tokens=4)
    with pytest.raises(InvalidInputError, match="batch"):
        gen.generate(prompt, max_new_tokens=4)


@pytest.mark.parametrize(
    "prompt",
    [torch.tensor([5.0, 6.0]), torch.tensor([[5.0, 6.0]]), [[5.0, 6.0]]],
    ids=["float-tensor", "float-tensor-1xn", "nested-float-list"],
)
def test_floating_point_token_ids(target, drafter, prompt) -> None:
    with pytest.raises(InvalidInputError):
        run(target, drafter, prompt, max_new_tokens=4)


def test_ragged_prompt(target, drafter) -> None:
    with pytest.raises(InvalidInputError):
        run(target, drafter, [5, [6, 7]], max_new_tokens=4)


def test_batch_of_one_is_accepted(target, drafter) -> None:
    expected = run(target, drafter, [5, 6, 7], max_new_tokens=6)
    assert run(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=6) == expected
    assert run(target, drafter, [[5, 6, 7]], max_new_tokens=6) == expected


# ---- decode options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, -3])
def test_block_size_below_two(target, drafter, gen, block_size: int) -> None:
    with pytest.raises(InvalidInputError, match="block_size must be at least 2"):
        run(target, drafter, [5, 6, 7], max_new_tokens=4, block_size=block_size)
    with pytest.raises(InvalidInputError, match="block_size must be at least 2"):
        gen.generate([5, 6, 7], max_new_tokens=4, block_size=block_size)


def test_block_size_zero_is_refused(target, drafter) -> None:
    with pytest.raises(InvalidInputError, match="block_size"):
        run(target, drafter, [5, 6, 7], max_new_tokens=4, block_size=0)


@pytest.mark.parametrize("max_new", [0, -1])
def test_max_new_tokens_below_one(target, drafter, gen, max_new: int) -> None:
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        run(target, drafter, [5, 6, 7], max_new_tokens=max_new)
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        run(target, None, [5, 6, 7], max_new_tokens=max_new)
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        gen.generate("w5 w6", max_new_tokens=max_new)


@pytest.mark.parametrize(
    "params,field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.2), "top_p"),
        (dict(top_p=math.nan), "top_p"),
    ],
)
def test_bad_sampling_params(gen, params: dict, field: str) -> None:
    with pytest.raises(InvalidInputError, match=field):
        SamplingParams(**params)
    with pytest.raises(InvalidInputError, match=field):
        gen.generate("w5 w6", max_new_tokens=4, **params)


@pytest.mark.parametrize("proposal", ["beam", "ARGMAX", ""])
def test_unknown_proposal_mode_when_sampling(target, drafter, gen, proposal: str) -> None:
    with pytest.raises(InvalidInputError, match="proposal"):
        run(
            target,
            drafter,
            [5, 6, 7],
            max_new_tokens=8,
            sampling=SamplingParams(temperature=0.8),
            proposal=proposal,
            seed=0,
        )
    with pytest.raises(InvalidInputError, match="proposal"):
        gen.generate([5, 6, 7], max_new_tokens=8, temperature=0.8, proposal=proposal, seed=0)


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_known_proposal_modes_sample_fine(target, drafter, proposal: str) -> None:
    out = run(
        target,
        drafter,
        [5, 6, 7],
        max_new_tokens=8,
        sampling=SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
        proposal=proposal,
        seed=0,
    )
    assert 1 <= len(out) <= 8 and all(0 <= t < VOCAB for t in out)


# ---- drafters that do not fit -------------------------------------------------------------------------


def test_drafter_dtype_mismatch(target, drafter, model) -> None:
    bf16_drafter = copy.deepcopy(drafter).to(torch.bfloat16)
    with pytest.raises(IncompatibleDrafterError, match="bfloat16"):
        run(target, bf16_drafter, [5, 6, 7], max_new_tokens=4)
    bf16_target = TargetAdapter(copy.deepcopy(model).to(torch.bfloat16), drafter.config.target_layer_ids)
    with pytest.raises(IncompatibleDrafterError, match="float32"):
        run(bf16_target, drafter, [5, 6, 7], max_new_tokens=4)


@pytest.mark.parametrize(
    "other,problem",
    [(dict(hidden_size=32), "hidden size"), (dict(vocab_size=128), "vocabulary")],
    ids=["hidden", "vocab"],
)
def test_drafter_of_another_shape_given_to_decode(target, other: dict, problem: str) -> None:
    wrong = tiny_drafter(tiny_target("llama", **other), block_size=4)
    assert wrong.config.target_layer_ids == target.feature_layer_ids
    with pytest.raises(IncompatibleDrafterError, match=problem):
        run(target, wrong, [5, 6, 7], max_new_tokens=4)


def test_drafter_reading_other_feature_layers(model, drafter) -> None:
    other = TargetAdapter(model, [0, 5])
    with pytest.raises(IncompatibleDrafterError, match="feature_layer_ids"):
        run(other, drafter, [5, 6, 7], max_new_tokens=4)
    with pytest.raises(IncompatibleDrafterError, match="do not exist"):
        TargetAdapter(model, [1, 6])


# ---- the context limit ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [MAX_POS - 9, MAX_POS - 2, MAX_POS - 1])
@pytest.mark.parametrize("with_drafter,tree", [(True, None), (True, 4), (False, None)])
def test_generation_stops_at_the_context_limit(model, drafter, prompt_len: int, with_drafter: bool, tree) -> None:
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    furthest = []
    forward = target.forward

    def recording_forward(input_ids, start, cache, logits_rows, tree=None):
        furthest.append(start + (input_ids.shape[1] if tree is None else int(tree[0].max()) + 1))
        return forward(input_ids, start, cache, logits_rows, tree=tree)

    target.forward = recording_forward
    prompt = [5 + (7 * i) % 80 for i in range(prompt_len)]
    stats = DecodeStats(block_size=1)
    options = DecodeOptions(max_new_tokens=100, tree=tree)
    steps = list(decode(target, drafter if with_drafter else None, prompt, options, stats))
    tokens = [t for s in steps for t in s.tokens]
    assert len(tokens) == MAX_POS - prompt_len  # the whole remaining context is used, no more
    assert prompt_len + len(tokens) <= MAX_POS
    assert max(furthest) <= MAX_POS
    assert stats.finish_reason == "length" and steps[-1].finished
    assert all(not s.finished for s in steps[:-1])


def test_generator_stops_at_the_context_limit(gen) -> None:
    prompt = [5 + (7 * i) % 80 for i in range(MAX_POS - 6)]
    result = gen.generate(prompt, max_new_tokens=1000)
    assert 2 not in result.token_ids  # no eos in this generation: it ends on the length limit
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 6 and result.prompt_tokens + len(result.token_ids) == MAX_POS


def test_all_errors_are_dflash_errors() -> None:
    assert issubclass(InvalidInputError, DFlashError) and issubclass(IncompatibleDrafterError, DFlashError)


# ---- wrong types and out-of-range values through the Python API (found by a bad-input sweep) ----------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(max_new_tokens="4"), "max_new_tokens"),
        (dict(max_new_tokens=None), "max_new_tokens"),
        (dict(block_size=4.5), "block_size"),
        (dict(block_size=10**12), "block_size"),
        (dict(seed=2**70), "seed"),
        (dict(seed="x"), "seed"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_p="all"), "top_p"),
    ],
)
def test_wrong_types_and_ranges_are_refused(gen, kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidInputError, match=field):
        gen.generate("w5 w6", **{"max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize("prompt", [None, 5, [{"role": "user", "content": None}]], ids=["none", "int", "content-none"])
def test_a_prompt_of_the_wrong_type_is_refused(gen, prompt) -> None:
    with pytest.raises(InvalidInputError, match="prompt|messages"):
        gen.generate(prompt, max_new_tokens=4)


@pytest.mark.parametrize("text", ["caf\udce9", "w5 \ud800 w6"], ids=["surrogate-escaped-byte", "lone-surrogate"])
def test_text_that_is_not_valid_unicode_is_refused(gen, text: str) -> None:
    """What undecodable command-line bytes or an escaped half surrogate pair in JSON turn into."""
    with pytest.raises(InvalidInputError, match="not valid Unicode"):
        gen.generate(text, max_new_tokens=4)
    with pytest.raises(InvalidInputError, match="not valid Unicode"):
        gen.generate([{"role": "user", "content": text}], max_new_tokens=4)


@pytest.mark.parametrize("dtype", ["int4", "int8", torch.int8, 5])
def test_load_with_a_bad_dtype_says_so(dtype) -> None:
    with pytest.raises(InvalidInputError, match="dtype"):
        SpeculativeGenerator.load(dtype=dtype, drafter=None)


def test_load_with_a_drafter_of_the_wrong_type(monkeypatch) -> None:
    import dflashkit.target.loading

    monkeypatch.setattr(dflashkit.target.loading, "load_target", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(InvalidInputError, match="drafter"):
        SpeculativeGenerator.load(drafter=5)
