"""DrafterConfig and the default choice of target feature layers (published DFlash conventions)."""

from __future__ import annotations

import json

import pytest

from dflashkit.drafter.config import DrafterConfig, build_target_layer_ids
from dflashkit.drafter.identity import drafter_config_for
from dflashkit.errors import CheckpointError, DFlashError, InvalidInputError
from tests.conftest import VOCAB, tiny_target

# (target layers, features) -> ids, as in the configs of the published z-lab drafters.
PUBLISHED = [
    (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-8B / Qwen3-4B
    (24, 5, [1, 6, 11, 16, 21]),
    (32, 5, [1, 8, 15, 22, 29]),
    (40, 5, [1, 10, 19, 28, 37]),
    (64, 5, [1, 16, 31, 46, 61]),
    (28, 5, [1, 7, 13, 19, 25]),
    (16, 5, [1, 4, 7, 10, 13]),
    (52, 5, [1, 13, 25, 37, 49]),
]


@pytest.mark.parametrize("layers,features,expected", PUBLISHED)
def test_build_target_layer_ids_published_table(layers: int, features: int, expected: list[int]) -> None:
    assert build_target_layer_ids(layers, features) == expected


@pytest.mark.parametrize("layers", [2, 6, 7, 30, 36, 64])
def test_one_feature_is_the_middle_layer(layers: int) -> None:
    assert build_target_layer_ids(layers, 1) == [layers // 2]


def test_smollm2_layer_ids() -> None:
    ids = build_target_layer_ids(30, 5)
    print(f"SmolLM2-135M (30 layers), 5 features -> target_layer_ids {ids}")
    # 1 + i * 26/4 = 1, 7.5, 14, 20.5, 27; Python's round() rounds halves to even: 7.5 -> 8, 20.5 -> 20.
    assert ids == [1, 8, 14, 20, 27]
    assert ids[0] == 1 and ids[-1] == 30 - 3 and ids == sorted(set(ids))


@pytest.mark.parametrize("layers,features", [(6, 0), (6, -1), (4, 5), (3, 2)])
def test_build_target_layer_ids_refuses_impossible_requests(layers: int, features: int) -> None:
    with pytest.raises(InvalidInputError):
        build_target_layer_ids(layers, features)


# ---- DrafterConfig ------------------------------------------------------------------------------------


def make_config(**changes) -> DrafterConfig:
    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        num_target_layers=6,
        target_layer_ids=[1, 3],
        mask_token_id=VOCAB - 1,
        block_size=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
    )
    fields.update(changes)
    return DrafterConfig(**fields)


@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("with_target", [False, True])
def test_hf_dict_round_trip(learned: bool, with_target: bool) -> None:
    if with_target:
        cfg = drafter_config_for(tiny_target("qwen3"), num_layers=3, block_size=4, mask_token_id=None if learned else 5)
        assert cfg.target is not None and cfg.target["embedding_fingerprint"]
    else:
        cfg = make_config(learned_mask_embedding=learned)
    assert cfg.learned_mask_embedding == learned
    d = json.loads(json.dumps(cfg.to_hf_dict()))  # through JSON, as on disk
    back = DrafterConfig.from_hf_dict(d)
    assert back == cfg


def test_hf_dict_published_fields() -> None:
    cfg = make_config(target_layer_ids=[1, 2, 4], block_size=16, mask_token_id=7)
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["DFlashDraftModel"]
    assert d["model_type"] == "qwen3"
    assert d["block_size"] == 16 and d["num_target_layers"] == 6
    assert d["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [1, 2, 4], "block_size": 16}
    assert d["num_hidden_layers"] == 2 and d["head_dim"] == 16 and d["vocab_size"] == VOCAB
    assert d["layer_types"] == ["full_attention"] * 2 and not d["use_sliding_window"]
    assert d["rope_scaling"] is None


def test_for_target_matches_target_shape(arch: str) -> None:
    model = tiny_target(arch)
    cfg = DrafterConfig.for_target(model.config, num_layers=2, block_size=4)
    c = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 4, 2)
    assert cfg.head_dim == 16 and cfg.vocab_size == VOCAB and cfg.num_target_layers == c.num_hidden_layers
    assert cfg.target_layer_ids == build_target_layer_ids(6, 2) == [1, 3]
    assert cfg.learned_mask_embedding and cfg.mask_token_id == VOCAB - 1
    explicit = DrafterConfig.for_target(c, num_layers=2, mask_token_id=3, target_layer_ids=[0, 5])
    assert not explicit.learned_mask_embedding and explicit.mask_token_id == 3 and explicit.target_layer_ids == [0, 5]


def test_from_hf_dict_fills_defaults() -> None:
    d = make_config().to_hf_dict()
    del d["dflash_config"]["target_layer_ids"]  # derived from num_target_layers by the default rule
    d["num_hidden_layers"] = 3
    assert DrafterConfig.from_hf_dict(d).target_layer_ids == build_target_layer_ids(6, 3)
    d = make_config().to_hf_dict()
    d["mask_token_id"] = d.pop("dflash_config")["mask_token_id"]  # top-level mask_token_id (older layout)
    d["dflash_config"] = {"target_layer_ids": [1, 3]}
    assert DrafterConfig.from_hf_dict(d).mask_token_id == VOCAB - 1
    d = make_config().to_hf_dict()
    del d["num_target_layers"]
    assert DrafterConfig.from_hf_dict(d).num_target_layers == 4  # max(target_layer_ids) + 1


# ---- invalid configs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 0, -4])
def test_block_size_below_two_is_invalid_input(block_size: int) -> None:
    with pytest.raises(InvalidInputError, match="block_size"):
        make_config(block_size=block_size)
    with pytest.raises(InvalidInputError, match="block_size"):
        DrafterConfig.for_target(tiny_target("llama").config, num_layers=2, block_size=block_size)


@pytest.mark.parametrize("ids", [[], [6], [-1], [1, 3, 99]])
def test_invalid_target_layer_ids(ids: list[int]) -> None:
    with pytest.raises(CheckpointError, match="target_layer_ids"):
        make_config(target_layer_ids=ids)


@pytest.mark.parametrize("mask_id", [-1, VOCAB, VOCAB + 10])
def test_invalid_mask_token_id(mask_id: int) -> None:
    with pytest.raises(CheckpointError, match="mask_token_id"):
        make_config(mask_token_id=mask_id)


def test_heads_not_multiple_of_kv_heads() -> None:
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        make_config(num_attention_heads=4, num_key_value_heads=3)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {"type": "yarn", "factor": 4.0},  # legacy key
        {"rope_type": "linear", "factor": 2.0},
    ],
)
def test_rope_scaling_is_refused(rope_scaling: dict) -> None:
    d = make_config().to_hf_dict()
    d["rope_scaling"] = rope_scaling
    with pytest.raises(CheckpointError, match=r"rope_scaling.*not supported"):
        DrafterConfig.from_hf_dict(d)


def test_default_rope_scaling_is_accepted() -> None:
    d = make_config().to_hf_dict()
    d["rope_scaling"] = {"rope_type": "default"}
    assert DrafterConfig.from_hf_dict(d) == make_config()


def test_rope_parameters_yarn_is_refused() -> None:
    d = make_config().to_hf_dict()
    del d["rope_scaling"], d["rope_theta"]
    d["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
    }
    with pytest.raises(CheckpointError, match="not supported"):
        DrafterConfig.from_hf_dict(d)


def test_context_window_round_trips_and_bad_values_are_refused() -> None:
    cfg = make_config(context_window=96)
    d = json.loads(json.dumps(cfg.to_hf_dict()))
    assert d["dflashkit"]["context_window"] == 96 and DrafterConfig.from_hf_dict(d) == cfg
    del d["dflashkit"]["context_window"]  # older checkpoints: no window
    assert DrafterConfig.from_hf_dict(d).context_window is None
    for bad in (0, -3, 2.5, "64", True):
        d["dflashkit"]["context_window"] = bad
        with pytest.raises(CheckpointError, match="context window"):
            DrafterConfig.from_hf_dict(d)
        with pytest.raises(InvalidInputError, match="context window"):
            make_config(context_window=bad)


def test_proposal_temperature_round_trips_and_bad_values_are_refused() -> None:
    cfg = make_config(proposal_temperature=0.8)
    d = json.loads(json.dumps(cfg.to_hf_dict()))
    assert d["dflashkit"]["proposal_temperature"] == 0.8 and DrafterConfig.from_hf_dict(d) == cfg
    del d["dflashkit"]["proposal_temperature"]  # older checkpoints: the request's temperature
    assert DrafterConfig.from_hf_dict(d).proposal_temperature == 1.0
    for bad in (0, -0.5, float("nan"), float("inf"), "0.8", True, None):
        d["dflashkit"]["proposal_temperature"] = bad
        with pytest.raises(CheckpointError, match="proposal temperature"):
            DrafterConfig.from_hf_dict(d)
        with pytest.raises(InvalidInputError, match="proposal temperature"):
            make_config(proposal_temperature=bad)


@pytest.mark.parametrize("change", ["layer_types", "use_sliding_window"])
def test_sliding_window_layers_are_refused(change: str) -> None:
    d = make_config().to_hf_dict()
    if change == "layer_types":
        d["layer_types"] = ["full_attention", "sliding_attention"]
        d["sliding_window"] = 128
    else:
        d["use_sliding_window"] = True
        d["sliding_window"] = 128
    with pytest.raises(CheckpointError, match="sliding-window"):
        DrafterConfig.from_hf_dict(d)


@pytest.mark.parametrize(
    "field", ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
)
def test_missing_required_field(field: str) -> None:
    d = make_config().to_hf_dict()
    del d[field]
    with pytest.raises(CheckpointError, match=field):
        DrafterConfig.from_hf_dict(d)


def test_missing_mask_token_id_and_layers() -> None:
    d = make_config().to_hf_dict()
    del d["dflash_config"]["mask_token_id"]
    with pytest.raises(CheckpointError, match="mask_token_id"):
        DrafterConfig.from_hf_dict(d)
    d = make_config().to_hf_dict()
    del d["dflash_config"], d["num_target_layers"]
    with pytest.raises(CheckpointError, match="target_layer_ids"):
        DrafterConfig.from_hf_dict(d)


def test_errors_share_the_base_class() -> None:
    assert issubclass(CheckpointError, DFlashError) and issubclass(InvalidInputError, DFlashError)
    assert issubclass(InvalidInputError, ValueError)
