"""Penalties and logit bias: each verify row adjusted by its own history equals an element-wise reference;
speculative decoding under them equals plain decoding (greedy, fp32) and samples the adjusted target exactly."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.penalties import Penalties
from dflashkit.decoding.sampling import SamplingParams, warp
from dflashkit.decoding.stats import DecodeStats
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import InvalidInputError
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_drafter, tiny_target
from tests.decoding.test_loop import OracleDrafter
from tests.decoding.test_sampling import P_MIN_E2E, assert_matches

STRONG = Penalties(presence=0.7, frequency=0.9, repetition=1.4, logit_bias={7: 3.0, 9: -4.0})


def reference_row(logits: list[float], prompt: list[int], output: list[int], p: Penalties) -> list[float]:
    """The adjusted logits of one position, token by token, as the module's docstring defines them."""
    out = []
    for token, x in enumerate(logits):
        count = output.count(token)
        if p.repetition != 1.0 and (token in prompt or count > 0):
            x = x / p.repetition if x > 0 else x * p.repetition
        x = x - p.frequency * count - p.presence * (count > 0)
        out.append(x + p.logit_bias.get(token, 0.0))
    return out


def test_each_verify_row_is_adjusted_by_its_own_history():
    g = torch.Generator().manual_seed(0)
    vocab = 12
    prompt, output, drafts = [1, 2, 2, 5], [3, 3, 2, 7], [3, 9, 3, 11]
    logits = torch.randn(len(drafts) + 1, vocab, generator=g) * 3
    state = STRONG.start(prompt, vocab, "cpu")
    state.consume(output)
    got = state.apply(logits, torch.tensor(drafts))
    for r in range(len(drafts) + 1):
        expected = reference_row(logits[r].tolist(), prompt, output + drafts[:r], STRONG)
        torch.testing.assert_close(got[r], torch.tensor(expected), atol=1e-5, rtol=0)
    assert not torch.allclose(got[1], got[3])  # histories differ between rows: not a constant shift
    assert Penalties().active is False and STRONG.active


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence": 2.5},
        {"frequency": float("nan")},
        {"frequency": "1"},
        {"repetition": 0.0},
        {"repetition": float("inf")},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {"a": 1.0}},
        {"logit_bias": {True: 1.0}},
        {"logit_bias": {3: 101.0}},
        {"logit_bias": [(3, 1.0)]},
    ],
)
def test_bad_penalties_are_refused(kwargs):
    with pytest.raises(InvalidInputError):
        Penalties(**kwargs)


def test_a_bias_outside_the_vocabulary_is_refused_before_decoding():
    target = TargetAdapter(tiny_target("llama"))
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        next(decode(target, None, [5, 6], DecodeOptions(penalties=Penalties(logit_bias={VOCAB: 1.0}))))


def reference_greedy(model, prompt: list[int], n: int, p: Penalties) -> list[int]:
    """Plain greedy decoding by full forwards, adjusting each position with reference_row."""
    output: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
        row = reference_row(logits.tolist(), prompt, output, p)
        output.append(int(np.argmax(row)))
    return output


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("penalties", [STRONG, Penalties(frequency=1.5), Penalties(repetition=6.0, presence=-0.3)])
def test_greedy_speculative_equals_plain_and_the_reference_under_penalties(arch, penalties):
    model = tiny_target(arch)
    drafter = tiny_drafter(model, block_size=5)
    target, plain_target = TargetAdapter(model, drafter.config.target_layer_ids), TargetAdapter(model)
    oracle = OracleDrafter(drafter.config, {})
    oracle.load_state_dict(drafter.state_dict())
    stats = DecodeStats(5)
    changed = []
    for seed in range(4):
        prompt = torch.randint(3, VOCAB, (3 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        options = DecodeOptions(max_new_tokens=20, penalties=penalties, tree=4)
        plain = [t for s in decode(plain_target, None, prompt, options) for t in s.tokens]
        assert plain == reference_greedy(model, prompt, 20, penalties)
        changed.append(
            plain != [t for s in decode(plain_target, None, prompt, DecodeOptions(max_new_tokens=20)) for t in s.tokens]
        )
        assert [t for s in decode(target, drafter, prompt, options) for t in s.tokens] == plain
        oracle.current = prompt + plain
        assert [t for s in decode(target, oracle, prompt, options, stats) for t in s.tokens] == plain
    assert any(changed)  # the penalties changed the output
    assert stats.tree is None  # chains under penalties
    assert sum(stats.accepted_lengths) > 20 and sum(
        a < d for a, d in zip(stats.accepted_lengths, stats.drafted_lengths)
    )


N_SAMPLED = 1500
ALLOWED = [10, 11, 12, 13]


class FourTokenDrafter(DFlashDrafter):
    """Proposes only the four tokens the test's logit bias leaves, with scores that vary by call."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.g = torch.Generator().manual_seed(0)

    def draft_scores(self, context, new_features, new_start, anchor, pos, k, embed_tokens, lm_head):
        super().draft_scores(context, new_features, new_start, anchor, pos, k, embed_tokens, lm_head)
        scores = torch.full((k, VOCAB), float("-inf"))
        scores[:, ALLOWED] = torch.randn(k, len(ALLOWED), generator=self.g)
        return scores, None


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_p=0.95)])
def test_sampled_decode_under_penalties_matches_the_adjusted_target(params):
    """A logit bias of -100 everywhere but four tokens keeps the joint of three tokens small enough to count;
    the penalties then reshape it by what was drawn before."""
    model = tiny_target("llama", num_hidden_layers=2)
    base = tiny_drafter(model, block_size=4, num_layers=1)
    drafter = FourTokenDrafter(base.config)
    drafter.load_state_dict(base.state_dict())
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    allowed = ALLOWED
    bias = {t: -100.0 for t in range(VOCAB) if t not in allowed} | {12: 0.5}
    penalties = Penalties(presence=0.6, frequency=0.8, repetition=1.5, logit_bias=bias)
    prompt = [10, 20, 30]

    def exact_joint(p: Penalties) -> np.ndarray:
        joint = np.zeros((4, 4, 4))
        for path in itertools.product(range(4), repeat=3):
            prob, output = 1.0, []
            for i in path:
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
                probs = warp(torch.tensor(reference_row(logits.tolist(), prompt, output, p))[None], params)[0]
                prob *= float(probs[allowed[i]])
                output.append(allowed[i])
            joint[path] = prob
        return joint

    exact = exact_joint(penalties)
    assert exact.sum() == pytest.approx(1.0, abs=1e-6)
    assert 0.5 * np.abs(exact - exact_joint(Penalties(logit_bias=bias))).sum() > 0.1  # the penalties matter
    counts = np.zeros((4, 4, 4))
    stats = DecodeStats(block_size=4)
    for seed in range(N_SAMPLED):
        options = DecodeOptions(max_new_tokens=4, sampling=params, seed=seed, penalties=penalties)
        tokens = [t for s in decode(target, drafter, prompt, options, stats) for t in s.tokens]
        counts[tuple(allowed.index(t) for t in tokens[:3])] += 1
    steps = [(a, d) for a, d in zip(stats.accepted_lengths, stats.drafted_lengths) if d > 0]
    assert sum(a for a, _ in steps) >= 0.05 * len(steps) and sum(a < d for a, d in steps) >= 0.05 * len(steps)
    assert_matches(counts, exact, f"penalties {params}: joint (t1, t2, t3)", p_min=P_MIN_E2E)


def test_coupled_sampling_under_penalties_is_the_seeds_plain_output():
    """Coupled sampling with penalties and a logit bias: each seed's tokens (fp32) are plain coupled sampling's of
    the adjusted target, drafts accepted and rejected along the way."""
    model = tiny_target("llama", num_hidden_layers=2)
    base = tiny_drafter(model, block_size=4, num_layers=1)
    drafter = FourTokenDrafter(base.config)
    drafter.load_state_dict(base.state_dict())
    target, plain = TargetAdapter(model, drafter.config.target_layer_ids), TargetAdapter(model)
    bias = {t: -100.0 for t in range(VOCAB) if t not in ALLOWED} | {12: 0.5}
    penalties = Penalties(presence=0.6, frequency=0.8, repetition=1.5, logit_bias=bias)
    stats = DecodeStats(block_size=4)
    for seed in range(40):
        options = DecodeOptions(
            max_new_tokens=10, sampling=SamplingParams(0.9), seed=seed, penalties=penalties, sampler="coupled"
        )
        expected = [t for s in decode(plain, None, [10, 20, 30], options) for t in s.tokens]
        assert set(expected) <= set(ALLOWED)
        assert [t for s in decode(target, drafter, [10, 20, 30], options, stats) for t in s.tokens] == expected
    steps = [(a, d) for a, d in zip(stats.accepted_lengths, stats.drafted_lengths) if d > 0]
    assert sum(a for a, _ in steps) >= 0.05 * len(steps) and sum(a < d for a, d in steps) >= 0.05 * len(steps)
