"""Peers: transformers' generate (plain, prompt lookup, assisted) and llama.cpp (a stand-in module here)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from dflashkit.bench.methods import KERNELS, OTHER_WEIGHTS, Autoregressive, Request, TargetSession
from dflashkit.bench.peers import LlamaCpp, TransformersGenerate
from tests.conftest import tiny_target, word_tokenizer

PROMPT = [1, 5, 9, 17, 33, 5, 9, 40, 5, 9]


def request(temperature: float = 0.0, max_new_tokens: int = 16) -> Request:
    return Request(PROMPT, max_new_tokens, temperature, seed=3, stop_token_ids=frozenset({2}))


@pytest.fixture(scope="module")
def session() -> TargetSession:
    return TargetSession(tiny_target("llama", dtype=torch.float32), word_tokenizer())


def test_transformers_variants_give_the_baseline_tokens_in_fp32(session) -> None:
    base = Autoregressive(session).generate(request())
    assistant = tiny_target("llama", seed=5, num_hidden_layers=2)
    for m in (
        TransformersGenerate(session, "plain"),
        TransformersGenerate(session, "prompt-lookup", prompt_lookup_tokens=4),
        TransformersGenerate(
            session, "assisted", assistant=assistant, assistant_tokenizer=word_tokenizer(), assistant_label="tiny"
        ),
    ):
        assert m.unavailable() is None and m.comparable == KERNELS
        rec = m.generate(request())
        assert rec.tokens == base.tokens, m.name
        assert 0 < rec.ttft_s <= rec.total_s
        if m.variant == "plain":
            assert rec.accepted_lengths is None and rec.block_size == 1
        else:
            assert sum(a + 1 for a in rec.accepted_lengths) == len(rec.tokens)  # every token came from a step
    assert session.model.config._attn_implementation == "packed_gqa"


def test_sampling_settings_are_pure_temperature(session) -> None:
    m = TransformersGenerate(session, "prompt-lookup", prompt_lookup_tokens=4)
    cfg = m.generation_config(request(temperature=1.0))
    assert cfg.do_sample and cfg.temperature == 1.0 and cfg.top_k == 0 and cfg.top_p == 1.0
    assert cfg.prompt_lookup_num_tokens == 4 and cfg.eos_token_id == [2]
    assert not m.generation_config(request()).do_sample
    rec = m.generate(request(temperature=1.0))
    assert rec.tokens == m.generate(request(temperature=1.0)).tokens  # seeded


def test_assisted_without_a_usable_draft_is_unavailable(session) -> None:
    assert "no draft model" in TransformersGenerate(session, "assisted").unavailable()
    other = word_tokenizer()
    other.add_tokens(["zzz"])
    m = TransformersGenerate(session, "assisted", assistant=tiny_target("llama"), assistant_tokenizer=other)
    assert "tokenizer differs" in m.unavailable()


def test_llama_cpp_missing_is_a_clear_reason(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed: find_spec gives None
    reason = LlamaCpp("model.gguf", threads=2).unavailable()
    assert "llama-cpp-python is not installed" in reason and "dflashkit[llamacpp]" in reason


class FakeLlama:
    """Stands in for llama_cpp.Llama: yields a fixed token stream after the prompt."""

    instances: list[FakeLlama] = []

    def __init__(self, model_path, n_threads, n_threads_batch, n_ctx, seed, verbose) -> None:
        self.kwargs = dict(model_path=model_path, n_threads=n_threads, n_ctx=n_ctx)
        self.resets = 0
        self.calls: list[dict] = []
        FakeLlama.instances.append(self)

    def n_vocab(self) -> int:
        return 96

    def token_eos(self) -> int:
        return 2

    def reset(self) -> None:
        self.resets += 1

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def generate(self, tokens, **kw):
        self.calls.append({"tokens": list(tokens), **kw})
        yield from [7, 8, 9, 2, 10, 11]


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    module = types.ModuleType("llama_cpp")
    module.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    module.Llama = FakeLlama
    FakeLlama.instances = []
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    return module


def test_llama_cpp_peer_drives_llama_generate(fake_llama_cpp, tmp_path) -> None:
    gguf = tmp_path / "m.gguf"
    assert "does not exist" in LlamaCpp(gguf, threads=2).unavailable()
    assert "pass --gguf" in LlamaCpp(None, threads=2, missing_gguf="no GGUF: pass --gguf PATH").unavailable()
    gguf.write_bytes(b"GGUF")
    m = LlamaCpp(gguf, threads=2, vocab_size=96)
    assert m.unavailable() is None and m.comparable == OTHER_WEIGHTS
    rec = m.generate(request())
    llm = FakeLlama.instances[0]
    assert rec.tokens == [7, 8, 9, 2] and 0 < rec.ttft_s <= rec.total_s  # stops at eos, eos included
    assert llm.kwargs["n_threads"] == 2 and llm.resets == 1 and llm.calls[0]["tokens"] == PROMPT
    assert llm.calls[0]["temp"] == 0.0 and llm.calls[0]["repeat_penalty"] == 1.0
    assert m.generate(request(max_new_tokens=2)).tokens == [7, 8]
    m.generate(request(temperature=1.0))
    assert llm.calls[-1]["temp"] == 1.0 and llm.calls[-1]["top_k"] == 0 and llm.calls[-1]["top_p"] == 1.0
    assert len(FakeLlama.instances) == 1  # loaded once


def test_llama_cpp_refuses_another_vocabulary(fake_llama_cpp, tmp_path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="vocabulary"):
        LlamaCpp(gguf, threads=1, vocab_size=50).generate(request())
