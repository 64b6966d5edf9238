"""ChatSession: the conversation's messages turn by turn, its cache reused, failures and interruptions handled."""

from __future__ import annotations

import pytest

from dflashkit import PrefixCache, SpeculativeGenerator
from dflashkit.chat import ChatSession
from dflashkit.errors import InvalidInputError
from tests.cli.helpers import make_tokenizer
from tests.conftest import merging_tokenizer, tiny_drafter, tiny_target


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


def test_next_prompt_keeps_the_tokens_the_model_wrote():
    """The answer's own tokens stay in the next prompt (re-encoding its text would split "\\n\\n" and end the
    prefix cache's reuse there); the template's text around them is as it renders; a template that rewrites an
    earlier turn falls back to the encoded text."""
    from dflashkit.chat import continued_prompt
    from dflashkit.decoding.prefix_cache import common_prefix
    from dflashkit.text import render_chat

    tok = merging_tokenizer()

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    pair = tok.convert_tokens_to_ids("ĊĊ")
    assert pair not in enc("a:\n\n1.")  # the tokenizer never writes it there
    messages = [{"role": "user", "content": "hi"}]
    text1 = render_chat(tok, messages)
    ids1 = enc(text1)
    answer = enc("a:") + [pair] + enc("1.")  # what a model may write
    messages += [{"role": "assistant", "content": tok.decode(answer)}, {"role": "user", "content": "more"}]
    text2 = render_chat(tok, messages)
    ids2 = continued_prompt(tok, text2, (text1, ids1, answer))
    assert ids2[: len(ids1) + len(answer)] == ids1 + answer and tok.decode(ids2) == text2
    assert common_prefix(enc(text2), ids1 + answer) == len(ids1) + 2  # re-encoded: reuse would end at the pair
    assert continued_prompt(tok, text2.replace("a:", "b:"), (text1, ids1, answer)) is None
