"""The drafter network: KV injection semantics, bidirectional block attention, incremental context."""

from __future__ import annotations

import math

import pytest
import torch

from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import InvalidInputError
from tests.conftest import tiny_drafter, tiny_target


def naive_layer_attention(layer, block_h, ctx, block_pos, ctx_pos, theta):
    """The DFlash attention of one layer written out per head, straight from the method's formulas."""
    attn = layer.self_attn
    hd, nh, nkv = attn.head_dim, attn.n_heads, attn.n_kv

    def rms(x, w, eps=1e-6):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [seq, hd]
        inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
        ang = pos.float()[:, None] * inv[None]  # [seq, hd/2]
        c, s = torch.cos(ang), torch.sin(ang)
        x1, x2 = x[:, : hd // 2], x[:, hd // 2 :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    x = rms(block_h, layer.input_layernorm.weight)  # only block tokens get input_layernorm
    q = (x @ attn.q_proj.weight.T).view(-1, nh, hd)
    k_all = torch.cat([ctx, x]) @ attn.k_proj.weight.T  # same Wk for context and block
    v_all = torch.cat([ctx, x]) @ attn.v_proj.weight.T
    k_all, v_all = k_all.view(-1, nkv, hd), v_all.view(-1, nkv, hd)
    pos_all = torch.cat([ctx_pos, block_pos])
    outs = []
    for h in range(nh):
        g = h // (nh // nkv)
        qh = rope(rms(q[:, h], attn.q_norm.weight), block_pos)
        kh = rope(rms(k_all[:, g], attn.k_norm.weight), pos_all)  # k_norm on context keys too
        scores = qh @ kh.T / math.sqrt(hd)  # no mask: bidirectional in the block, all context
        outs.append(scores.softmax(-1) @ v_all[:, g])
    return torch.cat(outs, -1) @ attn.o_proj.weight.T


def test_attention_matches_the_formulas():
    model = tiny_target("qwen3")
    drafter = tiny_drafter(model, block_size=4)
    torch.manual_seed(0)
    feats = torch.randn(1, 9, drafter.fc.in_features)
    block = torch.randn(1, 4, drafter.config.hidden_size)
    ctx_pos, block_pos = torch.arange(9), torch.arange(9, 13)
    with torch.no_grad():
        context = drafter.context_key_values(feats, ctx_pos)
        ctx_hidden = drafter.hidden_norm(drafter.fc(feats))[0]
        layer = drafter.layers[0]
        cos, sin = drafter.rotary(block_pos, block.dtype)
        got = layer.self_attn(layer.input_layernorm(block), cos, sin, context[0])[0]
        expected = naive_layer_attention(layer, block[0], ctx_hidden, block_pos, ctx_pos, drafter.config.rope_theta)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_block_attention_is_bidirectional_and_reads_context():
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=6)
    torch.manual_seed(1)
    feats = torch.randn(1, 5, drafter.fc.in_features)
    block = torch.randn(1, 6, drafter.config.hidden_size)
    pos = torch.arange(5, 11)
    with torch.no_grad():
        ctx = drafter.context_key_values(feats, torch.arange(5))
        out = drafter(block, pos, ctx)
        changed_last = block.clone()
        changed_last[0, -1] += 1.0
        out2 = drafter(changed_last, pos, ctx)
        feats2 = feats.clone()
        feats2[0, 0] += 1.0
        out3 = drafter(block, pos, drafter.context_key_values(feats2, torch.arange(5)))
    assert not torch.allclose(out[0, 0], out2[0, 0])  # the first position sees the last one
    assert not torch.allclose(out[0, 0], out3[0, 0])  # and the context


def test_drafter_owns_no_embedding_or_head():
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=4)
    vocab = model.config.vocab_size
    assert all(vocab not in p.shape for p in drafter.parameters())
    names = set(drafter.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= names
    assert drafter.fc.weight.shape == (64, 64 * len(drafter.config.target_layer_ids))


def test_learned_mask_vector_replaces_the_mask_row_only():
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=4, mask_token_id=None)
    embed = model.get_input_embeddings()
    mask_id = drafter.config.mask_token_id
    ids = torch.tensor([[5, mask_id, mask_id, 7]])
    with torch.no_grad():
        emb = drafter.embed(ids, embed)
    torch.testing.assert_close(emb[0, 0], embed.weight[5])
    torch.testing.assert_close(emb[0, 1], drafter.mask_embedding)
    torch.testing.assert_close(emb[0, 3], embed.weight[7])
    plain = DFlashDrafter(drafter.config.replace(learned_mask_embedding=False))
    with torch.no_grad():
        torch.testing.assert_close(plain.embed(ids, embed)[0, 1], embed.weight[mask_id])


@pytest.mark.parametrize("fast", [False, True])
def test_a_step_fills_its_block_as_block_fill_says(fast):
    """k drafts short of the trained block (block_size - 1): "whole" runs the whole block and scores its first k rows;
    "tail" runs k + 1 rows and the block's last row (its position: block_size - 1 after the anchor), the reference
    written out with the module's forward; "cut" k + 1 rows. The three differ; batched calls score the same."""
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=8)
    drafter.use_fast_path(fast)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    feats = torch.randn(1, 9, drafter.fc.in_features, generator=torch.Generator().manual_seed(6))

    def scores(k: int, fill: str) -> torch.Tensor:
        drafter.block_fill = fill
        with torch.no_grad():
            return drafter.draft_scores(drafter.new_context(), feats, 0, 7, 9, k, embed, head)[0]

    def reference(offsets: list[int]) -> torch.Tensor:  # the module's own forward over the block written out
        context = drafter.new_context()
        with torch.no_grad():
            drafter.draft_scores(context, feats, 0, 7, 9, 0, embed, head)  # the context rows only
            ids = torch.full((1, len(offsets)), drafter.config.mask_token_id)
            ids[0, 0] = 7
            hidden = DFlashDrafter.forward(
                drafter, drafter.embed(ids, embed), torch.tensor(offsets) + 9, context.layers()
            )
            return head(hidden[0, 1:])

    whole = scores(7, "whole")
    torch.testing.assert_close(whole, reference(list(range(8))))
    for k in (1, 3):
        assert scores(k, "whole").shape[0] == k
        torch.testing.assert_close(scores(k, "whole"), whole[:k])  # (a head over fewer rows: fp32 rounding only)
        tail = scores(k, "tail")
        torch.testing.assert_close(tail, reference(list(range(k + 1)) + [7])[:k])
        cut = scores(k, "cut")
        torch.testing.assert_close(cut, reference(list(range(k + 1))))
        assert min((tail - cut).abs().max(), (tail - whole[:k]).abs().max()) > 1e-3  # three different blocks
    torch.testing.assert_close(scores(6, "tail"), whole[:6])  # its last row is the next one: a whole block
    assert scores(9, "tail").shape[0] == 9
    drafter.block_fill = "tail"
    with torch.no_grad():
        batched = drafter.draft_scores_batch([(drafter.new_context(), feats, 0, 7, 9, k, embed, head) for k in (2, 5)])
    for (rows, _), k in zip(batched, (2, 5)):
        torch.testing.assert_close(rows, scores(k, "tail"))


def test_block_plans_and_the_default():
    """block_plan(k) = (drafts computed in a row, gap before the trained block's last row); None: "tail" on a CPU,
    "whole" where drafting replays graphs (one shape); an unknown fill is refused."""
    drafter = tiny_drafter(tiny_target("llama"), block_size=8)
    plans = {}
    for fill in ("whole", "tail", "cut"):
        drafter.block_fill = fill
        plans[fill] = [drafter.block_plan(k) for k in (0, 1, 3, 5, 6, 7, 9)]
    assert plans["whole"] == [(0, 0), (7, 0), (7, 0), (7, 0), (7, 0), (7, 0), (9, 0)]
    assert plans["tail"] == [(0, 0), (1, 5), (3, 3), (5, 1), (7, 0), (7, 0), (9, 0)]
    assert plans["cut"] == [(0, 0), (1, 0), (3, 0), (5, 0), (6, 0), (7, 0), (9, 0)]
    drafter.block_fill = None
    assert drafter.block_plan(3) == (3, 3)  # a CPU
    drafter.graphs = object()  # (drafting from graphs: a whole block, the one shape they are captured for)
    assert drafter.block_plan(3) == (7, 0)
    drafter.graphs, drafter.block_fill = None, "half"
    with pytest.raises(InvalidInputError, match="block_fill"):
        drafter.block_plan(3)


def test_draft_scores_are_the_draft_vocabulary_columns_of_the_full_head():
    """The decode loop proposes from draft_scores: without a draft vocabulary, logits [k, vocab] and no ids; with
    one, [k, V'] and its token ids, equal to those columns of the same drafter's full-vocabulary logits (the
    draft head reads the target head's rows of those ids, nothing else changes)."""
    model = tiny_target("llama")
    base = tiny_drafter(model, block_size=4)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    feats = torch.randn(1, 6, base.fc.in_features, generator=torch.Generator().manual_seed(4))
    vocab = model.config.vocab_size
    ids = list(range(1, vocab, 5))
    restricted = DFlashDrafter(base.config.replace(draft_vocab=ids))
    restricted.load_state_dict(base.state_dict())
    full, none = base.draft_scores(base.new_context(), feats, 0, 7, 6, 3, embed, head)
    assert none is None and full.shape == (3, vocab)
    scores, token_ids = restricted.draft_scores(restricted.new_context(), feats, 0, 7, 6, 3, embed, head)
    assert torch.equal(token_ids, torch.tensor(ids)) and scores.shape == (3, len(ids))
    torch.testing.assert_close(scores, full[:, ids])
