"""Request bodies: a chat conversation's tool messages must answer the calls of the assistant message before them
(as OpenAI requires); one that answers nothing, or a call that was never made, is a 400 naming the message."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from dflashkit.server import create_app
from dflashkit.server.errors import APIError
from dflashkit.server.schemas import ChatCompletionRequest
from tests.live_server import LiveServer, tiny_generator

MODEL = "tiny-llama"


def call(call_id: str | None, name: str = "f") -> dict[str, Any]:
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": "{}"}}
    return out if call_id is None else {"id": call_id, **out}


def asked(*ids: str | None) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [call(i) for i in ids]}


def answer(call_id: str | None = "c1", content: str = "w5") -> dict[str, Any]:
    out = {"role": "tool", "content": content}
    return out if call_id is None else {**out, "tool_call_id": call_id}


USER = {"role": "user", "content": "w5 w6"}

GOOD = [
    [USER, asked("c1"), answer("c1")],
    [USER, asked("c1", "c2"), answer("c2"), answer("c1"), {"role": "assistant", "content": "w7"}, USER],
    [USER, asked("c1"), answer("c1"), asked("c2"), answer("c2")],
    [USER, asked(None), answer("anything")],  # calls without ids: nothing to match against
    [USER, asked("c1"), answer(None)],  # no tool_call_id: taken as before
]

BAD = [
    ([USER, answer("c1")], "messages[1]: a tool message must answer a tool call"),
    ([answer("c1")], "messages[0]: a tool message must answer a tool call"),
    ([USER, {"role": "assistant", "content": "w5"}, answer("c1")], "messages[2]: a tool message must answer"),
    ([USER, asked("c1"), USER, answer("c1")], "messages[3]: a tool message must answer"),  # a user turn between
    ([USER, asked("c1"), answer("c2")], "messages[2].tool_call_id 'c2' matches no call"),
    ([USER, asked("c1"), answer("c1"), asked("c2"), answer("c1")], "messages[4].tool_call_id 'c1' matches no call"),
]


def request(messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages})


@pytest.mark.parametrize("messages", GOOD)
def test_tool_messages_that_answer_calls_are_taken(messages) -> None:
    request(messages).check_supported()


@pytest.mark.parametrize(("messages", "message"), BAD)
def test_tool_messages_that_answer_no_call_are_refused(messages, message) -> None:
    with pytest.raises(APIError) as e:
        request(messages).check_supported()
    assert e.value.status == 400 and e.value.param == "messages" and e.value.message.startswith(message)


@pytest.fixture(scope="module")
def live():
    with LiveServer(create_app(tiny_generator(), model_id=MODEL)) as server:
        yield server


def test_the_chat_endpoint_answers_them_with_openai_errors(live) -> None:
    for messages, message in BAD[:1] + BAD[4:5]:
        r = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and error["type"] == "invalid_request_error"
        assert error["message"].startswith(message)
    ok = {"model": MODEL, "messages": GOOD[0], "max_tokens": 2}
    assert httpx.post(live.url + "/v1/chat/completions", json=ok, timeout=30).status_code == 200


def test_the_responses_endpoint_refuses_an_output_without_its_call(live) -> None:
    """A function_call_output item whose call is not in the conversation: a 400 naming input."""
    items = [{"role": "user", "content": "w5"}, {"type": "function_call_output", "call_id": "c1", "output": "w6"}]
    r = httpx.post(live.url + "/v1/responses", json={"model": MODEL, "input": items}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "a tool message must answer a tool call" in r.json()["error"]["message"]
