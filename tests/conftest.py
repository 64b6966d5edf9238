"""Tiny random-initialised targets and drafters, built in code (no downloads, fast on 2 cores)."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.network import DFlashDrafter

VOCAB = 96

# Tiny models run fastest on one thread; with two, a busy 2-core machine oversubscribes and stalls
# (seen: a tiny forward 4 ms -> 650 ms). This holds for the whole session; no test needs to repeat it.
torch.set_num_threads(1)


def _absl_logging_on_the_real_stderr() -> None:
    """absl (imported by mathematics-dataset, the `math` prompt source) builds its log handler on whatever
    sys.stderr is when it is first imported: inside a test, pytest's capture buffer. uvicorn's logging setup
    (`dflashkit serve` in test_cli) closes every logging handler, and absl's closes its stream when that is not the
    current sys.stderr, so pytest's capture failed for the rest of the process whenever test_data's math test ran
    before test_cli's serve test in one worker. Imported here once, on the real stderr, which absl never closes."""
    import sys

    saved, sys.stderr = sys.stderr, sys.__stderr__
    try:
        import absl.logging  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.stderr = saved


_absl_logging_on_the_real_stderr()


def word_tokenizer():
    """A WordLevel tokenizer whose VOCAB ids match the tiny models: <pad> 0, <s> 1, <eos> 2, <unk> 3, w4...."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "<eos>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )


BYTE_VOCAB = 4 + 256  # <pad> <s> <eos> <unk>, then one token per byte


def byte_tokenizer():
    """A byte-level tokenizer of BYTE_VOCAB tokens (no merges: one token per byte), for a tiny target built
    with vocab_size=BYTE_VOCAB: it can spell any text, which grammars (JSON) need, and llguidance reads it."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "<eos>": 2, "<unk>": 3, **{ch: 4 + i for i, ch in enumerate(alphabet)}}
    backend = Tokenizer(tok_models.BPE(vocab, [], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )


def merging_tokenizer():
    """Byte-level BPE with one merge, "\\n\\n" -> one token, which its pre-tokenizer never produces before a digit
    (GPT-2's rule splits "\\n\\n1" as "\\n", "\\n", "1"): a model may write a token its tokenizer would not."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "<eos>": 2, "<unk>": 3, **{ch: 4 + i for i, ch in enumerate(alphabet)}}
    vocab["ĊĊ"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [("Ċ", "Ċ")], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tok


def tiny_target(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random 6-layer causal LM of the given architecture ("llama", "qwen2" or "qwen3")."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)  # q/k/v projections with bias
    else:
        config = Qwen3Config(head_dim=16, **common)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    # Sharpen the logits so that generations are not dominated by one token.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model


def tiny_drafter(model, block_size: int = 8, seed: int = 1, num_layers: int = 2, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(model.config, num_layers=num_layers, block_size=block_size, **kw)
    drafter = DFlashDrafter(cfg).to(model.dtype).eval()
    if drafter.mask_embedding is not None:
        with torch.no_grad():
            drafter.mask_embedding.normal_(0, 0.02)
    return drafter


@pytest.fixture
def proposal_temperatures(monkeypatch: pytest.MonkeyPatch) -> list:
    """Records options.proposal_temperature of every sampled decode call with a drafter (proposal_params' calls)."""
    decode_module = importlib.import_module("dflashkit.decoding.loop")  # the package's `decode` is the function
    seen: list = []
    original = decode_module.proposal_params

    def recording(params, drafter, options):
        seen.append(options.proposal_temperature)
        return original(params, drafter, options)

    monkeypatch.setattr(decode_module, "proposal_params", recording)
    return seen


@pytest.fixture(params=["llama", "qwen3"])
def arch(request) -> str:
    return request.param


class ReplayCapture:
    """Stand-in for CUDA graph capture on a CPU: counts captures; a replay runs the step again."""

    def __init__(self) -> None:
        self.captured = 0

    def __call__(self, step, pool):
        self.captured += 1
        return step


def frozen(step, pool):
    """A recording that ignores its inputs (what a graph does when the step read a tensor's value in Python): every
    replay gives the capture step's outputs again, whatever the inputs are now."""
    step()  # recorded at the capture's inputs
    return lambda: None


def record_decode_options(monkeypatch, module, *fields: str) -> list[tuple]:
    """Make ``module``'s ``decode`` record the named DecodeOptions fields of every call (then decode as usual);
    returns the list the records go to."""
    seen: list[tuple] = []
    real_decode = module.decode

    def spy(target, drafter, ids, options, *args):
        seen.append(tuple(getattr(options, f) for f in fields))
        return real_decode(target, drafter, ids, options, *args)

    monkeypatch.setattr(module, "decode", spy)
    return seen
