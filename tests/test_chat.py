"""ChatSession: the conversation's messages turn by turn, its cache reused, failures and interruptions handled."""

from __future__ import annotations

import pytest
from conftest import tiny_drafter, tiny_target
from test_cli import make_tokenizer

from dflashkit import PrefixCache, SpeculativeGenerator
from dflashkit.chat import ChatSession
from dflashkit.errors import InvalidInputError


def generator() -> SpeculativeGenerator:
    model = tiny_target("llama")
    return SpeculativeGenerator(model, make_tokenizer(), tiny_drafter(model, block_size=4))


def test_turns_extend_the_conversation_and_reuse_the_cache():
    gen = generator()
    session = ChatSession(gen, system="a story", max_new_tokens=8, block_size=4)
    first = "".join(session.send("tell me about the sea"))
    assert session.last.text == first and session.last.stats.cached_prompt_tokens == 0
    second = "".join(session.send("the sky"))
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert session.messages[2]["content"] == first and session.messages[4]["content"] == second
    assert session.last.stats.cached_prompt_tokens > 0
    assert second == gen.generate(session.messages[:4], max_new_tokens=8).text  # as an uncached run of it all
    session.reset()
    assert session.messages == [{"role": "system", "content": "a story"}] and len(session.cache) > 0
    assert ChatSession(gen, prefix_cache=False).cache is None
    shared = PrefixCache(1 << 20)
    assert ChatSession(gen, prefix_cache=shared).cache is shared  # an empty cache is still that cache


def test_a_failed_turn_leaves_the_conversation_and_a_stopped_one_keeps_its_text():
    gen = generator()
    session = ChatSession(gen, max_new_tokens=8, block_size=4)
    "".join(session.send("hello"))
    before = list(session.messages)
    with pytest.raises(InvalidInputError, match="context"):
        "".join(session.send(" ".join(["sea"] * 600)))  # past the tiny target's 512 positions
    assert session.messages == before
    with pytest.raises(InvalidInputError):
        "".join(session.send("  "))
    turn = session.send("tell me a story")
    piece = next(turn)
    turn.close()  # the reader stopped (Ctrl-C in the CLI): the text so far is the answer
    assert session.messages[-1] == {"role": "assistant", "content": piece} and session.last is None
    "".join(session.send("the sky"))  # and the conversation goes on
    assert session.last is not None and session.last.stats.cached_prompt_tokens > 0
    with pytest.raises(InvalidInputError):
        ChatSession(gen, chat=False)
