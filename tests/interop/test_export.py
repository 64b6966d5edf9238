"""Export: the published HF layout for vLLM / SGLang (fields their loaders read), the GGUF made by llama.cpp's
own converter (read back with `gguf`), and the refusal of a drafter exported against the wrong target."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflashkit.cli.main import main
from dflashkit.drafter.checkpoint import MASK_EMBEDDING_FILE, load_drafter, save_drafter
from dflashkit.drafter.identity import target_identity
from dflashkit.errors import IncompatibleDrafterError
from dflashkit.interop import export
from tests.conftest import VOCAB, tiny_drafter, tiny_target, word_tokenizer

DRAFT_VOCAB = [2, 5, 7, 11, 40, 41, 90, 95]

# Every config.json field the engines' DFlash loaders read, with the value it must have (c: DrafterConfig).
# vLLM: vllm/model_executor/models/qwen3_dflash.py, vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (adds 1
# to dflash_config.target_layer_ids unless eagle_aux_hidden_state_layer_ids is set), registry
# "DFlashDraftModel" -> DFlashQwen3ForCausalLM. SGLang: python/sglang/srt/models/dflash.py,
# python/sglang/srt/speculative/dflash_utils.py (parse_dflash_draft_config). llama.cpp: conversion/qwen.py
# (DFlashModel on Qwen3Model).
FIELD_TABLE = [
    ("vllm sglang llama.cpp", "architectures", lambda c: ["DFlashDraftModel"]),
    ("vllm sglang llama.cpp", "hidden_size", lambda c: c.hidden_size),
    ("vllm sglang llama.cpp", "intermediate_size", lambda c: c.intermediate_size),
    ("vllm sglang llama.cpp", "num_hidden_layers", lambda c: c.num_hidden_layers),
    ("vllm sglang llama.cpp", "num_attention_heads", lambda c: c.num_attention_heads),
    ("vllm sglang llama.cpp", "num_key_value_heads", lambda c: c.num_key_value_heads),
    ("vllm sglang llama.cpp", "head_dim", lambda c: c.head_dim),
    ("vllm sglang", "hidden_act", lambda c: "silu"),
    ("vllm sglang llama.cpp", "rms_norm_eps", lambda c: c.rms_norm_eps),
    ("vllm sglang llama.cpp", "rope_theta", lambda c: c.rope_theta),
    ("vllm", "rope_parameters", lambda c: {"rope_type": "default", "rope_theta": c.rope_theta}),
    ("vllm sglang llama.cpp", "max_position_embeddings", lambda c: c.max_position_embeddings),
    ("vllm llama.cpp", "vocab_size", lambda c: c.vocab_size),
    ("vllm sglang", "attention_bias", lambda c: False),
    ("vllm sglang", "layer_types", lambda c: ["full_attention"] * c.num_hidden_layers),
    ("vllm llama.cpp", "is_causal", lambda c: False),
    ("llama.cpp", "use_sliding_window", lambda c: False),
    ("sglang", "num_target_layers", lambda c: c.num_target_layers),
    ("sglang", "block_size", lambda c: c.block_size),
    ("vllm sglang llama.cpp", ("dflash_config", "mask_token_id"), lambda c: c.mask_token_id),
    ("vllm sglang llama.cpp", ("dflash_config", "target_layer_ids"), lambda c: c.target_layer_ids),  # 0-based
    ("sglang llama.cpp", ("dflash_config", "block_size"), lambda c: c.block_size),
]


def lookup(config: dict, key):
    return config[key[0]][key[1]] if isinstance(key, tuple) else config[key]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny llama target folder: weights, the word tokenizer, and a matching sentencepiece model (the
    tokenizer kind llama.cpp's converter accepts for a llama target)."""
    path = tmp_path_factory.mktemp("target")
    tiny_target("llama").save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    try:
        import sentencepiece as spm
    except ImportError:
        return path
    import io

    rng = random.Random(0)
    words = [f"w{i}" for i in range(4, VOCAB)]
    sentences = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(500)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=VOCAB,
        model_type="word",
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    (path / "tokenizer.model").write_bytes(model.getvalue())
    return path


def make_drafter(
    path: Path, *, learned: bool = True, draft_vocab: list[int] | None = DRAFT_VOCAB, seed: int = 0
) -> Path:
    model = tiny_target("llama", seed=seed)
    drafter = tiny_drafter(model, block_size=8, mask_token_id=None if learned else 5)
    drafter.config.target = target_identity(model)
    if draft_vocab is not None:
        drafter.config.draft_vocab = draft_vocab
    return save_drafter(drafter, path)


def test_hf_config_carries_every_field_the_engines_read(tmp_path: Path, target_dir: Path) -> None:
    result = export.export_hf(make_drafter(tmp_path / "d"), tmp_path / "out", target=str(target_dir))
    config = json.loads((result.path / "config.json").read_text())
    c = load_drafter(tmp_path / "d").config
    for engines, key, value in FIELD_TABLE:
        assert lookup(config, key) == value(c), (engines, key)
    assert "eagle_aux_hidden_state_layer_ids" not in config  # vLLM would take it as-is, without the +1
    assert config["draft_vocab_size"] == len(DRAFT_VOCAB)
    listed = {(engine, key) for engines, key, _ in FIELD_TABLE for engine in engines.split()}
    assert {(e, k) for e, keys in export.ENGINE_FIELDS.items() for k in keys} <= listed


def test_hf_export_files_and_round_trip(tmp_path: Path, target_dir: Path) -> None:
    result = export.export_hf(make_drafter(tmp_path / "d"), tmp_path / "out", target=str(target_dir))
    assert result.format == "hf" and result.path == tmp_path / "out"
    assert {p.name for p in result.path.iterdir()} == {"config.json", "model.safetensors", MASK_EMBEDDING_FILE}
    weights = load_file(result.path / "model.safetensors")
    head = tiny_target("llama").get_output_embeddings().weight.detach()
    # draft vocabulary as vLLM reads it: lm_head rows of the draft ids, d2t = target id - draft index
    assert torch.equal(weights["d2t"] + torch.arange(len(DRAFT_VOCAB)), torch.tensor(DRAFT_VOCAB))
    assert torch.equal(
        weights["lm_head.weight"], head[DRAFT_VOCAB].to(torch.bfloat16).to(weights["lm_head.weight"].dtype)
    )
    mask = torch.load(result.path / MASK_EMBEDDING_FILE, weights_only=True)
    assert mask["mask_token_id"] == VOCAB - 1 and mask["embedding"].shape == (64,)
    # dflashkit reads its own export back (lm_head and d2t are the target's, and ignored here)
    original, exported = load_drafter(tmp_path / "d"), load_drafter(result.path)
    assert exported.config.draft_vocab == DRAFT_VOCAB and exported.config.learned_mask_embedding
    for (k, v), (k2, v2) in zip(original.state_dict().items(), exported.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    assert "vllm serve" in result.commands["vllm"] and '"method": "dflash"' in result.commands["vllm"]
    assert '"num_speculative_tokens": 7' in result.commands["vllm"]
    assert "--speculative-algorithm DFLASH" in result.commands["sglang"]
    assert "--speculative-num-draft-tokens 8" in result.commands["sglang"]
    assert any("SGLang ignores mask_embedding.pt" in n for n in result.notes)
    assert any("draft vocabulary" in n for n in result.notes)


def test_export_refuses_a_drafter_of_another_target(tmp_path: Path, target_dir: Path, capsys) -> None:
    drafter = make_drafter(tmp_path / "d", seed=7)  # made for a different (seed 7) target
    with pytest.raises(IncompatibleDrafterError, match="refusing to export.*embedding fingerprint"):
        export.export_hf(drafter, tmp_path / "out", target=str(target_dir))
    assert not (tmp_path / "out").exists()
    assert (
        main(["export", str(drafter), "--format", "hf", "--target", str(target_dir), "--out", str(tmp_path / "o")]) == 2
    )
    assert "refusing to export" in capsys.readouterr().err
    if llama_cpp_dir() is not None:
        with pytest.raises(IncompatibleDrafterError):  # before the converter runs
            export.export_gguf(drafter, tmp_path / "g", target=str(target_dir))
        assert not (tmp_path / "g" / export.DRAFTER_GGUF).exists()


def test_export_never_destroys_what_is_at_its_output(tmp_path: Path, target_dir: Path, capsys) -> None:
    """The drafter's own folder, a file, or a folder holding other files are refused; an earlier export is
    replaced."""
    drafter = make_drafter(tmp_path / "d")
    (tmp_path / "d" / "README.md").write_text("card")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    (tmp_path / "a-file").write_text("keep me too")
    for out, message in (
        (drafter, "would overwrite the drafter"),
        (drafter / "sub", "would overwrite the drafter"),
        (tmp_path, "would overwrite the drafter"),
        (precious, "notes.txt"),
        (tmp_path / "a-file", "is a file"),
    ):
        with pytest.raises(export.ExportError, match=message):
            export.export_hf(drafter, out, target=str(target_dir))
        assert main(["export", str(drafter), "--format", "hf", "--target", str(target_dir), "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert (precious / "notes.txt").read_text() == "keep me" and (tmp_path / "a-file").read_text() == "keep me too"
    assert (drafter / "README.md").read_text() == "card"
    first = export.export_hf(drafter, tmp_path / "out", target=str(target_dir))
    again = export.export_hf(drafter, tmp_path / "out", target=str(target_dir))  # an earlier export: replaced
    assert first.path == again.path and (again.path / "model.safetensors").is_file()
    with pytest.raises(export.ExportError, match="is a file"):
        export.export_gguf(drafter, tmp_path / "a-file", target=str(target_dir), llama_cpp=tmp_path)


def test_cli_export_prints_the_serving_commands(tmp_path: Path, target_dir: Path, capsys) -> None:
    drafter = make_drafter(tmp_path / "d", learned=False, draft_vocab=None)
    assert main(["export", str(drafter), "--format", "hf", "--target", str(target_dir)]) == 0
    out, err = capsys.readouterr()
    assert (tmp_path / "d-hf" / "model.safetensors").is_file()  # default --out: beside the drafter
    assert "vllm serve" in out and "sglang.launch_server" in out and str(tmp_path / "d-hf") in out
    assert "note:" not in err  # fixed mask id, full vocabulary: exact in every engine


def test_gguf_export_without_llama_cpp_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(export.LLAMA_CPP_ENV, raising=False)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    with pytest.raises(export.ExportError, match="get_llama_cpp.sh"):
        export.find_llama_cpp()
    with pytest.raises(export.ExportError, match="no convert_hf_to_gguf.py"):
        export.find_llama_cpp(tmp_path)


# ---- GGUF through llama.cpp's converter ------------------------------------------------------------------------


def llama_cpp_dir() -> str | None:
    try:
        return str(export.find_llama_cpp())
    except export.ExportError:
        return None


def gguf_or_skip(target_dir: Path) -> str:
    root = llama_cpp_dir()
    if root is None:
        pytest.skip(
            f"no llama.cpp converter: set {export.LLAMA_CPP_ENV} to a llama.cpp checkout "
            "(bash scripts/get_llama_cpp.sh fetches one into the dflashkit cache)"
        )
    if not (target_dir / "tokenizer.model").is_file():
        pytest.skip("sentencepiece is not installed (llama.cpp's converter needs it): pip install -e '.[export]'")
    return root


def read_gguf(path: Path):
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: t for t in reader.tensors}


LAYER_TENSORS = {
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_q_norm",
    "attn_k_norm",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
}


def drafter_tensor_names(num_layers: int) -> set[str]:
    names = {f"blk.{i}.{n}.weight" for i in range(num_layers) for n in LAYER_TENSORS}
    return names | {"fc.weight", "enc.output_norm.weight", "output_norm.weight"}


def test_gguf_export_reads_back(tmp_path: Path, target_dir: Path) -> None:
    root = gguf_or_skip(target_dir)
    drafter_path = make_drafter(tmp_path / "d")  # learned mask vector + draft vocabulary
    result = export.export_gguf(
        drafter_path, tmp_path / "out", target=str(target_dir), llama_cpp=root, target_gguf=True
    )
    assert result.path == tmp_path / "out" / export.DRAFTER_GGUF and result.path.is_file()
    drafter = load_drafter(drafter_path, dtype=torch.float32)
    c = drafter.config
    fields, tensors = read_gguf(result.path)
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.block_size"] == c.block_size == 8
    assert fields["dflash.target_layers"] == [i + 1 for i in c.target_layer_ids] == [2, 4]  # llama.cpp: +1
    assert fields["tokenizer.ggml.mask_token_id"] == c.mask_token_id == VOCAB - 1
    assert fields["dflash.attention.causal"] is False
    assert fields["dflash.block_count"] == c.num_hidden_layers
    assert set(tensors) == drafter_tensor_names(c.num_hidden_layers) | {"token_embd.weight", "output.weight", "d2t"}

    target = tiny_target("llama")
    embed = target.get_input_embeddings().weight.detach().to(torch.bfloat16).float()
    table = torch.from_numpy(export.gguf_rows(tensors["token_embd.weight"], list(range(VOCAB))))
    # the target's table, with the mask id's row replaced by the learned vector (llama.cpp's converter)
    assert torch.equal(table[c.mask_token_id], drafter.mask_embedding.detach().to(torch.bfloat16).float())
    assert torch.equal(table[: c.mask_token_id], embed[: c.mask_token_id])
    # the draft vocabulary, as llama.cpp's DFlash runtime reads it: absolute ids and those rows of the head
    assert tensors["d2t"].data.tolist() == DRAFT_VOCAB
    head = target.get_output_embeddings().weight.detach().to(torch.bfloat16).float()
    assert torch.equal(
        torch.from_numpy(export.gguf_rows(tensors["output.weight"], list(range(len(DRAFT_VOCAB))))), head[DRAFT_VOCAB]
    )
    fc = torch.from_numpy(export.gguf_rows(tensors["fc.weight"], list(range(c.hidden_size))))
    assert torch.equal(fc, drafter.fc.weight.detach().to(torch.bfloat16).float())

    tfields, ttensors = read_gguf(result.target_gguf)
    assert tfields["general.architecture"] == "llama" and tfields["llama.block_count"] == 6
    assert "-m " + str(result.target_gguf) in result.commands["llama.cpp"]
    assert (
        "--spec-type draft-dflash" in result.commands["llama.cpp"]
        and "--spec-draft-n-max 7" in result.commands["llama.cpp"]
    )


def test_gguf_export_of_a_plain_drafter_shares_the_target_tables(tmp_path: Path, target_dir: Path) -> None:
    root = gguf_or_skip(target_dir)
    drafter_path = make_drafter(tmp_path / "d", learned=False, draft_vocab=None)  # mask id 5, full vocabulary
    result = export.export_gguf(drafter_path, tmp_path / "out", target=str(target_dir), llama_cpp=root)
    fields, tensors = read_gguf(result.path)
    assert fields["tokenizer.ggml.mask_token_id"] == 5
    assert set(tensors) == drafter_tensor_names(2)  # embedding and head come from the target at run time
    assert result.target_gguf is None and "TARGET.gguf" in result.commands["llama.cpp"]
