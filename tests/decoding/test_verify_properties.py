"""Property-based checks of the verification math (dflashkit.decoding.verify) over distributions hypothesis draws:
block verification's exact law is the target's joint for any target and drafter rows (zeros included), and greedy
verification keeps exactly the drafts that equal the target's argmax."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflashkit.decoding.verify import block_residual, block_verification, verify_greedy

MAX_VOCAB, MAX_K = 3, 2


def _row(weights: list[float]) -> torch.Tensor:
    """A distribution from non-negative weights (all zero: the first token's)."""
    t = torch.tensor(weights, dtype=torch.float64)
    if float(t.sum()) == 0:
        t[0] = 1.0
    return t / t.sum()


# a row's weights, zeros likely; each prefix (a tuple of tokens) gets rows of its own
weights = st.lists(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0, 3.0, 7.0]), min_size=MAX_VOCAB, max_size=MAX_VOCAB)
prefixes = [p for n in range(MAX_K + 2) for p in itertools.product(range(MAX_VOCAB), repeat=n)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    vocab=st.integers(2, MAX_VOCAB),
    k=st.integers(1, MAX_K),
    p_table=st.lists(weights, min_size=len(prefixes), max_size=len(prefixes)),
    q_table=st.lists(weights, min_size=len(prefixes), max_size=len(prefixes)),
)
def test_block_verification_emits_the_targets_joint(vocab: int, k: int, p_table: list, q_table: list) -> None:
    """Exact, no sampling: over every chain of k drafts, the kept prefix's stop probabilities, the residual or the
    bonus row after it, then the target's own steps, give the target's joint law of k + 1 tokens."""
    rows = {pre: (_row(p[:vocab]), _row(q[:vocab])) for pre, p, q in zip(prefixes, p_table, q_table)}
    p_of = lambda pre: rows[pre][0]  # noqa: E731
    q_of = lambda pre: rows[pre][1]  # noqa: E731

    def target(seq: tuple, start: int) -> float:  # P(seq[start:] | seq[:start])
        return math.prod(float(p_of(seq[:j])[seq[j]]) for j in range(start, len(seq)))

    law: dict = defaultdict(float)
    for chain in itertools.product(range(vocab), repeat=k):
        q_chain = math.prod(float(q_of(chain[:i])[chain[i]]) for i in range(k))
        if q_chain == 0:  # a chain the drafter never draws
            continue
        q_rows = torch.stack([q_of(chain[:i]) for i in range(k)])
        p_rows = torch.stack([p_of(chain[:i]) for i in range(k + 1)])
        w, stops = block_verification(p_rows, torch.tensor(chain), q_rows)
        later = 1.0  # P(the kept prefix is not longer than i)
        for i in range(k, -1, -1):
            ends = later * (stops[i - 1] if i else 1.0)
            later *= (1 - stops[i - 1]) if i else 0.0
            if ends == 0:
                continue
            after = p_rows[k] if i == k else block_residual(p_rows, q_rows, w, i)
            for y in range(vocab):
                for tail in itertools.product(range(vocab), repeat=k - i):
                    seq = (*chain[:i], y, *tail)
                    law[seq] += q_chain * ends * float(after[y]) * target(seq, i + 1)
    for seq in itertools.product(range(vocab), repeat=k + 1):
        assert abs(law[seq] - target(seq, 0)) < 1e-9, (seq, law[seq], target(seq, 0))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    logits=st.lists(st.lists(st.floats(-5, 5), min_size=4, max_size=4), min_size=2, max_size=6),
    data=st.data(),
)
def test_greedy_verification_keeps_the_drafts_equal_to_the_argmax(logits: list, data: st.DataObject) -> None:
    rows = torch.tensor(logits)
    k = rows.shape[0] - 1
    best = rows.argmax(-1).tolist()
    drafts = data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k))
    accepted, token = verify_greedy(rows, torch.tensor(drafts))
    expected = next((i for i in range(k) if drafts[i] != best[i]), k)
    assert (accepted, token) == (expected, best[expected])
