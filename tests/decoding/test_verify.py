"""Verification math (dflashkit.decoding.verify): rejection steps, chains, block verification and trees keep the
target's distribution."""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch

from dflashkit.decoding.sampling import (
    SamplingParams,
)
from dflashkit.decoding.tree import sample_tree
from dflashkit.decoding.verify import (
    block_residual,
    block_verification,
    verify_sampled,
    verify_sampled_logits,
    verify_tree_sampled,
)
from tests.decoding.test_sampling import (
    BASE_SEED,
    N_ANALYTIC,
    N_CHAIN,
    TV_ANALYTIC,
    V,
    assert_matches,
    markov_chain,
    pq_pair,
    prefix_rows,
    rrs_acceptance,
    tv_tolerance,
)


@pytest.mark.parametrize("case", ["full_support", "disjoint_zeros"])
@pytest.mark.parametrize("mode", ["sample", "one_hot"])
def test_rejection_step_emits_target_distribution(case, mode):
    p, p_next, q = pq_pair(case)
    target = torch.stack((p, p_next))
    g = torch.Generator().manual_seed(BASE_SEED + 11)
    if mode == "sample":
        drafts = torch.multinomial(q, N_ANALYTIC, replacement=True, generator=g)
        draft_probs = q[None]
        accept_rate = float(torch.minimum(p, q).sum())
    else:
        drafts = torch.full((N_ANALYTIC,), int(q.argmax()))
        draft_probs = None
        accept_rate = float(p[q.argmax()])
    first, bonus = np.zeros(V), np.zeros(V)
    accepted = 0
    for i in range(N_ANALYTIC):
        n_acc, token = verify_sampled(target, drafts[i : i + 1], draft_probs, g)
        if n_acc == 1:
            accepted += 1
            first[int(drafts[i])] += 1
            bonus[token] += 1  # all drafts accepted: the token comes from the next row
        else:
            assert n_acc == 0
            first[token] += 1
    assert 0 < accepted < N_ANALYTIC
    # acceptance: sum_x min(p, q) for x ~ q; p(argmax q) for a one-hot proposal. 4.5 sigma at 20k draws.
    sigma = math.sqrt(accept_rate * (1 - accept_rate) / N_ANALYTIC)
    assert abs(accepted / N_ANALYTIC - accept_rate) < 4.5 * sigma + 1e-9, (accepted / N_ANALYTIC, accept_rate)
    assert_matches(first, p.numpy(), f"first emitted token ({case}, {mode})", TV_ANALYTIC)
    assert_matches(
        bonus, p_next.numpy(), f"bonus token after acceptance ({case}, {mode})", tv_tolerance(p_next.numpy(), accepted)
    )


def test_rejection_step_degenerate_cases():
    g = torch.Generator().manual_seed(BASE_SEED)
    p = torch.tensor([0.0, 1.0, 0.0, 0.0])
    target = torch.stack((p, p))
    # a draft the target gives probability 0 is always rejected; the correction is the target's token
    for _ in range(50):
        assert verify_sampled(target, torch.tensor([0]), torch.tensor([[0.9, 0.1, 0.0, 0.0]]), g) == (0, 1)
        assert verify_sampled(target, torch.tensor([2]), None, g) == (0, 1)
        # a draft with target probability 1 is always accepted, then the bonus row is sampled
        assert verify_sampled(target, torch.tensor([1]), None, g) == (1, 1)
    # q == p: every draft is accepted (u * q < p with u < 1)
    p = torch.tensor([0.25, 0.25, 0.5])
    for x in range(3):
        assert verify_sampled(torch.stack((p, p)), torch.tensor([x]), p[None], g)[0] == 1
    # no drafts: one token from row 0
    assert verify_sampled(torch.tensor([[0.0, 0.0, 1.0]]), torch.empty(0, dtype=torch.long), None, g) == (0, 2)


@pytest.mark.parametrize("on_logits", [False, True])
@pytest.mark.parametrize("mode", ["sample", "one_hot"])
def test_chain_of_three_drafts_matches_markov_target(mode, on_logits):
    """Speculative decoding of 3 tokens after anchor 0 with k=3 drafts per step, on a Markov target:
    the joint of the 3 emitted tokens, and the 2nd token given the most frequent 1st one, are exact. ``on_logits``:
    verified from the target's logits by verify_sampled_logits (on a CPU with the row kernels: their verify_chain)."""
    trans, q = markov_chain(BASE_SEED + 3)
    anchor, n_tokens = 0, 3
    g = torch.Generator().manual_seed(BASE_SEED + 13)
    joint = np.zeros((6, 6, 6))
    accepted_hist = Counter()
    for _ in range(N_CHAIN):
        tokens, last = [], anchor
        while len(tokens) < n_tokens:
            if mode == "sample":
                drafts, draft_probs = torch.multinomial(q, 1, generator=g)[:, 0], q
            else:
                drafts, draft_probs = q.argmax(-1), None
            chain = [last] + drafts.tolist()
            if on_logits:
                n_acc, token = verify_sampled_logits(trans[chain].log(), SamplingParams(1.0), drafts, draft_probs, g)
            else:
                n_acc, token = verify_sampled(trans[chain], drafts, draft_probs, g)  # row j: P(. | chain[j])
            accepted_hist[n_acc] += 1
            tokens += drafts[:n_acc].tolist() + [token]
            last = tokens[-1]
        joint[tuple(tokens[:n_tokens])] += 1
    assert all(accepted_hist[a] > 0 for a in range(4)), accepted_hist  # 0..3 drafts accepted all occur
    t = trans.double().numpy()
    exact = t[anchor][:, None, None] * t[:, :, None] * t[None, :, :]  # P(x1) P(x2|x1) P(x3|x2)
    assert_matches(joint, exact, f"joint of 3 tokens ({mode})")
    top1 = int(joint.sum((1, 2)).argmax())
    second = joint[top1].sum(-1)
    assert_matches(second, t[top1], f"2nd token given 1st={top1} ({mode})")
    third = joint.sum((0, 1))
    assert_matches(third, exact.sum((0, 1)), f"3rd token ({mode})")


@pytest.mark.parametrize("kind", ["dense", "sparse", "shared"])
def test_block_verification_law_is_the_target_joint(kind):
    """Exact, no sampling: over every chain of 3 drafts (vocab 4), the stop probabilities and residuals of
    block verification, followed by the target's own sampling, give the target's joint of 4 tokens; and the
    drafts kept in expectation are at least token-by-token acceptance's (on dense rows by 1% or more)."""
    vocab, k = 4, 3
    row = prefix_rows(kind, vocab, BASE_SEED + 17)

    def target_prob(seq: tuple, start: int) -> float:  # P(seq[start:] | seq[:start]) under the target
        return math.prod(float(row(seq[:j], "p")[seq[j]]) for j in range(start, len(seq)))

    law: dict = defaultdict(float)
    kept_block = kept_token = 0.0
    for chain in itertools.product(range(vocab), repeat=k):
        q_rows = torch.stack([row(chain[:i], "q") for i in range(k)])  # [k, vocab]
        p_rows = torch.stack([row(chain[:i], "p") for i in range(k + 1)])  # [k+1, vocab]
        q_chain = math.prod(float(q_rows[i, chain[i]]) for i in range(k))
        if q_chain == 0:
            continue
        weights, stops = block_verification(p_rows, torch.tensor(chain), q_rows)
        assert all(h <= w + 1e-12 for h, w in zip(stops, weights[1:]))  # the bound verify_sampled skips rows by
        later = 1.0  # P(the kept prefix does not end after i)
        for i in range(k, -1, -1):
            ends = later * (stops[i - 1] if i else 1.0)
            later *= (1 - stops[i - 1]) if i else 0.0
            kept_block += q_chain * ends * i
            if ends == 0:
                continue
            after = p_rows[k] if i == k else block_residual(p_rows, q_rows, weights, i)
            for y in range(vocab):
                for tail in itertools.product(range(vocab), repeat=k - i):
                    full = chain[:i] + (y,) + tail
                    law[full] += q_chain * ends * float(after[y]) * target_prob(full, i + 1)
        ratios = [min(1.0, float(p_rows[i, chain[i]] / q_rows[i, chain[i]])) for i in range(k)]
        kept_token += q_chain * sum(math.prod(ratios[:n]) for n in range(1, k + 1))
    for full in itertools.product(range(vocab), repeat=k + 1):
        assert abs(law[full] - target_prob(full, 0)) < 1e-12, full
    assert kept_block >= kept_token - 1e-12
    if kind == "dense":
        assert kept_block > kept_token * 1.01, (kept_block, kept_token)


def test_block_verification_with_one_draft_is_the_rejection_step():
    p, p_next, q = pq_pair("full_support")
    x = int(q.argmin())
    weights, stops = block_verification(torch.stack((p, p_next)), torch.tensor([x]), q[None])
    assert stops == pytest.approx([min(1.0, float(p[x] / q[x]))])
    residual = block_residual(torch.stack((p, p_next)), q[None], weights, 0)
    expected = (p - q).clamp_min(0)
    torch.testing.assert_close(residual, expected / expected.sum())


def test_sampled_chain_keeps_the_drafts_block_verification_promises():
    """verify_sampled walks the stop probabilities the right way: its mean number of kept drafts matches the
    expectation from block_verification (within 4.5 sigma), above token-by-token acceptance's."""
    trans, q = markov_chain(BASE_SEED + 3)
    g = torch.Generator().manual_seed(BASE_SEED + 19)
    kept, promised, token_wise = [], [], []
    for _ in range(4000):
        drafts = torch.multinomial(q, 1, generator=g)[:, 0]
        target = trans[[0] + drafts.tolist()]
        _, stops = block_verification(target, drafts, q)
        later, expected = 1.0, 0.0
        for i in range(3, 0, -1):
            expected += later * stops[i - 1] * i
            later *= 1 - stops[i - 1]
        promised.append(expected)
        ratios = (target[torch.arange(3), drafts] / q[torch.arange(3), drafts]).clamp(max=1)
        token_wise.append(float(torch.cumprod(ratios, 0).sum()))
        kept.append(verify_sampled(target, drafts, q, g)[0])
    sigma = np.std(kept) / math.sqrt(len(kept))
    assert abs(np.mean(kept) - np.mean(promised)) < 4.5 * sigma, (np.mean(kept), np.mean(promised))
    assert np.mean(promised) > np.mean(token_wise), (np.mean(promised), np.mean(token_wise))


@pytest.mark.parametrize("case", ["full_support", "disjoint_zeros"])
def test_tree_rejection_sampling_emits_target_distribution(case):
    """A root with 3 sampled candidates tried in turn (dflashkit.decoding.tree.sample_tree + verify_tree_sampled): the
    first
    emitted token is distributed as p, the bonus token after an accepted candidate as that candidate's row, and
    the acceptance is what enumerating the algorithm gives, above a single draft's sum min(p, q)."""
    p, p_next, q = pq_pair(case)
    g = torch.Generator().manual_seed(BASE_SEED + 23)
    first, bonus, accepted = np.zeros(V), np.zeros(V), 0
    for _ in range(N_ANALYTIC):
        tree = sample_tree(q[None], None, 3, g)
        assert tree.depths == [1] * len(tree) and len(tree) == 3
        rows = torch.stack([p] + [p_next] * len(tree))  # every candidate's row: the bonus distribution
        path, token = verify_tree_sampled(rows, tree, q[None], g)
        if path:
            accepted += 1
            first[tree.tokens[path[0] - 1]] += 1
            bonus[token] += 1
        else:
            first[token] += 1
    rate = rrs_acceptance(p.double().numpy(), q.double().numpy(), 3)
    single = float(torch.minimum(p, q).sum())
    assert rate >= single - 1e-6 and (
        case != "full_support" or rate > single + 0.05
    )  # more than one draft accepts more
    sigma = math.sqrt(rate * (1 - rate) / N_ANALYTIC)
    assert abs(accepted / N_ANALYTIC - rate) < 4.5 * sigma, (accepted / N_ANALYTIC, rate)
    assert_matches(first, p.numpy(), f"first emitted token, tree ({case})", TV_ANALYTIC)
    assert_matches(
        bonus,
        p_next.numpy(),
        f"bonus token after an accepted candidate ({case})",
        tv_tolerance(p_next.numpy(), accepted),
    )


@pytest.mark.parametrize("budget", [3, 6])
def test_sampled_trees_match_markov_target(budget):
    """Sampled token trees over 3 block positions on the Markov target of the chain test: the joint of 3 emitted
    tokens is exact, and paths through later candidates and deeper nodes are taken."""
    trans, q = markov_chain(BASE_SEED + 3)
    g = torch.Generator().manual_seed(BASE_SEED + 27)
    joint = np.zeros((6, 6, 6))
    through_later, deep = 0, 0
    for _ in range(N_CHAIN):
        tokens, last = [], 0
        while len(tokens) < 3:
            tree = sample_tree(q, None, budget, g)
            rows = trans[[last] + tree.tokens]  # row of a node: P(. | its token), the Markov target's
            path, token = verify_tree_sampled(rows, tree, q, g)
            through_later += any(r != tree.children(tree.parents[r - 1])[0][1] for r in path)
            deep += len(path) >= 2
            tokens += [tree.tokens[r - 1] for r in path] + [token]
            last = tokens[-1]
        joint[tuple(tokens[:3])] += 1
    siblings = any(len(tree.children(r)) > 1 for r in range(len(tree) + 1))  # the shape depends on q only
    assert (through_later > 0) == siblings and (deep > 0 or budget < 6)
    t = trans.double().numpy()
    exact = t[0][:, None, None] * t[:, :, None] * t[None, :, :]
    assert_matches(joint, exact, f"joint of 3 tokens (sampled trees of {budget} nodes)")
