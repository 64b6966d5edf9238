"""Drafter checkpoints: the published folder layout, round trips, hand-written (z-lab style) folders, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import dflashkit.drafter.checkpoint as checkpoint
from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.stats import DecodeStats
from dflashkit.drafter.checkpoint import MASK_EMBEDDING_FILE, load_drafter, save_drafter
from dflashkit.drafter.identity import check_compatible, drafter_config_for
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import CheckpointError
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_target

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, DRAFT_LAYERS = 64, 128, 4, 2, 16, 2
LAYER_KEYS = {  # published names and shapes of one drafter layer
    "input_layernorm.weight": (HIDDEN,),
    "post_attention_layernorm.weight": (HIDDEN,),
    "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
    "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
    "self_attn.q_norm.weight": (HEAD_DIM,),
    "self_attn.k_norm.weight": (HEAD_DIM,),
    "mlp.gate_proj.weight": (INTER, HIDDEN),
    "mlp.up_proj.weight": (INTER, HIDDEN),
    "mlp.down_proj.weight": (HIDDEN, INTER),
}


def published_shapes(num_features: int, num_layers: int = DRAFT_LAYERS) -> dict[str, tuple[int, ...]]:
    shapes = {f"layers.{i}.{k}": s for i in range(num_layers) for k, s in LAYER_KEYS.items()}
    shapes.update(
        {"fc.weight": (HIDDEN, num_features * HIDDEN), "hidden_norm.weight": (HIDDEN,), "norm.weight": (HIDDEN,)}
    )
    return shapes


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_target("qwen3")


def random_drafter(model, *, learned: bool, dtype: torch.dtype = torch.float32, seed: int = 3) -> DFlashDrafter:
    """A drafter for `model` with every parameter randomised (norm weights too), so round trips are meaningful."""
    cfg = drafter_config_for(model, num_layers=DRAFT_LAYERS, block_size=4, mask_token_id=None if learned else 5)
    drafter = DFlashDrafter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    return drafter.to(dtype).eval()


def greedy(target: TargetAdapter, drafter, prompt: list[int], max_new: int = 16, stats: DecodeStats | None = None):
    options = DecodeOptions(max_new_tokens=max_new)
    return [t for step in decode(target, drafter, prompt, options, stats) for t in step.tokens]


# ---- layout of saved folders (read back without load_drafter) ------------------------------------------


@pytest.mark.parametrize("learned", [False, True])
def test_saved_folder_layout(tmp_path: Path, target, learned: bool) -> None:
    drafter = random_drafter(target, learned=learned, dtype=torch.bfloat16)
    path = save_drafter(drafter, tmp_path / "drafter")
    assert path == tmp_path / "drafter"
    expected_files = {"config.json", "model.safetensors"} | ({MASK_EMBEDDING_FILE} if learned else set())
    assert {p.name for p in path.iterdir()} == expected_files

    shapes = published_shapes(num_features=2)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert keys == set(shapes)  # exactly the published names: no `model.`, embed, lm_head, mask_embedding
        assert f.metadata() == {"format": "pt"}
        for k in keys:
            t = f.get_tensor(k)
            assert tuple(t.shape) == shapes[k], k
            assert t.dtype == torch.bfloat16
            assert torch.equal(t, drafter.state_dict()[k]), k
    assert "layers.0.self_attn.q_proj.weight" in keys and "layers.0.self_attn.q_norm.weight" in keys
    assert not any(k.startswith("model.") or "embed" in k or "lm_head" in k for k in keys)

    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 6 and cfg["num_hidden_layers"] == DRAFT_LAYERS
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3]
    assert cfg["dflash_config"]["mask_token_id"] == (VOCAB - 1 if learned else 5)
    assert cfg["dflashkit"]["learned_mask_embedding"] is learned
    assert cfg["dflashkit"]["target"]["embedding_fingerprint"]

    if learned:
        obj = torch.load(path / MASK_EMBEDDING_FILE, map_location="cpu", weights_only=True)
        assert set(obj) == {"mask_token_id", "embedding"}
        assert obj["mask_token_id"] == VOCAB - 1
        assert obj["embedding"].shape == (HIDDEN,)
        assert torch.equal(obj["embedding"], drafter.mask_embedding.detach())


# ---- round trips -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("learned", [False, True], ids=["token-mask", "learned-mask"])
def test_save_load_round_trip(tmp_path: Path, target, dtype: torch.dtype, learned: bool) -> None:
    drafter = random_drafter(target, learned=learned, dtype=dtype)
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", dtype=dtype)
    assert loaded.config == drafter.config
    assert (loaded.mask_embedding is not None) == learned
    a, b = drafter.state_dict(), loaded.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert b[k].dtype == dtype and torch.equal(a[k], b[k]), k
    assert not loaded.training


# ---- a checkpoint written by hand in the published (z-lab) layout ------------------------------------


def zlab_config(mask_token_id: int = VOCAB - 1) -> dict:
    """config.json of a published Qwen3 DFlash drafter, scaled down to the tiny qwen3 target."""
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 4,
        "bos_token_id": 1,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": [1, 3]},
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "layer_types": ["full_attention"] * DRAFT_LAYERS,
        "max_position_embeddings": 512,
        "max_window_layers": DRAFT_LAYERS,
        "model_type": "qwen3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": DRAFT_LAYERS,
        "num_key_value_heads": KV_HEADS,
        "num_target_layers": 6,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }


def write_zlab_checkpoint(
    path: Path, *, prefix: str = "", mask: str | None = None, seed: int = 11
) -> dict[str, torch.Tensor]:
    """Write config.json + model.safetensors (+ mask_embedding.pt) by hand; returns the unprefixed weights."""
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in published_shapes(num_features=2).items():
        base = 1.0 if len(shape) == 1 else 0.0
        weights[name] = (torch.randn(shape, generator=g) * 0.05 + base).to(torch.bfloat16)
    (path / "config.json").write_text(json.dumps(zlab_config(), indent=2))
    save_file({prefix + k: v for k, v in weights.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    if mask is not None:
        emb = (torch.randn(HIDDEN, generator=g) * 0.02).to(torch.bfloat16)
        torch.save(
            emb if mask == "tensor" else {"mask_token_id": VOCAB - 1, "embedding": emb}, path / MASK_EMBEDDING_FILE
        )
        weights["mask_embedding"] = emb
    return weights


@pytest.mark.parametrize(
    "prefix,mask",
    [("", None), ("model.", None), ("", "dict"), ("model.", "tensor")],
    ids=["plain", "model-prefix", "mask-dict", "model-prefix+mask-tensor"],
)
def test_hand_written_published_checkpoint_loads_and_decodes(
    tmp_path: Path, target, prefix: str, mask: str | None
) -> None:
    weights = write_zlab_checkpoint(tmp_path / "zlab", prefix=prefix, mask=mask)
    drafter = load_drafter(tmp_path / "zlab", dtype=torch.float32)
    cfg = drafter.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.block_size, cfg.vocab_size) == (HIDDEN, DRAFT_LAYERS, 4, VOCAB)
    assert cfg.target_layer_ids == [1, 3] and cfg.mask_token_id == VOCAB - 1 and cfg.num_target_layers == 6
    assert cfg.target is None and cfg.learned_mask_embedding == (mask is not None)
    state = drafter.state_dict()
    assert set(state) == set(weights)
    for k, w in weights.items():
        assert state[k].dtype == torch.float32 and torch.equal(state[k], w.float()), k

    check_compatible(cfg, target)  # no identity metadata: checked by shape only
    adapter = TargetAdapter(target, cfg.target_layer_ids)
    for prompt in ([5, 17, 42], [9, 8, 7, 6, 5, 4, 3], [60]):
        stats = DecodeStats(block_size=cfg.block_size)
        spec = greedy(adapter, drafter, prompt, stats=stats)
        assert spec == greedy(adapter, None, prompt)
        assert sum(stats.drafted_lengths) > 0  # the drafter really ran


def test_prefixed_checkpoint_with_embedding_and_head_loads(tmp_path: Path) -> None:
    write_zlab_checkpoint(tmp_path / "zlab", prefix="model.")
    state = load_file(tmp_path / "zlab" / "model.safetensors")
    state["model.embed_tokens.weight"] = torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16)
    state["lm_head.weight"] = torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16)
    save_file(state, str(tmp_path / "zlab" / "model.safetensors"))
    drafter = load_drafter(tmp_path / "zlab", dtype=torch.float32)
    assert "embed_tokens.weight" not in drafter.state_dict()


# ---- malformed checkpoints ----------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path, target) -> Path:
    """A valid checkpoint folder (learned mask) to break."""
    return save_drafter(random_drafter(target, learned=True), tmp_path / "ckpt")


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no config.json") as info:
        load_drafter(tmp_path / "does-not-exist")
    assert "does-not-exist" in str(info.value)


def test_folder_without_config(saved: Path) -> None:
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_drafter(saved)


def test_config_is_a_file_path(saved: Path) -> None:
    with pytest.raises(CheckpointError):
        load_drafter(saved / "config.json")


def test_invalid_json(saved: Path) -> None:
    (saved / "config.json").write_text('{"architectures": ["DFlashDraftModel"], ')
    with pytest.raises(CheckpointError, match="invalid JSON"):
        load_drafter(saved)


@pytest.mark.parametrize("archs", [["Qwen3ForCausalLM"], ["LlamaForCausalLM", "EagleModel"]])
def test_non_dflash_architecture(saved: Path, archs: list[str]) -> None:
    edit_config(saved, architectures=archs)
    with pytest.raises(CheckpointError, match="not a DFlash drafter"):
        load_drafter(saved)


@pytest.mark.parametrize("size", [HIDDEN - 1, HIDDEN + 1, 2 * HIDDEN])
def test_mask_embedding_of_wrong_size(saved: Path, size: int) -> None:
    torch.save({"mask_token_id": VOCAB - 1, "embedding": torch.zeros(size)}, saved / MASK_EMBEDDING_FILE)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_drafter(saved)
    torch.save(torch.zeros(size), saved / MASK_EMBEDDING_FILE)  # bare-tensor form
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_drafter(saved)


def test_mask_embedding_with_other_mask_token_id(saved: Path) -> None:
    torch.save({"mask_token_id": 7, "embedding": torch.zeros(HIDDEN)}, saved / MASK_EMBEDDING_FILE)
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_drafter(saved)


def test_mask_embedding_dict_without_embedding(saved: Path) -> None:
    torch.save({"mask_token_id": VOCAB - 1, "vector": torch.zeros(HIDDEN)}, saved / MASK_EMBEDDING_FILE)
    with pytest.raises(CheckpointError, match="embedding"):
        load_drafter(saved)


def test_learned_mask_vector_missing(saved: Path) -> None:
    """config.json says the mask vector was learned, but the file is gone: refused, not drafted with the wrong one."""
    (saved / MASK_EMBEDDING_FILE).unlink()
    with pytest.raises(CheckpointError, match="mask_embedding.pt is missing"):
        load_drafter(saved)


def test_missing_weights(saved: Path) -> None:
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        load_drafter(saved)


def test_extra_weight_key(saved: Path) -> None:
    state = load_file(saved / "model.safetensors")
    state["layers.2.mlp.up_proj.weight"] = torch.zeros(INTER, HIDDEN)
    save_file(state, str(saved / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected"):
        load_drafter(saved)


def test_missing_weight_key(saved: Path) -> None:
    state = load_file(saved / "model.safetensors")
    del state["layers.1.self_attn.k_norm.weight"]
    save_file(state, str(saved / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing"):
        load_drafter(saved)


def test_config_with_yarn_rope_scaling(saved: Path) -> None:
    edit_config(saved, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="rope_scaling"):
        load_drafter(saved)


def test_config_missing_field(saved: Path) -> None:
    cfg = json.loads((saved / "config.json").read_text())
    del cfg["intermediate_size"]
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="intermediate_size"):
        load_drafter(saved)


@pytest.mark.parametrize(
    "key,shape", [("fc.weight", (HIDDEN, 3 * HIDDEN)), ("layers.0.self_attn.q_proj.weight", (32, 64))]
)
def test_wrong_weight_shape(saved: Path, key: str, shape: tuple[int, int]) -> None:
    state = load_file(saved / "model.safetensors")
    state[key] = torch.zeros(shape)
    save_file(state, str(saved / "model.safetensors"))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_drafter(saved)


@pytest.mark.parametrize("text", ["[1, 2]", '"DFlashDraftModel"', "null"])
def test_config_json_not_an_object(saved: Path, text: str) -> None:
    (saved / "config.json").write_text(text)
    with pytest.raises(CheckpointError):
        load_drafter(saved)


@pytest.mark.parametrize("data", [b"garbage not a pickle", b"this is not a torch file", b""])
def test_corrupt_mask_embedding_file(saved: Path, data: bytes) -> None:
    (saved / MASK_EMBEDDING_FILE).write_bytes(data)
    with pytest.raises(CheckpointError, match=MASK_EMBEDDING_FILE):
        load_drafter(saved)


def test_corrupt_safetensors_file(saved: Path) -> None:
    (saved / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_drafter(saved)


def test_config_field_null(saved: Path) -> None:
    (saved / MASK_EMBEDDING_FILE).unlink()
    edit_config(saved, hidden_size=None)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_drafter(saved)


# ---- atomic save --------------------------------------------------------------------------------------


def test_overwrite_leaves_one_complete_checkpoint(tmp_path: Path, target) -> None:
    first = random_drafter(target, learned=True, seed=1)
    second = random_drafter(target, learned=False, seed=2)
    save_drafter(first, tmp_path / "d")
    (tmp_path / "d" / "stale.txt").write_text("left over from an older save")
    save_drafter(second, tmp_path / "d")
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temp or .old folders left behind
    assert {p.name for p in (tmp_path / "d").iterdir()} == {"config.json", "model.safetensors"}
    state = load_file(tmp_path / "d" / "model.safetensors")
    expected = second.state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(state[k], expected[k]) for k in state)
    assert json.loads((tmp_path / "d" / "config.json").read_text()) == json.loads(
        json.dumps(second.config.to_hf_dict())
    )


def test_failed_save_keeps_the_old_checkpoint(tmp_path: Path, target, monkeypatch: pytest.MonkeyPatch) -> None:
    save_drafter(random_drafter(target, learned=True, seed=1), tmp_path / "d")
    before = {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    with pytest.raises(OSError):
        save_drafter(random_drafter(target, learned=False, seed=2), tmp_path / "d")
    with pytest.raises(OSError):
        save_drafter(random_drafter(target, learned=False, seed=2), tmp_path / "new")
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # nothing half-written, no temp folders
    assert {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()} == before


def test_save_creates_parent_folders(tmp_path: Path, target) -> None:
    path = save_drafter(random_drafter(target, learned=False), tmp_path / "a" / "b" / "drafter")
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert os.listdir(tmp_path / "a" / "b") == ["drafter"]


def test_saved_folder_has_ordinary_permissions(tmp_path: Path, target) -> None:
    """The temporary folder comes from mkdtemp (mode 0700); the checkpoint must not stay private."""
    umask = os.umask(0)
    os.umask(umask)
    path = save_drafter(random_drafter(target, learned=True), tmp_path / "d")
    assert path.stat().st_mode & 0o777 == 0o777 & ~umask
    for f in path.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f.name


def test_draft_vocabulary_round_trip(tmp_path: Path) -> None:
    model = tiny_target("llama")
    cfg = drafter_config_for(model, num_layers=1, block_size=4).replace(draft_vocab=[2, 5, 7, 90])
    save_drafter(DFlashDrafter(cfg), tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", dtype=torch.float32)
    assert loaded.config.draft_vocab == [2, 5, 7, 90] and loaded.draft_vocab.tolist() == [2, 5, 7, 90]
    assert "draft_vocab" not in load_file(tmp_path / "d" / "model.safetensors")  # config only: other engines ignore it
    with pytest.raises(CheckpointError, match="draft_vocab"):
        cfg.replace(draft_vocab=[VOCAB])


def test_a_config_that_does_not_belong_to_the_weights(tmp_path: Path, target) -> None:
    """One line naming the first tensor that differs, not the whole state-dict mismatch."""
    path = save_drafter(random_drafter(target, learned=False), tmp_path / "ckpt")
    edit_config(
        path,
        hidden_size=2 * HIDDEN,
        head_dim=2 * HIDDEN // json.loads((path / "config.json").read_text())["num_attention_heads"],
    )
    with pytest.raises(
        CheckpointError, match=r"has shape .* implies .* more tensors differ: the config does not belong"
    ) as info:
        load_drafter(path)
    assert "\n" not in str(info.value)
