"""The on-disk feature cache: exact round trip, commit semantics, reuse across changed data."""

from __future__ import annotations

import pytest
import torch

from dflashkit.training.features import FeatureStore

SIG = {"target_layer_ids": [1, 3]}


def _seqs():
    return [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_is_exact_and_survives_reopening(tmp_path, dtype):
    store = FeatureStore(tmp_path, _seqs(), width=4, dtype=dtype, signature=SIG)
    feats = [torch.randn(len(s), 4).to(dtype) * 1000 for s in _seqs()]
    for i in (2, 0):
        store.put(i, feats[i])
    assert store.has(0) and not store.has(1) and store.has(2)
    torch.testing.assert_close(store.get(2), feats[2], rtol=0, atol=0)
    with pytest.raises(KeyError):
        store.get(1)
    store.commit()
    store.put(1, feats[1])  # never committed: a reopened store must not trust it
    again = FeatureStore(tmp_path, _seqs(), width=4, dtype=dtype, signature=SIG)
    assert [again.has(i) for i in range(3)] == [True, False, True]
    torch.testing.assert_close(again.get(0), feats[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected"):
        again.put(1, torch.zeros(3, 4, dtype=dtype))


def test_changed_data_or_settings_recompute(tmp_path):
    store = FeatureStore(tmp_path, _seqs(), width=2, dtype=torch.float32, signature=SIG)
    for i, s in enumerate(_seqs()):
        store.put(i, torch.full((len(s), 2), float(i)))
    store.commit()
    grown = FeatureStore(tmp_path, _seqs() + [[1, 2]], width=2, dtype=torch.float32, signature=SIG)
    assert [grown.has(i) for i in range(4)] == [True, True, True, False]
    assert float(grown.get(2)[0, 0]) == 2.0
    changed = FeatureStore(tmp_path, [[5, 6, 7], [8, 4], [10, 11, 12, 13]], width=2, dtype=torch.float32, signature=SIG)
    assert [changed.has(i) for i in range(3)] == [True, False, True]  # same content at the same place: kept
    assert float(changed.get(2)[0, 0]) == 2.0
    other = FeatureStore(tmp_path, _seqs(), width=2, dtype=torch.float32, signature={"target_layer_ids": [2, 3]})
    assert other.num_filled == 0


def _filled_store(folder, seqs, dtype=torch.float32):
    store = FeatureStore(folder, seqs, width=2, dtype=dtype, signature=SIG)
    for i, s in enumerate(seqs):
        store.put(i, torch.tensor([[float(t), float(-t)] for t in s], dtype=dtype))
    store.commit()
    return store


@pytest.mark.parametrize("legacy_meta", [False, True])
def test_moved_sequences_are_copied_not_recomputed(tmp_path, legacy_meta):
    import json

    _filled_store(tmp_path, _seqs())
    if legacy_meta:  # stores written before the layout was recorded
        meta = json.loads((tmp_path / "meta.json").read_text())
        del meta["lengths"], meta["data_file"]
        (tmp_path / "meta.json").write_text(json.dumps(meta))
    moved = [[1, 2, 3, 4, 5], [10, 11, 12, 13], [5, 6, 7], [99]]  # new sequences first, one old one dropped
    store = FeatureStore(tmp_path, moved, width=2, dtype=torch.float32, signature=SIG)
    # a legacy store's layout is known only up to its first sequence no longer used ([8, 9])
    reused = (2,) if legacy_meta else (1, 2)
    assert [store.has(i) for i in range(4)] == [i in reused for i in range(4)]
    for i in reused:
        expected = torch.tensor([[float(t), float(-t)] for t in moved[i]])
        torch.testing.assert_close(store.get(i), expected, rtol=0, atol=0)
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == [store.data_file]  # the old file is gone
    store.put(0, torch.zeros(5, 2))
    store.commit()
    again = FeatureStore(tmp_path, moved, width=2, dtype=torch.float32, signature=SIG)
    assert [again.has(i) for i in range(4)] == [i == 0 or i in reused for i in range(4)]
    torch.testing.assert_close(again.get(2), store.get(2), rtol=0, atol=0)
