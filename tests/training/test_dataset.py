"""Training sequences from shards (dflashkit.training.dataset): several folders, answers kept once each."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashkit.training import dataset


def test_load_sequences_from_several_folders(tmp_path):
    from dflashkit.training import regenerate as regeneration
    from dflashkit.training import sources as data
    from dflashkit.training.dataset import load_sequences
    from tests.training.test_sources import make_model, make_tokenizer, word_prompts

    model, tok = make_model(), make_tokenizer()
    for name, seed in (("a", 1), ("b", 2)):
        regeneration.regenerate(
            model, tok, word_prompts(4, seed=seed), tmp_path / name, batch_size=4, max_new_tokens=6, progress=False
        )

    def plain(seqs):
        return [(s.input_ids, s.num_prompt) for s in seqs]

    a, b = load_sequences(tmp_path / "a", 64), load_sequences(tmp_path / "b", 64)
    both = load_sequences(f"{tmp_path / 'a'},{tmp_path / 'b'}", 64)
    assert a and b and plain(both) == plain(a) + plain(b)
    assert [s.source for s in both] == [0] * len(a) + [1] * len(b)
    again = load_sequences(f"{tmp_path / 'a'},{tmp_path / 'b'},{tmp_path / 'a'}", 64)
    assert plain(again) == plain(a) + plain(b)  # repeats used once
    with pytest.raises(data.DataError):
        load_sequences(f"{tmp_path / 'a'},{tmp_path / 'missing'}", 64)


def test_several_answers_to_a_prompt_are_kept_once_each(monkeypatch):
    """Sampled regenerations give a prompt several answers: each distinct one trains; repeats and prefixes of a
    kept answer do not; a longer answer replaces the prefix it extends."""
    from dflashkit.training.dataset import load_sequences

    folders = {
        "a": [{"prompt_ids": [1, 2], "response_ids": [5, 6, 7]}, {"prompt_ids": [3], "response_ids": [8, 9]}],
        "b": [
            {"prompt_ids": [1, 2], "response_ids": [5, 6, 7]},  # the same answer again
            {"prompt_ids": [1, 2], "response_ids": [5, 6]},  # a prefix of it (shorter length limit)
            {"prompt_ids": [1, 2], "response_ids": [6, 6, 6]},  # another (sampled) answer
            {"prompt_ids": [3], "response_ids": [8, 9, 10, 11]},
        ],  # extends a kept answer
    }
    monkeypatch.setattr(dataset, "load_shards", lambda folder, **_: iter(folders[Path(folder).name]))
    seqs = load_sequences("a,b", 64)
    assert [(s.input_ids, s.num_prompt, s.source) for s in seqs] == [
        ([1, 2, 5, 6, 7], 2, 0),
        ([1, 2, 6, 6, 6], 2, 1),
        ([3, 8, 9, 10, 11], 1, 0),
    ]
