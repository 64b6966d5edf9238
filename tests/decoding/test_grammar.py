"""Structured output (dflashkit.decoding.grammar): grammars and their checks, the constraint's masks, cut drafts and
masked proposals, and the decode loop under a grammar: speculative greedy == plain greedy (fp32), every
output in the grammar, and sampled output distributed as the constrained target."""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest
import torch

from dflashkit import Grammar, SpeculativeGenerator
from dflashkit.decoding.grammar import CompiledGrammar, grammar_tokenizer, masked
from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.sampling import SamplingParams, propose, warp
from dflashkit.decoding.stats import DecodeStats
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import InvalidInputError
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import BYTE_VOCAB, byte_tokenizer, tiny_drafter, tiny_target
from tests.decoding.test_sampling import P_MIN_E2E, assert_matches

EOS = 2
TOKENIZER = byte_tokenizer()
LLG_TOKENIZER = grammar_tokenizer(TOKENIZER, BYTE_VOCAB, [EOS])
REGEX = r"(ab|cd)+x"
SCHEMA = {  # finite choices only: a random tiny target fills an integer or a string field forever
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text)


def compiled(grammar: Grammar) -> CompiledGrammar:
    return CompiledGrammar(grammar, LLG_TOKENIZER, BYTE_VOCAB, [EOS])


def allowed_tokens(mask: torch.Tensor) -> set[int]:
    return set(mask.nonzero()[:, 0].tolist())


# ---- grammars -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: Grammar("yaml", "x"),
        lambda: Grammar.regex(""),
        lambda: Grammar.lark("  "),
        lambda: Grammar.json_schema("{not json"),
        lambda: Grammar.json_schema("[1, 2]"),
        lambda: Grammar.from_response_format({"type": "json_schema"}),
        lambda: Grammar.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}}),
        lambda: Grammar.from_response_format({"type": "xml"}),
    ],
)
def test_bad_grammars_are_refused(make):
    with pytest.raises(InvalidInputError):
        make()


def test_response_formats():
    assert Grammar.from_response_format(None) is None
    assert Grammar.from_response_format({"type": "text"}) is None
    assert Grammar.from_response_format({"type": "json_object"}) == Grammar.json_object()
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    assert Grammar.from_response_format(fmt) == Grammar.json_schema(SCHEMA)
    assert Grammar.json_schema(json.dumps(SCHEMA)) == Grammar.json_schema(SCHEMA)


@pytest.mark.parametrize("grammar", [Grammar.regex("[a-"), Grammar.lark("start: undefined_rule")])
def test_an_invalid_grammar_is_refused_when_compiled(grammar):
    with pytest.raises(InvalidInputError, match="invalid"):
        compiled(grammar)


# ---- the constraint: masks, cut drafts, masked proposals ------------------------------------------------


def test_allowed_sets_follow_the_regex():
    c = compiled(Grammar.regex(REGEX)).start()
    assert allowed_tokens(c.allowed()) == set(ids("a") + ids("c"))
    c.consume(ids("a"))
    assert allowed_tokens(c.allowed()) == set(ids("b"))
    c.consume(ids("b"))
    assert allowed_tokens(c.allowed()) == set(ids("a") + ids("c") + ids("x"))
    c.consume(ids("x"))
    assert allowed_tokens(c.allowed()) == {EOS}  # complete: only the end of the text


def test_cut_keeps_the_accepted_prefix_and_leaves_the_state_unchanged():
    c = compiled(Grammar.regex(REGEX)).start()
    c.consume(ids("ab"))
    before = c.allowed()
    n, masks = c.cut(ids("cdqab"))  # "q" is refused
    assert n == 2 and masks.shape == (3, BYTE_VOCAB)
    expected = compiled(Grammar.regex(REGEX)).start()
    for i, token in enumerate(ids("abcd")[2:] + [None]):
        if i == 0:
            expected.consume(ids("ab"))
        assert torch.equal(masks[i], expected.allowed())
        if token is not None:
            expected.consume([token])
    assert torch.equal(c.allowed(), before)


def test_cut_stops_after_an_end_of_sequence_draft_without_consuming_it():
    c = compiled(Grammar.regex(REGEX)).start()
    n, masks = c.cut(ids("abx") + [EOS] + ids("a"))
    assert n == 4 and masks.shape == (5, BYTE_VOCAB)
    assert allowed_tokens(masks[3]) == {EOS} and bool(masks[4].all())  # the row after the end: any token
    assert allowed_tokens(c.allowed()) == set(ids("a") + ids("c"))  # nothing consumed, nothing over-rolled back
    c.consume(ids("abx") + [EOS])  # the state still takes the whole text


@pytest.mark.parametrize("mode,temperature", [("argmax", 0.0), ("sample", 1.0)])
def test_proposals_are_made_from_masked_rows(mode, temperature):
    c = compiled(Grammar.regex(REGEX)).start()
    scores = torch.randn(6, BYTE_VOCAB, generator=torch.Generator().manual_seed(0)) * 3  # [k, V]
    params = SamplingParams(temperature)
    gen = torch.Generator().manual_seed(1)
    drafts, q, masks = c.propose(scores, None, lambda row: propose(row, params, mode, gen, None, BYTE_VOCAB))
    assert drafts.shape == (6,) and masks.shape == (7, BYTE_VOCAB)
    text = TOKENIZER.decode(drafts.tolist())
    assert re.fullmatch(r"(ab|cd)*(a|c)?", text) or re.fullmatch(REGEX, text[: text.index("x") + 1]), text
    for i in range(6):  # each row's mask is the one after the drafts before it
        assert masks[i][drafts[i]]
        if mode == "argmax":
            assert int(drafts[i]) == int(masked(scores[i : i + 1], masks[i : i + 1]).argmax())
        else:
            assert q is not None and torch.allclose(q[i], warp(masked(scores[i : i + 1], masks[i : i + 1]), params)[0])
    assert (q is None) == (mode == "argmax")
    assert allowed_tokens(c.allowed()) == set(ids("a") + ids("c"))  # state unchanged


def test_proposals_over_a_draft_vocabulary_stop_where_the_grammar_allows_none_of_it():
    c = compiled(Grammar.regex(REGEX)).start()

    def draft(columns: torch.Tensor):
        scores = torch.zeros(5, len(columns))  # ties: the first allowed column wins
        return c.propose(
            scores, columns, lambda row: propose(row, SamplingParams(), "argmax", None, columns, BYTE_VOCAB)
        )

    drafts, _, masks = draft(torch.tensor(sorted(ids("a") + ids("b") + ids("z"))))  # no "c", "d" or "x"
    assert TOKENIZER.decode(drafts.tolist()) == "ababa" and masks.shape == (6, BYTE_VOCAB)
    assert allowed_tokens(masks[5]) == set(ids("b"))
    drafts, _, masks = draft(torch.tensor(sorted(ids("b") + ids("z"))))  # nothing the grammar allows first
    assert drafts.shape == (0,) and masks.shape == (1, BYTE_VOCAB)


# ---- the decode loop under a grammar ----------------------------------------------------------------------


class ContinuationOracle(DFlashDrafter):
    """Proposes a known continuation, wrong at one offset that cycles, so that drafts are rejected at many offsets. The
    wrong row scores every other token above the right one: the grammar's mask leaves a wrong draft wherever it
    allows more than one token."""

    def __init__(self, config, continuation: list[int], first_call: int = 0) -> None:
        super().__init__(config)
        self.continuation, self.calls = continuation, first_call

    def draft_scores(self, context, new_features, new_start, anchor, pos, k, embed_tokens, lm_head):
        super().draft_scores(context, new_features, new_start, anchor, pos, k, embed_tokens, lm_head)
        scores = torch.zeros(k, BYTE_VOCAB)
        wrong_at = self.calls % (k + 2)
        self.calls += 1
        for j in range(k):
            i = pos + 1 + j
            token = self.continuation[i] if i < len(self.continuation) else EOS
            if j == wrong_at:  # every other token above the right one: the grammar picks which is drafted
                scores[j] = 20.0 - torch.arange(BYTE_VOCAB) * 0.01
            scores[j, token] = 10.0
        return scores, None


def run(target, drafter, prompt, grammar, stats=None, **kw) -> list[int]:
    options = DecodeOptions(
        max_new_tokens=kw.pop("max_new_tokens", 120), grammar=grammar, stop_token_ids=frozenset([EOS]), **kw
    )
    return [t for step in decode(target, drafter, prompt, options, stats) for t in step.tokens]


def in_grammar(grammar: CompiledGrammar, tokens: list[int]) -> bool:
    c = grammar.start()
    n, _ = c.cut(tokens)
    return n == len(tokens)


@pytest.mark.parametrize(
    "grammar,block_size",
    [
        (Grammar.regex(REGEX), 4),
        (Grammar.regex(REGEX), 8),
        (Grammar.json_schema(SCHEMA), 8),
        (Grammar.json_object(), 4),
    ],
    ids=["regex-4", "regex-8", "json_schema-8", "json_object-4"],
)
def test_greedy_speculative_equals_plain_under_a_grammar(arch, grammar, block_size):
    model = tiny_target(arch, vocab_size=BYTE_VOCAB)
    drafter = tiny_drafter(model, block_size=block_size)
    target, plain = TargetAdapter(model, drafter.config.target_layer_ids), TargetAdapter(model)
    g = compiled(grammar)
    oracle_stats = DecodeStats(block_size)
    finished = 0
    for i, prompt in enumerate(["hello", "w", '{"a": 1}', "abab", "cd", "0", "hi there", "xyz"]):
        prompt_ids = ids(prompt)
        expected = run(plain, None, prompt_ids, g)
        assert in_grammar(g, expected), TOKENIZER.decode(expected)
        finished += expected[-1] == EOS
        assert run(target, drafter, prompt_ids, g) == expected
        assert run(target, drafter, prompt_ids, g, lookup=True) == expected
        oracle = ContinuationOracle(drafter.config, prompt_ids + expected, first_call=i)
        oracle.load_state_dict(drafter.state_dict())
        assert run(target, oracle, prompt_ids, g, oracle_stats) == expected
    assert finished >= 2  # most outputs are complete texts of the grammar, ended by it
    steps = list(zip(oracle_stats.accepted_lengths, oracle_stats.drafted_lengths))
    assert any(a == d > 0 for a, d in steps) and any(a < d for a, d in steps)  # whole blocks and rejections
    if grammar.kind == "regex":
        text = TOKENIZER.decode(expected[:-1])
        assert re.fullmatch(REGEX, text), text


def test_generator_structured_output_and_stats():
    model = tiny_target("llama", vocab_size=BYTE_VOCAB)
    gen = SpeculativeGenerator(model, TOKENIZER, tiny_drafter(model, block_size=4))
    result = gen.generate("hello", grammar=Grammar.json_schema(SCHEMA), max_new_tokens=300, compare_ar=True)
    assert result.finish_reason == "stop" and result.identical
    value = json.loads(result.text)
    assert set(value) == {"color", "ok"} and value["color"] in ("red", "green") and isinstance(value["ok"], bool)
    assert result.stats.grammar == "json_schema" and result.stats.as_dict()["grammar"] == "json_schema"
    # a tree request falls back to chains under a grammar
    tree = gen.generate("hello", grammar=Grammar.json_schema(SCHEMA), max_new_tokens=300, tree=4)
    assert tree.token_ids == result.token_ids and tree.stats.tree is None
    with pytest.raises(InvalidInputError):
        gen.generate("hello", grammar={"type": "json_object"})


# ---- sampling under a grammar: the constrained target's exact distribution ---------------------------------

SAMPLED_REGEX = r"([a-d][e-h]){2,}"  # odd positions a-d, even e-h: the allowed set moves every token (no eos before 4)
SAMPLED_PROMPT = "hello"
N_SAMPLED = 1000


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=2)], ids=["t1", "t0.7_k2"])
@torch.inference_mode()
def test_sampled_decode_under_a_grammar_matches_the_constrained_target(params):
    model = tiny_target("llama", num_hidden_layers=2, vocab_size=BYTE_VOCAB)
    drafter = tiny_drafter(model, block_size=4, num_layers=1)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    g = compiled(Grammar.regex(SAMPLED_REGEX))
    prompt = ids(SAMPLED_PROMPT)
    odd, even = ids("abcd"), ids("efgh")

    def constrained(prefixes: list[list[int]], allowed: list[int]) -> torch.Tensor:
        logits = model(torch.tensor([prompt + p for p in prefixes])).logits[:, -1].float()  # [n, V]
        mask = torch.zeros(BYTE_VOCAB, dtype=torch.bool)
        mask[allowed] = True
        return warp(logits.masked_fill(~mask, float("-inf")), params)[:, allowed].double()  # [n, 4]

    p1 = constrained([[]], odd)[0]
    p2 = constrained([[a] for a in odd], even)
    p3 = constrained([[a, b] for a, b in itertools.product(odd, even)], odd).view(4, 4, 4)
    exact = (p1[:, None, None] * p2[:, :, None] * p3).numpy()  # joint of (t1, t2, t3)

    counts = np.zeros((4, 4, 4))
    index = {t: i for i, t in enumerate(odd)} | {t: i for i, t in enumerate(even)}
    stats = DecodeStats(block_size=4)
    for seed in range(N_SAMPLED):
        tokens = run(target, drafter, prompt, g, stats, max_new_tokens=4, sampling=params, seed=seed)
        counts[tuple(index[t] for t in tokens[:3])] += 1
    steps = [(a, d) for a, d in zip(stats.accepted_lengths, stats.drafted_lengths) if d > 0]
    assert sum(a for a, _ in steps) >= 0.05 * len(steps) and sum(a < d for a, d in steps) >= 0.05 * len(steps)
    assert_matches(counts, exact, f"grammar {params}: joint (t1, t2, t3)", p_min=P_MIN_E2E)


@torch.inference_mode()
def test_coupled_sampling_under_a_grammar_is_the_seeds_plain_output():
    """Coupled sampling under a grammar: the drafter's rows masked one by one under the position noise, the verify
    rows masked and noised; each seed's tokens (fp32) are plain coupled sampling's, and follow the grammar."""
    model = tiny_target("llama", num_hidden_layers=2, vocab_size=BYTE_VOCAB)
    drafter = tiny_drafter(model, block_size=4, num_layers=1)
    target, plain = TargetAdapter(model, drafter.config.target_layer_ids), TargetAdapter(model)
    g = compiled(Grammar.regex(SAMPLED_REGEX))
    stats = DecodeStats(block_size=4)
    outputs = set()
    for seed in range(40):
        kw = {"max_new_tokens": 9, "sampling": SamplingParams(1.0), "seed": seed, "sampler": "coupled"}
        expected = run(plain, None, ids(SAMPLED_PROMPT), g, **kw)
        assert in_grammar(g, expected)
        assert run(target, drafter, ids(SAMPLED_PROMPT), g, stats, **kw) == expected
        outputs.add(tuple(expected))
    assert len(outputs) > 20  # sampled
    steps = [(a, d) for a, d in zip(stats.accepted_lengths, stats.drafted_lengths) if d > 0]
    assert sum(a for a, _ in steps) >= 0.05 * len(steps) and sum(a < d for a, d in steps) >= 0.05 * len(steps)


def test_proposals_stop_after_an_end_of_sequence_draft_without_consuming_it():
    c = compiled(Grammar.regex(REGEX)).start()
    scores = torch.zeros(6, BYTE_VOCAB)
    for j, token in enumerate(ids("abx") + [EOS] + ids("ab")):
        scores[j, token] = 5.0
    drafts, _, masks = c.propose(scores, None, lambda row: propose(row, SamplingParams(), "argmax", None))
    assert drafts.tolist() == ids("abx") + [EOS] and masks.shape == (5, BYTE_VOCAB) and bool(masks[4].all())
    assert allowed_tokens(c.allowed()) == set(ids("a") + ids("c"))  # rolled back exactly what was consumed
    c.consume(ids("abx") + [EOS])


def test_a_choice_grammar_accepts_exactly_its_texts():
    options = ["ab", 'say "x"', "a|b (c)\n"]
    g = compiled(Grammar.choice(options))
    for text in options:
        c = g.start()
        c.consume(ids(text))
        assert bool(c.allowed()[EOS])  # complete: the text may end here
    c = g.start()
    c.consume(ids("a"))
    assert allowed_tokens(c.allowed()) == set(ids("b") + ids("|"))  # on to "ab" or "a|b (c)\n", nothing else
    for bad in ([], "ab", [""], ["ok", 3]):
        with pytest.raises(InvalidInputError, match="choices"):
            Grammar.choice(bad)
