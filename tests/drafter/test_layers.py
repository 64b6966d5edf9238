"""The drafter's layers (dflashkit.drafter.layers): block-sparse training attention equals the dense mask."""

from __future__ import annotations

import torch

from tests.conftest import tiny_drafter, tiny_target


def test_block_sparse_training_attention_equals_the_dense_mask():
    from dflashkit.drafter.layers import BlockMask
    from dflashkit.training.losses import context_mask, sample_anchors, training_attention_mask

    model = tiny_target("qwen3")
    drafter = tiny_drafter(model, block_size=4)
    torch.manual_seed(3)
    S, L, B = 2, 19, 4
    loss_mask = torch.rand(S, L) > 0.3
    loss_mask[1] = False
    loss_mask[1, 5:7] = True  # one valid anchor: the other two blocks of sequence 1 are padding
    anchors, keep = sample_anchors(loss_mask, 3, torch.Generator().manual_seed(0))
    assert keep[0].all() and keep[1].tolist() == [True, False, False]
    feats = torch.randn(S, L, drafter.fc.in_features)
    block = torch.randn(S, 3 * B, drafter.config.hidden_size)
    positions = (anchors[:, :, None] + torch.arange(B)).flatten(1)
    with torch.no_grad():
        ctx = drafter.context_key_values(feats, torch.arange(L))
        sparse = drafter(block, positions, ctx, BlockMask(context_mask(anchors, keep, L, B), B))
        dense = drafter(block, positions, ctx, training_attention_mask(anchors, keep, L, B))
    rows = keep.repeat_interleave(B, 1)  # padding blocks: dense rows are empty (NaN), sparse rows see their block
    torch.testing.assert_close(sparse[rows], dense[rows], rtol=1e-4, atol=1e-5)
    assert torch.isfinite(sparse).all()
