"""Disk cache of the target's feature-layer outputs for training sequences (one memory-mapped file).

Training reads the target's hidden states at every position of every sequence, every epoch; computing them
costs a full target forward (as much as the drafter step itself on a CPU), and keeping them in memory does
not scale (SmolLM2-135M, 3 feature layers, bf16: 3.5 KB per token, ~12 GB for 3.4M tokens). This store
keeps them in one file under the run folder, filled lazily the first time a sequence is used, so each
sequence costs one target forward per run, not one per epoch; the operating system's page cache serves
repeated reads. ``commit()`` flushes the file and then records which sequences are filled, so a killed run
keeps every committed entry and never trusts an uncommitted one. Entries are keyed by a hash of the
sequence's tokens: a data folder that changes (e.g. grows by more shards) only recomputes what changed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dflashkit.fsutil import atomic_write

_STORAGE = {torch.bfloat16: np.uint16, torch.float16: np.float16, torch.float32: np.float32}  # bf16 kept as raw bits
FORMAT = "dflashkit-features/1"


def sequence_key(input_ids: Sequence[int]) -> str:
    """A short content hash of a token sequence (identifies a cache entry)."""
    return hashlib.sha1(np.asarray(input_ids, dtype=np.int64).tobytes()).hexdigest()[:16]


class FeatureStore:
    """Features [len_i, width] of sequences 0..N-1 in one file; ``get``/``put`` by sequence index."""

    def __init__(
        self,
        folder: str | os.PathLike,
        sequences: Sequence[Sequence[int]],
        width: int,
        dtype: torch.dtype,
        signature: dict,
    ) -> None:
        if dtype not in _STORAGE:
            raise ValueError(f"feature store: unsupported dtype {dtype}")
        self.folder, self.width, self.dtype = Path(folder), int(width), dtype
        self.folder.mkdir(parents=True, exist_ok=True)
        self.keys = [sequence_key(s) for s in sequences]
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.signature = {"format": FORMAT, "width": self.width, "dtype": str(dtype), **signature}
        self.filled = np.zeros(len(self.keys), dtype=bool)
        self.data_file = "features.bin"
        meta_path = self.folder / "meta.json"
        old = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else None
        if old is not None and old.get("signature") == self.signature:
            self._reuse(old, lengths)
        self._open()

    def _open(self) -> None:
        item = np.dtype(_STORAGE[self.dtype]).itemsize
        rows = int(self.offsets[-1])
        data_path = self.folder / self.data_file
        with open(data_path, "ab") as f:
            if f.tell() < rows * self.width * item:
                f.truncate(rows * self.width * item)
        self._array = np.memmap(data_path, dtype=_STORAGE[self.dtype], mode="r+", shape=(max(rows, 1), self.width))

    def _reuse(self, old: dict, lengths: np.ndarray) -> None:
        """Mark the committed entries of the previous store that this sequence list still uses.

        Entries at the same place stay where they are; if sequences moved (a data folder added or
        reordered), the reusable entries are copied into a new file laid out for this list.
        """
        old_keys, old_file = old.get("keys", []), old.get("data_file", "features.bin")
        old_lengths = old.get("lengths")
        if old_lengths is None:  # written before lengths were recorded: known for the sequences still used
            by_key = dict(zip(self.keys, lengths.tolist()))
            old_lengths = list(itertools.takewhile(lambda n: n is not None, (by_key.get(k) for k in old_keys)))
        old_offsets = np.concatenate([[0], np.cumsum(old_lengths, dtype=np.int64)])
        committed = {k: j for j, (k, f) in enumerate(zip(old_keys[: len(old_lengths)], old.get("filled", []))) if f}
        matches = [(i, committed[k]) for i, k in enumerate(self.keys) if k in committed]  # (new index, old index)
        if all(old_offsets[j] == self.offsets[i] for i, j in matches):
            self.data_file = old_file
            for i, _ in matches:
                self.filled[i] = True
            return
        old_path = self.folder / old_file
        self.data_file = "features-" + hashlib.sha1("".join(self.keys).encode()).hexdigest()[:12] + ".bin"
        self._open()
        rows = int(old_offsets[-1])
        source = np.memmap(old_path, dtype=_STORAGE[self.dtype], mode="r", shape=(max(rows, 1), self.width))
        for i, j in matches:
            self._array[int(self.offsets[i]) : int(self.offsets[i + 1])] = source[old_offsets[j] : old_offsets[j + 1]]
            self.filled[i] = True
        del source
        self.commit()  # meta.json now names the new file; only then the old one goes
        if old_path.name != self.data_file:
            old_path.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def num_filled(self) -> int:
        return int(self.filled.sum())

    def has(self, index: int) -> bool:
        return bool(self.filled[index])

    def get(self, index: int) -> Tensor:
        """Features of sequence ``index`` [len, width] (a copy, in the store's dtype)."""
        if not self.filled[index]:
            raise KeyError(f"features of sequence {index} are not in the store")
        lo, hi = int(self.offsets[index]), int(self.offsets[index + 1])
        return torch.from_numpy(np.array(self._array[lo:hi])).view(self.dtype)

    def put(self, index: int, features: Tensor) -> None:
        """Store features [len, width] of sequence ``index`` (durable after the next ``commit``)."""
        lo, hi = int(self.offsets[index]), int(self.offsets[index + 1])
        if tuple(features.shape) != (hi - lo, self.width):
            raise ValueError(f"sequence {index}: features {tuple(features.shape)}, expected {(hi - lo, self.width)}")
        raw = features.detach().to("cpu", self.dtype).contiguous()
        self._array[lo:hi] = (
            raw.view(torch.int16).numpy().view(np.uint16) if self.dtype == torch.bfloat16 else raw.numpy()
        )
        self.filled[index] = True

    def commit(self) -> None:
        """Flush the file, then record which entries are filled (atomic)."""
        self._array.flush()
        meta = {
            "signature": self.signature,
            "data_file": self.data_file,
            "keys": self.keys,
            "lengths": np.diff(self.offsets).tolist(),
            "filled": self.filled.astype(int).tolist(),
        }
        atomic_write(self.folder / "meta.json", lambda f: json.dump(meta, f))
