"""A draft vocabulary widened by the generation's own text: which tokens join, the scores of their columns (every
packing state, int8 heads), the drafter's steps alone and batched, and decoding that stays plain decoding."""

from __future__ import annotations

import pytest
import torch

from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.drafter.text_columns import PACK_EVERY, TextColumns
from dflashkit.kernels.int8 import Int8Linear, quantize_weight
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_drafter, tiny_target

DRAFT_VOCAB = list(range(0, VOCAB, 3))  # a draft vocabulary of every third token


def columns_over(vocab: list[int]) -> TextColumns:
    return TextColumns(torch.tensor(vocab), frozenset(vocab))


def test_the_texts_tokens_outside_the_vocabulary_join_once_in_the_order_seen():
    text = columns_over([2, 4, 6])
    assert text.columns().tolist() == [2, 4, 6] and text.tokens == []
    text.add([4, 9, 2, 7, 9])
    text.add([6, 7, 11])
    assert text.tokens == [9, 7, 11]
    assert text.columns().tolist() == [2, 4, 6, 9, 7, 11]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_text_scores_are_the_full_heads_columns_whether_packed_or_not(dtype):
    """Scores of the text's columns equal those columns of the whole head: before any repacking, across the
    repacking at PACK_EVERY rows, with settled rows and a recent rest, and again after the head's weights change
    (bf16: the row kernels' products on a CPU that has them)."""
    hidden_size, vocab = 32, 3 * PACK_EVERY + 40
    head = torch.nn.Linear(hidden_size, vocab, bias=False).to(dtype)
    base = list(range(0, vocab, 4))
    outside = [t for t in range(vocab) if t % 4]
    text = columns_over(base)
    hidden = torch.randn(5, hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    base_scores = head(hidden)[:, base].detach()
    with torch.no_grad():
        for count in (0, 3, PACK_EVERY - 1, PACK_EVERY, PACK_EVERY + 5, 2 * PACK_EVERY + 7, len(outside)):
            text.add(outside[:count])
            got = text.scores(hidden, base_scores, head, 0)
            assert got.shape == (5, len(base) + count)
            torch.testing.assert_close(got, head(hidden)[:, text.columns()])
            assert torch.equal(got[:, : len(base)], base_scores)
        head.weight.mul_(-0.5)  # the caller's key moves with the weights: the rows are taken again
        torch.testing.assert_close(
            text.scores(hidden, base_scores, head, 1)[:, len(base) :], head(hidden)[:, text.tokens]
        )


def test_text_scores_read_an_int8_heads_own_rows():
    """An int8 head's rows, recent (fewer than PACK_EVERY) and settled."""
    hidden_size = 32
    head = Int8Linear(*quantize_weight(torch.randn(200, hidden_size)))
    text = columns_over(list(range(100)))
    hidden = torch.randn(3, hidden_size)
    with torch.inference_mode():
        full = head(hidden)
        text.add(range(90, 130))  # 30 outside: the recent rows only
        torch.testing.assert_close(text.scores(hidden, full[:, :100], head, 0), full[:, text.columns()])
        text.add(range(130, 200))
        got = text.scores(hidden, full[:, :100], head, 0)
    torch.testing.assert_close(got, full[:, text.columns()])


def restricted_pair(dtype: torch.dtype = torch.float32, fast: bool = False):
    """A tiny target, a drafter over the whole vocabulary and the same drafter over every third token."""
    model = tiny_target("qwen3", dtype=dtype)
    full = tiny_drafter(model, block_size=8)
    restricted = DFlashDrafter(full.config.replace(draft_vocab=DRAFT_VOCAB)).to(dtype).eval()
    restricted.load_state_dict(full.state_dict())
    for d in (full, restricted):
        d.use_fast_path(fast)
    return model, full, restricted


def test_a_drafting_step_scores_the_texts_tokens_as_the_whole_vocabulary_drafter_does():
    """With the text's tokens noted, a drafting step's columns are the draft vocabulary and then those tokens, and
    every column's scores are that token's scores from the same drafter over the whole vocabulary; with
    ``text_columns`` off, the draft vocabulary alone."""
    model, full, restricted = restricted_pair()
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    feats = torch.randn(1, 6, full.fc.in_features, generator=torch.Generator().manual_seed(4))
    text = [7, 8, 10, 9, 8, 1, 2]
    reference, _ = full.draft_scores(full.new_context(), feats, 0, 7, 6, 3, embed, head)  # [3, vocab]
    context = restricted.new_context()
    context.note_text(text)
    scores, columns = restricted.draft_scores(context, feats, 0, 7, 6, 3, embed, head)
    assert columns.tolist() == DRAFT_VOCAB + [7, 8, 10, 1, 2]
    torch.testing.assert_close(scores, reference[:, columns])
    restricted.text_columns = False
    context = restricted.new_context()
    context.note_text(text)
    scores, columns = restricted.draft_scores(context, feats, 0, 7, 6, 3, embed, head)
    assert columns.tolist() == DRAFT_VOCAB and scores.shape == (3, len(columns))


def test_batched_drafting_steps_give_each_sequence_its_own_texts_columns():
    """draft_scores_batch (bf16 fast path, one call for all): each sequence gets its own text's columns, its scores
    bitwise those of its step alone."""
    model, _, drafter = restricted_pair(torch.bfloat16, fast=True)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    prompts = [torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (10, 17)]
    features = [target.forward(p, 0, target.new_cache(), logits_rows=1)[1] for p in prompts]

    def calls():
        made = []
        for p, f, k in zip(prompts, features, (3, 6)):
            context = drafter.new_context(capacity=8)
            context.note_text(p[0].tolist())
            made.append((context, f, 0, 9, f.shape[1], k, embed, head))
        return made

    alone = [drafter.draft_scores(*c) for c in calls()]
    together = drafter.draft_scores_batch(calls())
    for (a, a_columns), (t, t_columns), p in zip(alone, together, prompts):
        outside = [x for x in dict.fromkeys(p[0].tolist()) if x % 3]
        assert a_columns.tolist() == t_columns.tolist() == DRAFT_VOCAB + outside
        assert torch.equal(a, t)


def test_decoding_proposes_the_texts_own_tokens_and_stays_plain_decoding(arch, monkeypatch):
    """Prompts of tokens outside the draft vocabulary: every drafting step scores the draft vocabulary and then the
    tokens of the prompt and of the output so far outside it, and greedy output is token for token plain greedy
    output, with the text's columns on and off."""
    model = tiny_target(arch)
    base = tiny_drafter(model, block_size=4)
    drafter = DFlashDrafter(base.config.replace(draft_vocab=DRAFT_VOCAB)).eval()
    drafter.load_state_dict(base.state_dict())
    target, plain = TargetAdapter(model, drafter.config.target_layer_ids), TargetAdapter(model)
    got: list[int] = []
    seen: list[tuple[list[int], list[int]]] = []  # per drafting step: (its columns, the output before it)
    draft_scores = drafter.draft_scores

    def recording(*args):
        scores, columns = draft_scores(*args)
        seen.append((columns.tolist(), list(got)))
        return scores, columns

    monkeypatch.setattr(drafter, "draft_scores", recording)
    options = DecodeOptions(max_new_tokens=12)
    for prompt in ([4, 5, 7, 4, 5, 7, 4], [10, 11, 13, 16]):
        expected = [t for s in decode(plain, None, prompt, options) for t in s.tokens]
        for on in (True, False):
            drafter.text_columns, got[:], seen[:] = on, [], []
            for step in decode(target, drafter, prompt, options):
                got.extend(step.tokens)
            assert got == expected
            assert seen
            for columns, before in seen:
                outside = [t for t in dict.fromkeys(prompt + before) if t not in DRAFT_VOCAB] if on else []
                assert columns == DRAFT_VOCAB + outside


def test_the_decode_loop_reports_the_whole_text_in_order(monkeypatch):
    """The drafter's context hears the prompt, then every emitted token, once and in order (so that a token the
    output brings in becomes a column from the next step on)."""
    from dflashkit.drafter.context import ContextCache

    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=4)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    heard: list[int] = []
    monkeypatch.setattr(ContextCache, "note_text", lambda self, ids: heard.extend(ids))
    prompt = [4, 5, 7, 9]
    for block_size in (2, 4):
        heard.clear()
        out = [
            t
            for s in decode(target, drafter, prompt, DecodeOptions(max_new_tokens=11, block_size=block_size))
            for t in s.tokens
        ]
        assert heard == prompt + out
