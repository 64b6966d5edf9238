"""Weight-only int8 targets: the layer's maths, one function at every batch size, losslessness with respect
to the quantized target, and the opt-in surfaces (errors, stats, CLI, server, bench)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.sampling import SamplingParams
from dflashkit.decoding.stats import DecodeStats
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import InvalidInputError
from dflashkit.kernels.int8 import INT8_WEIGHTS, Int8Linear, check_supported, quantize_weight
from dflashkit.kernels.quantize import check_method, quantize_model
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_drafter, tiny_target
from tests.decoding.test_loop import assert_bf16_parts_only_at_ties, assert_oracle_and_drafter_match_plain, prompts, run


def int8_target(arch: str = "llama", dtype: torch.dtype = torch.float32, **kw):
    return quantize_model(tiny_target(arch, dtype=dtype, **kw), "int8")


# ---- the layer ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_an_fp32_matmul_with_dequantized_weights(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=bias).to(dtype)
    q = Int8Linear.from_linear(linear)
    assert q.qweight.dtype == torch.int8 and q.scale.dtype == dtype and q.scale.shape == (40,)
    assert int(q.qweight.abs().max()) == 127  # each row's largest weight maps to ±127
    # quantization error: at most half a step per weight (plus the scale's own rounding in bf16)
    err = (q.dequantized() - linear.weight.float()).abs()
    step = q.scale.float()[:, None]
    assert (err <= step * (0.5 if dtype == torch.float32 else 0.52)).all()
    x = torch.randn(3, 5, 96).to(dtype)
    ref = x.double() @ q.dequantized(torch.float64).T + (linear.bias.double() if bias else 0)
    y = q(x)
    assert y.shape == (3, 5, 40) and y.dtype == dtype
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(y.double(), ref, **tol)


def test_zero_rows_and_per_channel_scales():
    w = torch.zeros(4, 8)
    w[1] = torch.linspace(-2, 2, 8)
    w[2, 3] = 1e-3
    q, scale = quantize_weight(w)
    assert scale[0] == 1 and (q[0] == 0).all()  # a zero row: no division by zero
    assert torch.isclose(scale[1], torch.tensor(2 / 127)) and torch.isclose(scale[2], torch.tensor(1e-3 / 127))
    assert q[1, 0] == -127 and q[1, -1] == 127 and q[2, 3] == 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_function_at_every_batch_size(dtype):
    """Rows of 1..16-row calls are bitwise the same rows of one 16-row call: no kernel switch by size."""
    torch.manual_seed(1)
    q = Int8Linear.from_linear(nn.Linear(576, 1536, bias=False).to(dtype))
    x = torch.randn(16, 576).to(dtype)
    full = q(x)
    for m in range(1, 17):
        assert torch.equal(q(x[:m]), full[:m]), m
        assert torch.equal(q(x[m - 1 : m]), full[m - 1 : m]), m


def test_rows_is_a_layer_of_those_output_channels():
    torch.manual_seed(2)
    q = Int8Linear.from_linear(nn.Linear(32, 50))
    ids = torch.tensor([0, 7, 49, 3])
    x = torch.randn(4, 32)
    torch.testing.assert_close(q.rows(ids)(x), q(x)[:, ids])


# ---- the model ------------------------------------------------------------------------------------------


def test_quantize_model_replaces_the_decoder_linears_and_unties_the_head(arch):
    model = tiny_target(arch)
    embed_before = model.get_input_embeddings().weight.clone()
    n_linear = sum(type(m) is nn.Linear for m in model.get_decoder().modules())
    assert n_linear == 6 * 7  # q, k, v, o, gate, up, down in each of 6 layers
    quantize_model(model, "int8")
    assert sum(isinstance(m, Int8Linear) for m in model.get_decoder().modules()) == n_linear
    assert not any(type(m) is nn.Linear for m in model.modules())
    head = model.get_output_embeddings()
    assert isinstance(head, Int8Linear) and head.out_features == VOCAB
    assert torch.equal(model.get_input_embeddings().weight, embed_before)  # the embedding stays as it was
    assert model.config.tie_word_embeddings is False
    assert TargetAdapter(model).weights == INT8_WEIGHTS + ", LM head included"
    assert TargetAdapter(tiny_target(arch)).weights == "float32"
    with pytest.raises(InvalidInputError, match="already quantized"):
        quantize_model(model, "int8")
    kept = quantize_model(tiny_target(arch), "int8", lm_head=False)
    assert type(kept.get_output_embeddings()) is nn.Linear and kept.dflashkit_quantization == INT8_WEIGHTS


@pytest.mark.parametrize(("method", "tolerance"), [("int8", 0.05), ("int4", 0.25)])
def test_quantized_target_is_close_to_but_not_the_float_target(method, tolerance):
    model, qmodel = tiny_target("llama"), quantize_model(tiny_target("llama"), method)
    ids = torch.tensor([prompts(1, seed=4)[0] * 3])
    with torch.inference_mode():
        a, b = model(ids).logits, qmodel(ids).logits
    assert not torch.equal(a, b)
    assert (a - b).abs().max() < tolerance * a.abs().max()


# ---- losslessness with respect to the quantized target -----------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_speculative_equals_plain_on_the_int8_target(arch, block_size):
    """fp32 activations: token for token, with a random drafter and an oracle that exercises every
    accepted length (full blocks, mid-block rejections and cache crops)."""
    model = int8_target(arch)
    drafter = tiny_drafter(model, block_size=block_size)
    oracle_stats = assert_oracle_and_drafter_match_plain(model, drafter, block_size, prompts(12, seed=21))
    assert sum(oracle_stats.accepted_lengths) > 0 and oracle_stats.acceptance_histogram[-1] > 0


def test_greedy_speculative_equals_plain_on_the_int8_target_qwen2_biases():
    model = int8_target("qwen2")
    assert model.get_decoder().layers[0].self_attn.q_proj.bias is not None
    drafter = tiny_drafter(model, block_size=8)
    target, plain = TargetAdapter(model, drafter.config.target_layer_ids), TargetAdapter(model)
    for prompt in prompts(8, seed=12):
        assert run(target, drafter, prompt) == run(plain, None, prompt)


def test_draft_vocabulary_reads_the_int8_head(arch):
    model = int8_target(arch)
    vocab = list(range(0, VOCAB, 3))
    base = tiny_drafter(model, block_size=4)
    drafter = DFlashDrafter(base.config.replace(draft_vocab=vocab))
    drafter.load_state_dict(base.state_dict())
    head = model.get_output_embeddings()
    with torch.inference_mode():
        hidden = torch.randn(5, model.config.hidden_size)
        logits = drafter.logits(hidden, head)
        torch.testing.assert_close(logits[:, vocab], head(hidden)[:, vocab])
    assert torch.isinf(logits[:, [i for i in range(VOCAB) if i not in vocab]]).all()
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    for prompt in prompts(4, seed=5):
        assert run(target, drafter, prompt) == run(TargetAdapter(model), None, prompt)


def test_bf16_int8_target_parts_from_plain_decoding_only_at_ties(arch):
    model = int8_target(arch, dtype=torch.bfloat16)
    assert_bf16_parts_only_at_ties(model, tiny_drafter(model, block_size=8), prompts(6, seed=3))


def test_seeded_sampling_is_reproducible_on_the_int8_target():
    model = int8_target("llama")
    drafter = tiny_drafter(model, block_size=4)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    params = SamplingParams(1.0, top_p=0.95)

    def sample(seed: int, proposal: str) -> tuple[list[int], list[int]]:
        stats = DecodeStats(1)
        options = DecodeOptions(max_new_tokens=16, sampling=params, seed=seed, proposal=proposal)
        tokens = [t for s in decode(target, drafter, [5, 6, 7], options, stats) for t in s.tokens]
        return tokens, stats.accepted_lengths

    runs = {seed: sample(seed, "sample") for seed in range(6)}
    for seed, result in runs.items():
        assert len(result[0]) == 16 and sample(seed, "sample") == result
    assert len({tuple(t) for t, _ in runs.values()}) > 1  # the seed matters
    assert sum(sum(a) for _, a in runs.values()) > 0  # drafts were accepted: the speculative path ran


def test_stats_declare_the_quantized_target():
    model = int8_target("llama")
    stats = DecodeStats(1)
    list(decode(TargetAdapter(model), None, [5, 6], DecodeOptions(max_new_tokens=3), stats))
    assert stats.target_weights.startswith("int8 weight-only (per-channel)")
    assert stats.as_dict()["target_weights"] == stats.target_weights
    plain = DecodeStats(1)
    list(decode(TargetAdapter(tiny_target("llama")), None, [5, 6], DecodeOptions(max_new_tokens=3), plain))
    assert plain.as_dict()["target_weights"] == "float32"


# ---- opt-in surfaces ------------------------------------------------------------------------------------


def test_unknown_methods_and_unsupported_devices_are_refused():
    assert check_method(None) is None and check_method("none") is None and check_method("int8") == "int8"
    for bad in ("int2", "INT8", "fp8"):
        with pytest.raises(InvalidInputError, match="unknown quantization"):
            check_method(bad)
    with pytest.raises(InvalidInputError, match="does not run on meta"):
        check_supported("meta", torch.bfloat16)
    with pytest.raises(InvalidInputError, match="float64"):
        quantize_model(tiny_target("llama", dtype=torch.float64), "int8")
    with pytest.raises(InvalidInputError, match="unknown quantization"):  # before any loading
        importlib.import_module("dflashkit.target.loading").load_target("/nonexistent/target", quantize="int3")


def test_generator_load_passes_quantize(monkeypatch):
    import dflashkit.target.loading
    from dflashkit.generator import SpeculativeGenerator
    from tests.cli.helpers import make_tokenizer

    seen = {}

    def fake_load_target(name=None, *, dtype=torch.bfloat16, device="cpu", progress=False, quantize=None):
        seen["quantize"] = quantize
        return quantize_model(tiny_target("llama", dtype=dtype), quantize), make_tokenizer()

    monkeypatch.setattr(dflashkit.target.loading, "load_target", fake_load_target)
    gen = SpeculativeGenerator.load(drafter=None, dtype="float32", quantize="int8")
    assert seen["quantize"] == "int8" and gen.target.weights.startswith("int8")
    result = gen.generate("tell me a story", max_new_tokens=5)
    assert result.stats.target_weights.startswith("int8")


def test_cli_generate_quantize_int8_declares_it(capsys, monkeypatch):
    import dflashkit
    import dflashkit.drafter.registry
    import dflashkit.target.loading
    from dflashkit.cli.main import main
    from tests.cli.helpers import PROMPT, fake_model, make_tokenizer

    def fake_load_target(name=None, *, dtype=torch.bfloat16, device="cpu", progress=False, quantize=None):
        return quantize_model(fake_model(dtype), quantize), make_tokenizer()

    monkeypatch.setattr(dflashkit.target.loading, "load_target", fake_load_target)
    monkeypatch.setattr(dflashkit.drafter.registry, "DRAFTERS_DIR", Path("/nonexistent"))  # no shipped drafter for it
    rc = main(
        [
            "generate",
            PROMPT,
            "--max-new-tokens",
            "8",
            "--dtype",
            "float32",
            "--quantize",
            "int8",
            "--drafter",
            "untrained",
            "--block-size",
            "4",
            "--compare-ar",
            "--json",
            "--threads",
            "1",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["target_weights"].startswith("int8 weight-only") and out["identical"] is True
    assert out["stats"]["target_weights"] == out["target_weights"]
    rc = main(["generate", PROMPT, "--max-new-tokens", "4", "--dtype", "float32", "--quantize", "int8"])
    err = capsys.readouterr().err
    assert rc == 0 and "exact w.r.t. the quantized target" in err
    with pytest.raises(SystemExit) as e:
        main(["generate", PROMPT, "--quantize", "int3"])
    assert e.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err
    for command in (["serve"], ["bench"]):
        with pytest.raises(SystemExit):
            main([*command, "--quantize", "int3"])
        assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_server_health_declares_the_quantized_target():
    from fastapi.testclient import TestClient

    from dflashkit.generator import SpeculativeGenerator
    from dflashkit.server import create_app
    from tests.cli.helpers import make_tokenizer

    model = int8_target("llama")
    gen = SpeculativeGenerator(model, make_tokenizer(), tiny_drafter(model, block_size=4))
    with TestClient(create_app(gen, model_id="tiny"), base_url="http://localhost") as client:  # an allowed Host
        health = client.get("/health").json()
    assert health["target_weights"].startswith("int8 weight-only (per-channel)")


def test_bench_quantize_int8_runs_every_method_on_the_int8_target(capsys, monkeypatch, tmp_path):
    import sys

    import dflashkit.target.loading
    from dflashkit.cli.main import main
    from tests.bench.test_command import CHAT_TEMPLATE
    from tests.conftest import word_tokenizer

    seen = []

    def fake_load_target(name=None, *, dtype=torch.bfloat16, device="cpu", progress=False, quantize=None):
        seen.append(quantize)
        tok = word_tokenizer()
        tok.chat_template = CHAT_TEMPLATE
        return quantize_model(tiny_target("llama", dtype=dtype).requires_grad_(False), quantize), tok

    monkeypatch.setattr(dflashkit.target.loading, "load_target", fake_load_target)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    questions = tmp_path / "qs.jsonl"
    questions.write_text(json.dumps({"question_id": 0, "turns": ["w9 w10 w11"]}))
    rc = main(
        [
            "bench",
            "--datasets",
            str(questions),
            "--limit",
            "1",
            "--max-new-tokens",
            "6",
            "--temperatures",
            "0",
            "--methods",
            "ar,dflash,hf",
            "--drafter",
            "untrained",
            "--block-sizes",
            "4",
            "--quantize",
            "int8",
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
            "--threads",
            "1",
            "--dtype",
            "float32",
        ]
    )
    _, stderr = capsys.readouterr()
    assert rc == 0, stderr
    assert seen == ["int8"]  # one target, shared by every method
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["settings"]["quantize"] == "int8" and data["settings"]["target_weights"].startswith("int8")
    assert {m["name"]: m["status"] for m in data["methods"]}["dflash-b4"] == "ran"
    assert "every method runs on this quantized target" in (tmp_path / "out" / "summary.md").read_text()
