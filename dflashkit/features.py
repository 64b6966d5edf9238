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
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .fsutil import atomic_write

_STORAGE = {torch.bfloat16: np.uint16, torch.float16: np.float16, torch.float32: np.float32}  # bf16 kept as raw bits
FORMAT = "dflashkit-features/1"


def sequence_key(input_ids: Sequence[int]) -> str:
    """A short content hash of a token sequence (identifies a cache entry)."""
    return hashlib.sha1(np.asarray(input_ids, dtype=np.int64).tobytes()).hexdigest()[:16]


class FeatureStore:
    """Features [len_i, width] of sequences 0..N-1 in one file; ``get``/``put`` by sequence index."""

    def __init__(self, folder: str | os.PathLike, sequences: Sequence[Sequence[int]], width: int,
                 dtype: torch.dtype, signature: dict) -> None:
        if dtype not in _STORAGE:
            raise ValueError(f"feature store: unsupported dtype {dtype}")
        self.folder, self.width, self.dtype = Path(folder), int(width), dtype
        self.folder.mkdir(parents=True, exist_ok=True)
        self.keys = [sequence_key(s) for s in sequences]
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.signature = {"format": FORMAT, "width": self.width, "dtype": str(dtype), **signature}
        self.filled = np.zeros(len(self.keys), dtype=bool)
        meta_path, data_path = self.folder / "meta.json", self.folder / "features.bin"
        if meta_path.is_file() and data_path.is_file():
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            if meta.get("signature") == self.signature:
                old_keys, old_filled = meta.get("keys", []), meta.get("filled", [])
                same = 0  # offsets stay valid up to the first changed sequence
                while same < min(len(old_keys), len(self.keys)) and old_keys[same] == self.keys[same]:
                    same += 1
                self.filled[:same] = np.asarray(old_filled[:same], dtype=bool)
        item = np.dtype(_STORAGE[dtype]).itemsize
        needed = int(self.offsets[-1]) * self.width * item
        with open(data_path, "ab") as f:
            if f.tell() < needed:
                f.truncate(needed)
        rows = int(self.offsets[-1])
        self._array = np.memmap(data_path, dtype=_STORAGE[dtype], mode="r+", shape=(max(rows, 1), self.width))

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
        self._array[lo:hi] = raw.view(torch.int16).numpy().view(np.uint16) if self.dtype == torch.bfloat16 else raw.numpy()
        self.filled[index] = True

    def commit(self) -> None:
        """Flush the file, then record which entries are filled (atomic)."""
        self._array.flush()
        meta = {"signature": self.signature, "keys": self.keys, "filled": self.filled.astype(int).tolist()}
        atomic_write(self.folder / "meta.json", lambda f: json.dump(meta, f))
