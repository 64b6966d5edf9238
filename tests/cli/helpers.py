"""Shared by the command-line tests (and others that run the CLI or a tokenizer offline): a WordLevel tokenizer
with a minimal chat template over the tiny random target's vocabulary, and that target."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers import models as tok_models
from transformers import PreTrainedTokenizerFast

from tests.conftest import VOCAB, tiny_target

SPECIALS = ["<pad>", "<s>", "<eos>", "<unk>"]
WORDS = ["user", "assistant", "hello", "world", "the", "a", "story", "tell", "me", "about", "sea", "sky"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
PROMPT = "tell me a story about the sea"


def make_tokenizer() -> PreTrainedTokenizerFast:
    """96 entries, ids 0..95 as the tiny model's vocabulary; eos '<eos>' = 2; a minimal chat template."""
    tokens = SPECIALS + WORDS + [f"w{i}" for i in range(VOCAB - len(SPECIALS) - len(WORDS))]
    backend = Tokenizer(tok_models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )
    tok.chat_template = CHAT_TEMPLATE
    assert len(tok) == VOCAB and tok.eos_token_id == 2
    return tok


def fake_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """The tiny random llama target, in eval mode, without gradients."""
    model = tiny_target("llama", seed=seed, dtype=dtype)
    return model.eval().requires_grad_(False)


def refused(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """Run the CLI with arguments its parser must refuse: exit status 2, nothing on stdout, one error line that
    names the flag, no traceback. Returns that line."""
    from dflashkit.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "" and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"dflashkit {argv[0]}: error: argument "), last
    return last
