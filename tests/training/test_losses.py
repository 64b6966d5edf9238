"""Training losses (dflashkit.training.losses): anchors, the block mask, block states, the weighted, chunked and
soft losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflashkit.errors import InvalidInputError
from dflashkit.training import losses
from dflashkit.training.losses import (
    block_hidden,
    block_targets,
    position_weights,
    row_argmax,
    sample_anchors,
    training_attention_mask,
    weighted_block_loss,
)
from tests.training.test_trainer import reference_mask


@pytest.mark.parametrize("seq_len,B", [(1, 2), (5, 4), (20, 4), (33, 8)])
def test_mask_equals_elementwise_predicate(seq_len, B):
    g = torch.Generator().manual_seed(seq_len)
    loss_mask = torch.rand(3, seq_len, generator=g) > 0.3
    loss_mask[0] = False  # a sequence with no valid anchor: all padding blocks
    anchors, keep = sample_anchors(loss_mask, 4, g)
    got = training_attention_mask(anchors, keep, seq_len, B)
    assert torch.equal(got, reference_mask(anchors, keep, seq_len, B))
    assert not keep[0].any()


def test_anchor_sampler_respects_the_loss_mask():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        L = int(torch.randint(2, 40, (1,), generator=g))
        loss_mask = torch.rand(4, L, generator=g) > 0.4
        anchors, keep = sample_anchors(loss_mask, 8, g)
        for s in range(4):
            valid = {i for i in range(L - 1) if loss_mask[s, i] and loss_mask[s, i + 1]}
            chosen = anchors[s][keep[s]].tolist()
            assert set(chosen) <= valid and len(set(chosen)) == len(chosen) == min(len(valid), anchors.shape[1])
            assert chosen == sorted(chosen)
            assert (anchors[s][~keep[s]] == 0).all()


def test_anchor_sampler_is_uniform():
    loss_mask = torch.ones(1, 11, dtype=torch.bool)  # 10 valid anchors (0..9)
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(11)
    for _ in range(2000):
        a, _ = sample_anchors(loss_mask, 3, g)
        counts[a[0]] += 1
    assert counts[10] == 0
    assert (counts[:10] / 2000 - 0.3).abs().max() < 0.05  # each valid anchor drawn with p = 3/10


def test_position_weights_values():
    w = position_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    assert abs(float(w.sum()) - 6.63) < 0.01  # the paper's table for γ=7, B=16
    assert torch.allclose(position_weights(8, 4.0)[-1], torch.tensor(math.exp(-6 / 4)))


def test_loss_equals_naive_weighted_mean_including_cut_blocks():
    torch.manual_seed(0)
    S, L, B, V, gamma = 2, 12, 4, 7, 3.0
    ids = torch.randint(0, V, (S, L))
    lengths = torch.tensor([12, 7])  # the second sequence ends early: its late blocks are cut
    loss_mask = torch.zeros(S, L, dtype=torch.bool)
    loss_mask[0, 3:] = True
    loss_mask[1, 2:7] = True
    loss_mask[0, 8] = False  # an unsupervised hole inside the response: later positions still count
    anchors, keep = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(3))
    labels, weights = block_targets(ids, loss_mask, lengths, anchors, keep, B, gamma)
    logits = torch.randn(S, anchors.shape[1], B - 1, V)
    num = den = 0.0
    for s in range(S):
        for n in range(anchors.shape[1]):
            for k in range(1, B):
                p = int(anchors[s, n]) + k
                if not keep[s, n] or p >= int(lengths[s]) or not loss_mask[s, p]:
                    continue
                w = math.exp(-(k - 1) / gamma)
                ce = float(F.cross_entropy(logits[s, n, k - 1][None], ids[s, p][None]))
                num, den = num + w * ce, den + w
                assert labels[s, n, k - 1] == ids[s, p]
    assert den > 0
    assert abs(float(weighted_block_loss(logits, labels, weights)) - num / den) < 1e-5


def test_dpace_weights_equal_a_naive_computation(monkeypatch):
    """D-PACE: w_k = Σ_{j>=k} Π_{i<=j} s_i with s_i = (1-α) q_i + α, and s = 0 where an offset has no label (it can
    never be accepted, so nothing after it in the block counts); the label probabilities in row chunks."""
    from dflashkit.training.losses import acceptance_weights, block_cross_entropy

    def label_probabilities(logits, labels):  # the drafter's probability of each label, as loss_on derives it
        return torch.exp(-block_cross_entropy(logits, labels).detach())

    torch.manual_seed(0)
    S, N, K, V, alpha = 2, 3, 5, 9, 0.3
    logits = torch.randn(S, N, K, V)
    labels = torch.randint(0, V, (S, N, K))
    valid = torch.rand(S, N, K) > 0.25
    monkeypatch.setattr(losses, "LOSS_CHUNK_ROWS", 4)  # 30 rows in chunks of 4
    q = label_probabilities(logits, labels)
    assert torch.allclose(q, logits.softmax(-1).gather(-1, labels[..., None])[..., 0], atol=1e-6)
    w = acceptance_weights(q, valid, alpha)
    for s in range(S):
        for n in range(N):
            for k in range(K):
                want = 0.0
                if valid[s, n, k]:
                    for j in range(k, K):
                        prefix = 1.0
                        for i in range(j + 1):
                            prefix *= (1 - alpha) * float(q[s, n, i]) + alpha if valid[s, n, i] else 0.0
                        want += prefix
                assert abs(float(w[s, n, k]) - want) < 1e-5, (s, n, k)
    assert (w[~valid] == 0).all() and (w[valid] > 0).any()
    x = logits.clone().requires_grad_()
    weighted_block_loss(x, labels, acceptance_weights(label_probabilities(x, labels), valid, alpha)).backward()
    y = logits.clone().requires_grad_()
    weighted_block_loss(y, labels, w).backward()
    assert torch.equal(x.grad, y.grad)  # the weights carry no gradient: the loss is CE under fixed weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_and_the_accuracy_in_row_chunks_equal_them_in_one_piece(dtype, monkeypatch):
    """The loss runs over the logits in chunks of rows (and the accuracy's argmax too): the same loss, gradient
    and argmax as over all rows at once, with rows that do not divide into chunks and ties in bf16."""

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7, 11).to(dtype)  # 105 rows
    logits[0, 0, 0, 4] = logits[0, 0, 0, 9] = logits[0, 0, 0].max() + 1  # a tie: the first index wins
    labels = torch.randint(0, 11, (3, 5, 7))
    weights = torch.rand(3, 5, 7)
    results = {}
    for chunk in (8, 1000):
        monkeypatch.setattr(losses, "LOSS_CHUNK_ROWS", chunk)
        x = logits.clone().requires_grad_()
        loss = weighted_block_loss(x, labels, weights)
        loss.backward()
        results[chunk] = (loss.detach(), x.grad, row_argmax(x))
    (l1, g1, a1), (l2, g2, a2) = results[8], results[1000]
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert torch.equal(a1, a2) and torch.equal(a1, logits.float().argmax(-1)) and a1[0, 0, 0] == 4


def test_loss_chunks_are_small_on_a_cpu_and_large_elsewhere():
    from dflashkit.training.losses import DEVICE_LOSS_CHUNK_ROWS, LOSS_CHUNK_ROWS, loss_chunk_rows

    assert loss_chunk_rows(torch.zeros(2, 3)) == LOSS_CHUNK_ROWS == 256
    assert loss_chunk_rows(torch.zeros(2, 3, device="meta")) == DEVICE_LOSS_CHUNK_ROWS >= 64 * LOSS_CHUNK_ROWS


def test_soft_targets_and_loss_equal_a_naive_computation():
    from dflashkit.training.losses import soft_block_loss, soft_block_targets

    torch.manual_seed(1)
    S, L, B, V, K = 2, 10, 4, 9, 3
    full = torch.randn(S, L, V).log_softmax(-1)  # the target's log-probabilities after each position
    top = full.topk(K, -1)
    anchors = torch.tensor([[0, 3, 5], [1, 2, 6]])
    column_of = torch.tensor([0, 1, 2, 3, 4, 5, -1, -1, -1])  # a draft vocabulary of the first 6 tokens
    columns, probs = soft_block_targets(top.indices, top.values, anchors, B, column_of)
    logits = torch.randn(S, 3, B - 1, 6)
    weights = torch.rand(S, 3, B - 1) * (torch.rand(S, 3, B - 1) > 0.2)
    num = den = 0.0
    for s in range(S):
        for n in range(3):
            for k in range(1, B):
                row = min(int(anchors[s, n]) + k - 1, L - 1)  # the prediction of the token at anchor+k
                p = {int(t): math.exp(float(lp)) for t, lp in zip(top.indices[s, row], top.values[s, row]) if t < 6}
                total = sum(p.values())
                logq = logits[s, n, k - 1].log_softmax(-1)
                ce = -sum(v / total * float(logq[t]) for t, v in p.items()) if total else 0.0
                if total:
                    assert float(probs[s, n, k - 1].sum()) == pytest.approx(1.0, abs=1e-6)
                w = float(weights[s, n, k - 1])
                num, den = num + w * ce, den + w
    assert float(soft_block_loss(logits, columns, probs, weights)) == pytest.approx(num / den, abs=1e-5)


def test_block_hidden_is_each_block_run_alone_over_the_context_before_its_anchor():
    """The teacher-forced hidden states training scores: block n (its anchor token, then masks, at positions
    anchor..anchor+B-1) sees exactly the injected context of positions < anchor; from features or their context."""
    from dflashkit.target.adapter import TargetAdapter
    from tests.conftest import tiny_drafter, tiny_target

    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=4)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    features = target.features(ids)  # [1, 20, F]
    anchors, keep = torch.tensor([[2, 9, 15]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        got = block_hidden(drafter, ids, anchors, keep, target.embed_tokens, features=features)  # [1, 3, 3, H]
        context = drafter.context_key_values(features, torch.arange(20))
        assert torch.equal(block_hidden(drafter, ids, anchors, keep, target.embed_tokens, context=context), got)
        for n, a in enumerate(anchors[0].tolist()):
            block = torch.full((1, 4), drafter.config.mask_token_id)
            block[0, 0] = ids[0, a]
            alone = drafter(
                drafter.embed(block, target.embed_tokens),
                torch.arange(a, a + 4),
                drafter.context_key_values(features[:, :a], torch.arange(a)),
            )[0, 1:]
            torch.testing.assert_close(got[0, n], alone, rtol=1e-4, atol=1e-5)
    with pytest.raises(InvalidInputError, match="features"):
        block_hidden(drafter, ids, anchors, keep, target.embed_tokens)
