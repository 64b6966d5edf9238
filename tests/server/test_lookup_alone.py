"""A server without a drafter: /health tells prompt lookup alone (the default where no drafter ships for the target)
from plain decoding (an explicit --drafter none), and its answers are the target's plain output either way."""

from __future__ import annotations

import httpx
import openai
import pytest

from dflashkit import SpeculativeGenerator
from dflashkit.server import create_app
from tests.conftest import tiny_target, word_tokenizer
from tests.live_server import LiveServer

MODEL = "tiny-llama"
PROMPT = "w5 w6 w7 w8 w9 w5 w6 w7 w8 w9 w5 w6 w7"  # repeats itself


def _generator(lookup_without_drafter: bool) -> SpeculativeGenerator:
    return SpeculativeGenerator(tiny_target("llama"), word_tokenizer(), lookup_without_drafter=lookup_without_drafter)


@pytest.mark.parametrize("alone", [True, False], ids=["lookup-alone", "plain"])
def test_health_tells_lookup_alone_from_plain_decoding(alone) -> None:
    offline = _generator(False)
    expected = offline.generate([{"role": "user", "content": PROMPT}], max_new_tokens=40)
    with LiveServer(create_app(_generator(alone), model_id=MODEL)) as live:
        health = httpx.get(live.url + "/health", timeout=30).json()
        assert health["speculative"] is False  # no drafter
        assert health["prompt_lookup"] is alone
        assert health["block_size"] == ("auto" if alone else 1)
        assert health["adaptive_block_size"] is alone
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=40, temperature=0.0
        )
    assert resp.choices[0].message.content == expected.text  # plain greedy output, copies or not
    spec = resp.usage.model_extra["speculative"]
    if alone:
        assert spec["adaptive_block_size"] is True and spec["block_size"] == 16
    else:
        assert spec["draft_tokens"] == 0 and spec["block_size"] == 1
