"""Log-probabilities of emitted tokens: read off the verify passes, equal to a teacher-forced forward of the
target over the whole output, whatever drafted the tokens (chains, trees, prompt lookup, sampling, grammars)."""

from __future__ import annotations

import pytest
import torch

from dflashkit import SpeculativeGenerator
from dflashkit.decoding.grammar import Grammar
from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.sampling import SamplingParams
from dflashkit.errors import InvalidInputError
from dflashkit.target.adapter import TargetAdapter
from dflashkit.target.logprobs import TokenLogprob, token_logprobs
from tests.conftest import BYTE_VOCAB, byte_tokenizer, tiny_drafter, tiny_target, word_tokenizer
from tests.decoding.test_loop import OracleDrafter
from tests.decoding.test_tree import RankedOracle

PROMPTS = [[5, 17, 33], [40, 8, 8, 61, 12, 90, 7], [77]]


def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[i] | prompt + output[:i]) from one plain forward of the model over the whole sequence."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [len(output), vocab]
    return torch.log_softmax(logits, -1)


def decode_with_logprobs(target, drafter, prompt, top=3, **kw):
    options = DecodeOptions(**{"max_new_tokens": 20, "logprobs": top, **kw})
    steps = list(decode(target, drafter, prompt, options))
    tokens = [t for s in steps for t in s.tokens]
    logprobs = [lp for s in steps for lp in s.logprobs]
    assert all(len(s.logprobs) == len(s.tokens) for s in steps)
    return tokens, logprobs, steps


def assert_match_reference(model, prompt, tokens, logprobs, top=3):
    ref = reference_logprobs(model, prompt, tokens)
    assert [lp.token_id for lp in logprobs] == tokens
    got = torch.tensor([lp.logprob for lp in logprobs])
    expected = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    for row, lp in zip(ref, logprobs):
        assert len(lp.top) == top
        values, ids = row.topk(top)
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values, atol=1e-4, rtol=0)
        assert [t for t, _ in lp.top] == ids.tolist()  # random fp32 logits: no ties


def test_token_logprobs_of_a_hand_made_row():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4]])) + 3.0  # any shift
    out = token_logprobs(logits, [1, 3], top=2)
    assert out[0].token_id == 1 and out[0].logprob == pytest.approx(torch.log(torch.tensor(0.25)).item())
    assert [t for t, _ in out[0].top] == [0, 1] and out[0].top[0][1] == pytest.approx(-0.6931472, abs=1e-6)
    assert [t for t, _ in out[1].top] == [3, 2]
    assert token_logprobs(logits, [2], top=0) == [TokenLogprob(2, pytest.approx(-2.0794415, abs=1e-6))]
    assert token_logprobs(logits, [], top=3) == []


@pytest.mark.parametrize("how", ["plain", "drafter", "oracle", "tree", "lookup"])
def test_logprobs_equal_a_teacher_forced_forward_however_the_tokens_were_drafted(how):
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=6)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    accepted = 0
    for prompt in PROMPTS:
        plain, _, _ = decode_with_logprobs(TargetAdapter(model), None, prompt)
        if how == "oracle":  # every accepted length occurs: whole blocks are read off one pass
            drafter = OracleDrafter(drafter.config, {})
            drafter.load_state_dict(tiny_drafter(model, block_size=6).state_dict())
            drafter.current = prompt + plain
        elif how == "tree":
            drafter = RankedOracle(drafter.config, prompt + plain)
            drafter.load_state_dict(tiny_drafter(model, block_size=6).state_dict())
        use = None if how in ("plain", "lookup") else drafter
        tokens, logprobs, steps = decode_with_logprobs(
            target if use else TargetAdapter(model),
            use,
            prompt,
            tree=8 if how == "tree" else None,
            lookup=how == "lookup",
        )
        assert tokens == plain
        assert_match_reference(model, prompt, tokens, logprobs)
        accepted += sum(len(s.tokens) - 1 for s in steps)
    if how in ("oracle", "tree"):
        assert accepted > 20  # multi-token steps were checked, not only single rows


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=5, top_p=0.9)])
def test_sampled_tokens_report_the_targets_own_logprobs_not_the_warped_ones(params):
    model = tiny_target("qwen3")
    drafter = tiny_drafter(model, block_size=4)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    for seed, prompt in enumerate(PROMPTS):
        tokens, logprobs, _ = decode_with_logprobs(target, drafter, prompt, sampling=params, seed=seed)
        assert_match_reference(model, prompt, tokens, logprobs)


def test_logprobs_under_a_grammar_are_the_unconstrained_targets():
    model = tiny_target("llama", vocab_size=BYTE_VOCAB)
    gen = SpeculativeGenerator(model, byte_tokenizer(), tiny_drafter(model, block_size=4))
    prompt = gen.encode_prompt("name?", chat=False)
    result = gen.generate(prompt, max_new_tokens=12, grammar=Grammar.regex(r"[a-z]{3,8}\."), logprobs=2)
    assert result.text.endswith(".") and len(result.logprobs) == len(result.token_ids)
    assert_match_reference(model, prompt, result.token_ids, result.logprobs, top=2)


def test_stream_deltas_carry_the_logprobs_of_their_tokens_up_to_a_stop_string():
    model = tiny_target("llama")
    gen = SpeculativeGenerator(model, word_tokenizer(), tiny_drafter(model, block_size=4))
    prompt = [5, 17, 33]
    full = gen.generate(prompt, max_new_tokens=16, logprobs=1)
    stop = gen.tokenizer.decode(full.token_ids[5:7])
    stream = gen.stream(prompt, max_new_tokens=16, logprobs=1, stop=[stop])
    deltas = list(stream)
    assert all(d.logprobs is not None and [lp.token_id for lp in d.logprobs] == d.token_ids for d in deltas)
    result = stream.result
    assert result.logprobs == [lp for d in deltas for lp in d.logprobs]
    assert result.token_ids == full.token_ids[: len(result.token_ids)] and len(result.token_ids) < 16
    assert result.logprobs == full.logprobs[: len(result.token_ids)]
    assert gen.generate(prompt, max_new_tokens=4).logprobs is None  # not asked: not computed


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5, "3"])
def test_bad_logprobs_requests_are_refused(bad):
    with pytest.raises(InvalidInputError, match="logprobs"):
        DecodeOptions(logprobs=bad)


def test_token_bytes_hold_partial_characters():
    gen = SpeculativeGenerator(tiny_target("llama", vocab_size=BYTE_VOCAB), byte_tokenizer())
    ids = gen.tokenizer.encode("é", add_special_tokens=False)
    assert b"".join(gen.token_bytes(t) for t in ids) == "é".encode()


def test_prompt_logprobs_equal_a_forward_over_the_prompt_and_come_with_the_first_delta():
    model = tiny_target("qwen3")
    gen = SpeculativeGenerator(model, word_tokenizer(), tiny_drafter(model, block_size=4))
    prompt = [40, 8, 8, 61, 12, 90, 7]
    stream = gen.stream(prompt, max_new_tokens=8, prompt_logprobs=2)
    deltas = list(stream)
    assert deltas[0].prompt_logprobs == stream.result.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:]) and stream.result.logprobs is None
    assert_match_reference(model, prompt[:1], prompt[1:], stream.result.prompt_logprobs, top=2)
    assert stream.result.token_ids == gen.generate(prompt, max_new_tokens=8).token_ids  # decoding unchanged
    with pytest.raises(InvalidInputError, match="logprobs"):
        gen.generate(prompt, prompt_logprobs=-1)
    scored = gen.score(prompt, prompt_logprobs=2)
    assert [d.token_ids for d in scored] == [[]] and scored.result.token_ids == []
    assert scored.result.prompt_logprobs == stream.result.prompt_logprobs
    with pytest.raises(InvalidInputError, match="empty"):
        gen.score([])
