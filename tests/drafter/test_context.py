"""The drafter's context cache (dflashkit.drafter.context): grown step by step it equals one pass; a window
drafts as if the context held only its rows."""

from __future__ import annotations

import pytest
import torch

from dflashkit.errors import InvalidInputError
from tests.conftest import tiny_drafter, tiny_target


def test_incremental_context_equals_one_shot():
    model = tiny_target("qwen3")
    drafter = tiny_drafter(model, block_size=4)
    torch.manual_seed(2)
    feats = torch.randn(1, 13, drafter.fc.in_features)
    context = drafter.new_context(capacity=4)  # forces growth
    for a, b in [(0, 5), (5, 6), (6, 13)]:
        with torch.no_grad():
            context.append(drafter.context_key_values(feats[:, a:b], torch.arange(a, b)))
    with torch.no_grad():
        one_shot = drafter.context_key_values(feats, torch.arange(13))
    assert context.length == 13
    for (k1, v1), (k2, v2) in zip(context.layers(), one_shot):
        torch.testing.assert_close(k1, k2)
        torch.testing.assert_close(v1, v2)


def test_a_context_window_drafts_as_if_the_context_held_only_its_rows():
    """With a window of w rows, drafting attends to the last w context rows only: the same scores as a context
    holding just those rows (keys rotated at the same positions); a window as wide as the context changes nothing."""
    model = tiny_target("qwen3")
    drafter = tiny_drafter(model, block_size=4)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    feats = torch.randn(1, 13, drafter.fc.in_features, generator=torch.Generator().manual_seed(5))

    def scores(window: int | None, first: int = 0) -> torch.Tensor:
        context = drafter.new_context(capacity=4, window=window)  # grows while appending
        with torch.no_grad():
            out = drafter.draft_scores(context, feats[:, first:], first, 7, 13, 3, embed, head)[0]
        assert context.length == 13 - first and context.first == max(0, context.length - (window or 13))
        return out

    windowed = scores(5)
    assert torch.equal(windowed, scores(None, first=8))
    assert not torch.allclose(windowed, scores(None))  # the window matters here
    assert torch.equal(scores(13), scores(None))
    with pytest.raises(InvalidInputError, match="context window"):
        drafter.new_context(window=0)

    # rows the window has passed when they arrive are never computed, also when they arrive in pieces
    context = drafter.new_context(capacity=4, window=5)
    computed = []
    key_values = drafter.context_key_values
    drafter.context_key_values = lambda f, p: computed.append(p.tolist()) or key_values(f, p)
    with torch.no_grad():
        for a, b in [(0, 6), (6, 9), (9, 13)]:
            drafter.draft_scores(context, feats[:, a:b], a, 7, b, 3, embed, head)
        pieces = drafter.draft_scores(context, None, 0, 7, 13, 3, embed, head)[0]
    assert computed == [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]] and context.stored_from == 1
    torch.testing.assert_close(pieces, windowed)  # (rows computed in other groupings: float rounding)
    with pytest.raises(InvalidInputError, match="skipped"):
        context.crop(5)
