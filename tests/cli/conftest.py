"""The command-line tests' fixture: the tiny offline target in place of load_target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dflashkit
import dflashkit.drafter.registry
import dflashkit.target.loading
from dflashkit.kernels.quantize import quantize_model
from tests.cli.helpers import fake_model, make_tokenizer


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Replace load_target (looked up in dflashkit.target.loading at call time) by the tiny offline target."""
    calls = []

    def fake_load_target(name_or_path=None, *, dtype=torch.bfloat16, device="cpu", progress=False, quantize=None):
        calls.append((name_or_path, dtype, str(device)))
        return quantize_model(fake_model(dtype).to(device), quantize), make_tokenizer()

    monkeypatch.setattr(dflashkit.target.loading, "load_target", fake_load_target)
    monkeypatch.setattr(dflashkit, "load_target", fake_load_target)
    monkeypatch.setattr(dflashkit.drafter.registry, "DRAFTERS_DIR", Path("/nonexistent"))  # no shipped drafter for it
    return calls
