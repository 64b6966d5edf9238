"""Which target a drafter belongs to: identity metadata, the embedding fingerprint, and refusing wrong targets."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from dflashkit.drafter.identity import (
    FINGERPRINT_DIMS,
    FINGERPRINT_ROWS,
    check_compatible,
    config_identity,
    drafter_config_for,
    embedding_fingerprint,
    portable_name,
    target_identity,
)
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import IncompatibleDrafterError
from dflashkit.generator import SpeculativeGenerator
from tests.conftest import VOCAB, tiny_target, word_tokenizer


def tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer()


@pytest.fixture(scope="module")
def model_a() -> torch.nn.Module:
    return tiny_target("llama", seed=0)


@pytest.fixture(scope="module")
def drafter_a(model_a) -> DFlashDrafter:
    torch.manual_seed(1)
    return DFlashDrafter(drafter_config_for(model_a, num_layers=2, block_size=4)).eval()


def test_identity_metadata(model_a) -> None:
    ident = target_identity(model_a)
    assert ident["hidden_size"] == 64 and ident["vocab_size"] == VOCAB and ident["num_hidden_layers"] == 6
    assert ident["model_type"] == "llama" and ident["architecture"]
    assert len(ident["embedding_fingerprint"]) == FINGERPRINT_ROWS * FINGERPRINT_DIMS
    cfg = drafter_config_for(model_a, num_layers=2)
    assert cfg.target == ident
    assert embedding_fingerprint(model_a.get_input_embeddings()) == embedding_fingerprint(
        model_a.get_input_embeddings()
    )


@pytest.mark.parametrize(
    "name,recorded",
    [
        ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B"),  # a hub id keeps its owner
        ("gpt2", "gpt2"),
        ("/srv/models/smollm2-135m-instruct", "smollm2-135m-instruct"),  # absolute, whether or not it exists here
        ("/srv/models/smollm2-135m-instruct/", "smollm2-135m-instruct"),
        ("~/models/tiny", "tiny"),
        ("./checkpoints/tiny", "tiny"),
        ("C:\\models\\tiny", "tiny"),
        ("", None),
        (None, None),
    ],
)
def test_portable_name_keeps_hub_ids_and_drops_local_folders(name, recorded) -> None:
    assert portable_name(name) == recorded


def test_identity_records_a_local_target_by_its_folder_name(model_a, tmp_path: Path, monkeypatch) -> None:
    """A drafter trained on a target loaded from a folder records the folder's name, never the training machine's
    path (which would ship in the drafter's config.json); a relative path that exists here counts as a folder."""
    folder = tmp_path / "models" / "tiny-llama"
    folder.mkdir(parents=True)
    config = copy.deepcopy(model_a.config)
    config._name_or_path = str(folder)
    assert config_identity(config)["name_or_path"] == "tiny-llama"
    monkeypatch.chdir(tmp_path)
    config._name_or_path = "models/tiny-llama"
    assert config_identity(config)["name_or_path"] == "tiny-llama"
    config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"  # no such folder here: a hub id
    assert config_identity(config)["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = copy.deepcopy(model_a)
    model.config._name_or_path = str(folder)
    assert drafter_config_for(model, num_layers=2).target["name_or_path"] == "tiny-llama"


def test_accepted_for_its_own_target(model_a, drafter_a, arch: str) -> None:
    check_compatible(drafter_a.config, model_a)
    bf16 = copy.deepcopy(model_a).to(torch.bfloat16)
    check_compatible(drafter_a.config, bf16)
    model = tiny_target(arch, seed=4)  # both architectures
    check_compatible(drafter_config_for(model, num_layers=2), model)
    check_compatible(drafter_config_for(model, num_layers=2), copy.deepcopy(model).to(torch.bfloat16))


def test_fingerprint_survives_bf16(model_a) -> None:
    fp32 = torch.tensor(embedding_fingerprint(model_a.get_input_embeddings()))
    bf16 = torch.tensor(embedding_fingerprint(copy.deepcopy(model_a).to(torch.bfloat16).get_input_embeddings()))
    cos = float(torch.nn.functional.cosine_similarity(fp32, bf16, dim=0))
    print(f"fingerprint cosine fp32 vs bf16: {cos:.6f}")
    assert cos > 0.999
    other = torch.tensor(embedding_fingerprint(tiny_target("llama", seed=9).get_input_embeddings()))
    assert abs(float(torch.nn.functional.cosine_similarity(fp32, other, dim=0))) < 0.5  # other weights: ~0


@pytest.mark.parametrize(
    "other,problem",
    [
        (dict(seed=5), r"embedding fingerprint \(cosine similarity"),
        (dict(hidden_size=32), "hidden size 64 \\(target: 32\\)"),
        (dict(vocab_size=128), "vocabulary 96 \\(target: 128\\)"),
        (dict(num_hidden_layers=3), r"feature layers \[1, 3\] \(target has 3 layers\)"),
        (dict(num_hidden_layers=4), "trained for a 6-layer target"),
    ],
    ids=["same-shape-other-weights", "hidden-size", "vocab", "too-few-layers", "other-depth"],
)
def test_refused_for_another_target(drafter_a, other: dict, problem: str) -> None:
    model_b = tiny_target("llama", **other)
    with pytest.raises(IncompatibleDrafterError, match=problem) as info:
        check_compatible(drafter_a.config, model_b)
    assert "does not fit the target" in str(info.value) and "built for" in str(info.value)
    with pytest.raises(IncompatibleDrafterError, match=problem):
        SpeculativeGenerator(model_b, tokenizer(), drafter_a)
    if other == dict(seed=5):  # also in bf16
        with pytest.raises(IncompatibleDrafterError, match="fingerprint"):
            check_compatible(drafter_a.config, model_b.to(torch.bfloat16))


def test_generator_accepts_and_casts_a_fitting_drafter(model_a) -> None:
    torch.manual_seed(2)
    drafter = DFlashDrafter(drafter_config_for(model_a, num_layers=2, block_size=4)).eval()  # fp32
    bf16 = copy.deepcopy(model_a).to(torch.bfloat16)
    gen = SpeculativeGenerator(bf16, tokenizer(), drafter)
    assert next(gen.drafter.parameters()).dtype == torch.bfloat16
    assert gen.target.feature_layer_ids == drafter.config.target_layer_ids
    result = gen.generate([5, 6, 7], max_new_tokens=4)
    assert 1 <= len(result.token_ids) <= 4


def test_drafter_without_identity_is_checked_by_shape_only(model_a) -> None:
    cfg = drafter_config_for(model_a, num_layers=2).replace(target=None)  # e.g. an official drafter
    check_compatible(cfg, tiny_target("llama", seed=5))
    with pytest.raises(IncompatibleDrafterError, match="hidden size"):
        check_compatible(cfg, tiny_target("llama", hidden_size=32))


def test_degenerate_embedding_is_refused(drafter_a, model_a) -> None:
    zero = copy.deepcopy(model_a)
    with torch.no_grad():
        zero.get_input_embeddings().weight.zero_()  # cosine similarity is undefined (nan): refuse
    with pytest.raises(IncompatibleDrafterError, match="fingerprint"):
        check_compatible(drafter_a.config, zero)
