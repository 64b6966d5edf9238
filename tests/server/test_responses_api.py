"""/v1/responses (OpenAI's Responses API), live on localhost, driven by the official `openai` client: answers
equal offline chat generation of the conversation the request means, streamed events accumulate (in the client's
own stream helper) to the same response, previous_response_id continues a stored conversation (restoring its
prefix), function calls go out as items and come back as function_call_output, structured output parses, bad
input gets 4xx errors that name the Responses API's fields."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from dflashkit import SpeculativeGenerator
from dflashkit.chat import continued_prompt
from dflashkit.decoding.prefix_cache import common_prefix
from dflashkit.server import create_app
from dflashkit.server.responses_api import input_messages
from dflashkit.text import render_chat
from dflashkit.tool_calls import ToolRequest, parse_tool_calls
from tests.conftest import merging_tokenizer, tiny_drafter, tiny_target
from tests.live_server import (
    TEXT_THEN_CALL,
    LiveServer,
    metric,
    offline_chat,
    scripted,
    tiny_byte_generator,
    tiny_generator,
    tool_generator,
    wait_until,
)

MODEL = "tiny-llama"
SAMPLED = {"temperature": 1.0, "extra_body": {"seed": 3}}


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    return tiny_generator()


@pytest.fixture(scope="module")
def live():
    # a fixed block, no prompt lookup: stats and logprobs are compared with offline runs and the chat endpoints
    with LiveServer(
        create_app(tiny_generator(), model_id=MODEL, proposal="sample", block_size=4, lookup=False)
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return _client(live)


def test_text_answer_equals_offline_chat_and_streams_the_same(client, offline) -> None:
    """instructions + input text = a system and a user turn; the answer, its usage and its status (incomplete at
    max_output_tokens) are those of offline generation; the stream's deltas and its final response agree."""
    messages = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w5 w6 w7"}]
    for options in ({"temperature": 0.0}, SAMPLED):
        seed = options.get("extra_body", {}).get("seed")
        expected = offline_chat(offline, messages, 12, options["temperature"], seed, block_size=4, lookup=False)
        resp = client.responses.create(
            model=MODEL, instructions="w9 w10", input="w5 w6 w7", max_output_tokens=12, **options
        )
        assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
        assert resp.output_text == expected.text and expected.text
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
        (message,) = resp.output
        assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
        assert resp.usage.input_tokens == expected.prompt_tokens and resp.usage.output_tokens == 12
        assert resp.usage.total_tokens == expected.prompt_tokens + 12
        spec = resp.usage.model_extra["speculative"]
        assert spec["drafting_steps"] == expected.stats.steps > 0
        assert spec["accepted_per_position"] == expected.stats.accepted_per_position
        # streamed: the raw events in order, numbered, the deltas joining to the text
        events = list(
            client.responses.create(
                model=MODEL, instructions="w9 w10", input="w5 w6 w7", max_output_tokens=12, stream=True, **options
            )
        )
        assert [e.sequence_number for e in events] == list(range(len(events)))
        types = [e.type for e in events]
        assert types[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert types[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
        assert set(types[4:-4]) == {"response.output_text.delta"}
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.text
        final = events[-1].response
        assert final.output_text == expected.text and final.status == "incomplete"
        assert final.usage.output_tokens == 12 and events[0].response.status == "in_progress"
        assert spec["sampler"] == ("coupled" if seed is not None else None)
    resp = client.responses.create(
        model=MODEL, input="w5", max_output_tokens=4, temperature=1.0, extra_body={"seed": 3, "sampler": "rejection"}
    )
    assert resp.usage.model_extra["speculative"]["sampler"] == "rejection"  # the sampler extension
    # an answer that ends: the client's stream helper accumulates the events to the final response
    words = expected.text.split(" ")
    stop = " " + words[3]
    cut = offline_chat(offline, messages, 12, 1.0, 3, stop=[stop])
    with client.responses.stream(
        model=MODEL,
        instructions="w9 w10",
        input="w5 w6 w7",
        max_output_tokens=12,
        temperature=1.0,
        extra_body={"seed": 3, "stop": stop},
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.incomplete_details is None
    assert final.output_text == "".join(deltas) == cut.text and stop not in cut.text


def test_previous_response_id_continues_the_stored_conversation(client, offline) -> None:
    """The next request sees the stored turns (not the earlier instructions), restores their prefix from the
    cache, and its answer equals offline generation of the whole conversation; store false keeps nothing;
    GET and DELETE /v1/responses/{id}."""
    first = client.responses.create(model=MODEL, input="w5 w6 w7 w8", max_output_tokens=8, temperature=0)
    second = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "w7 w8"}],
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    conversation = [
        {"role": "user", "content": "w5 w6 w7 w8"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "w7 w8"},
    ]
    expected = offline_chat(offline, conversation, 6)
    assert second.output_text == expected.text and second.previous_response_id == first.id
    assert second.usage.input_tokens == expected.prompt_tokens
    assert 0 < second.usage.input_tokens_details.cached_tokens < expected.prompt_tokens
    # new instructions go first; the stored turns carry none
    third = client.responses.create(
        model=MODEL, instructions="w11", input="w9", previous_response_id=second.id, max_output_tokens=4, temperature=0
    )
    assert (
        third.output_text
        == offline_chat(
            offline,
            [
                {"role": "system", "content": "w11"},
                *conversation,
                {"role": "assistant", "content": second.output_text},
                {"role": "user", "content": "w9"},
            ],
            4,
        ).text
    )
    fourth = client.responses.create(
        model=MODEL, input="w9", previous_response_id=third.id, max_output_tokens=4, temperature=0
    )
    assert fourth.usage.input_tokens == third.usage.input_tokens - 1 + 4 + 1  # without "w11", with third's turn
    assert client.responses.retrieve(first.id).output_text == first.output_text
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model=MODEL, input="w5", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="w6", previous_response_id=unstored.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "response_not_found"


def test_logprobs_equal_the_chat_endpoints(client) -> None:
    """include message.output_text.logprobs with top_logprobs: each token's entry, as chat gives it."""
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "w5 w6 w7"}],
        seed=3,
        temperature=1.0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
    )
    expected = [
        (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in chat.choices[0].logprobs.content
    ]
    resp = client.responses.create(
        model=MODEL,
        input="w5 w6 w7",
        max_output_tokens=8,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
        **SAMPLED,
    )
    part = resp.output[0].content[0]
    assert [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in part.logprobs] == expected
    events = list(
        client.responses.create(
            model=MODEL,
            input="w5 w6 w7",
            max_output_tokens=8,
            top_logprobs=2,
            include=["message.output_text.logprobs"],
            stream=True,
            **SAMPLED,
        )
    )
    streamed = [(e.token, e.logprob) for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert streamed == [x[:2] for x in expected]
    plain = client.responses.create(model=MODEL, input="w5 w6 w7", max_output_tokens=8, **SAMPLED)
    assert plain.output[0].content[0].logprobs is None


PICK_TOOL = {
    "type": "function",
    "name": "pick_color",
    "description": "Pick a color",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
}


def test_function_calls_go_out_as_items_and_come_back_as_outputs() -> None:
    """A forced call is a function_call item (equal to offline generation under the tool grammar), streamed the
    same through the client's helper; its output sent back (after previous_response_id, or with the call item in
    the input) is the prompt offline chat would build; a text answer with tools is a message."""
    offline = tool_generator()
    chat_tool = {"type": "function", "function": {k: v for k, v in PICK_TOOL.items() if k != "type"}}
    with LiveServer(create_app(tool_generator(), model_id=MODEL)) as live:
        client = _client(live)
        request = ToolRequest.parse([chat_tool], "required", parallel_tool_calls=False)
        messages = [{"role": "user", "content": "Pick a color."}]
        expected = offline.generate(
            offline.encode_prompt(messages, tools=request.template_tools()),
            grammar=offline.tool_call_grammar(request),
            max_new_tokens=300,
        )
        _, (expected_call,) = parse_tool_calls(expected.text, request.names)
        resp = client.responses.create(
            model=MODEL,
            input="Pick a color.",
            tools=[PICK_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_output_tokens=300,
        )
        (call,) = resp.output
        assert resp.status == "completed" and call.type == "function_call" and call.status == "completed"
        assert (call.name, call.arguments) == (expected_call.name, expected_call.arguments)
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        with client.responses.stream(
            model=MODEL,
            input="Pick a color.",
            tools=[PICK_TOOL],
            temperature=0,
            tool_choice={"type": "function", "name": "pick_color"},
            max_output_tokens=300,
        ) as stream:
            arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
            final = stream.get_final_response()
        (streamed,) = final.output
        assert (streamed.name, streamed.arguments) == (call.name, arguments) == (call.name, call.arguments)
        assert json.loads(arguments)["color"] in ("red", "green")
        sent = [
            *messages,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": streamed.call_id,
                        "type": "function",
                        "function": {"name": "pick_color", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": streamed.call_id, "content": "done"},
        ]
        prompt = offline.encode_prompt(sent, tools=[chat_tool])
        reply = offline.generate(prompt, max_new_tokens=8)
        answer = {"type": "function_call_output", "call_id": streamed.call_id, "output": "done"}
        after = client.responses.create(
            model=MODEL,
            input=[answer],
            previous_response_id=final.id,
            tools=[PICK_TOOL],
            temperature=0,
            max_output_tokens=8,
        )
        assert after.usage.input_tokens == len(prompt) and after.output_text == reply.text
        assert [item.type for item in after.output] == ["message"]
        stateless = client.responses.create(
            model=MODEL,
            tools=[PICK_TOOL],
            temperature=0,
            max_output_tokens=8,
            input=[
                {"role": "user", "content": "Pick a color."},
                {"type": "function_call", "call_id": streamed.call_id, "name": "pick_color", "arguments": arguments},
                answer,
            ],
        )
        assert stateless.usage.input_tokens == len(prompt) and stateless.output_text == reply.text


class Pick(BaseModel):
    color: str
    ok: bool


def test_structured_output_parses() -> None:
    """text.format json_schema (the client's responses.parse with a pydantic model): valid JSON of that shape,
    equal to the chat endpoint's response_format answer."""
    with LiveServer(create_app(tiny_byte_generator(), model_id=MODEL)) as live:
        client = _client(live)
        parsed = client.responses.parse(
            model=MODEL, input="Pick a color.", text_format=Pick, temperature=0, max_output_tokens=300
        )
        assert parsed.status == "completed" and isinstance(parsed.output_parsed, Pick)
        schema = openai.lib._pydantic.to_strict_json_schema(Pick)
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Pick a color."}],
            temperature=0,
            max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": "Pick", "schema": schema, "strict": True}},
        )
        assert parsed.output_text == chat.choices[0].message.content
        obj = client.responses.create(
            model=MODEL,
            input="Pick a color.",
            text={"format": {"type": "json_object"}},
            temperature=0,
            max_output_tokens=300,
        )
        assert isinstance(json.loads(obj.output_text), dict)


CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}


def test_input_items_become_chat_messages() -> None:
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    assert input_messages(
        [
            {
                "role": "developer",
                "content": [{"type": "input_text", "text": "be "}, {"type": "input_text", "text": "kind"}],
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
            CALL,
            {**CALL, "call_id": "call_2"},
            {"type": "function_call_output", "call_id": "call_1", "output": "1"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "2"}]},
            CALL,
        ]
    ) == [
        {"role": "system", "content": "be kind"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
        {"role": "tool", "tool_call_id": "call_2", "content": "2"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]


BAD = [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, 400, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input"),
    ({"input": 7}, 400, "input"),
    ({"input": "w5", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "w5", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "w5", "text": {"format": {"type": "yaml"}}}, 400, "text"),
    ({"input": "w5", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text"),
    ({"input": "w5", "max_output_tokens": 100_000}, 400, "max_output_tokens"),
    ({"input": "w5", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "w5", "top_logprobs": 99}, 400, "top_logprobs"),
    ({"input": "w5", "temperature": 3}, 400, "temperature"),
    ({"input": "w5", "background": True}, 400, "background"),
    ({"input": "w5", "truncation": "sometimes"}, 400, "truncation"),
    ({"input": " ".join(["w5"] * 600), "truncation": "auto"}, 400, "input"),  # the last turn alone is too long
    ({"input": "w5", "conversation": "conv_1"}, 400, "conversation"),
    ({"input": "w5", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "w5", "model": "other"}, 404, "model"),
    ({}, 400, "input"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_requests_name_the_field(live, body, status, param) -> None:
    r = httpx.post(live.url + "/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], r.text
    if param == "max_output_tokens" and status == 400 and body["max_output_tokens"] > 1:
        assert "max_output_tokens" in error["message"] and "max_tokens" not in error["message"]


def test_unknown_response_ids_are_404(live) -> None:
    for method in ("GET", "DELETE"):
        r = httpx.request(method, live.url + "/v1/responses/resp_missing", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_timeout_fails_the_response_and_a_disconnect_cancels_it() -> None:
    """Past the server's timeout: a 504, or (streamed) an error event and response.failed; a client that leaves
    a stream cancels its generation."""
    app = create_app(tiny_generator(), model_id=MODEL, timeout=0.1)
    long = {"model": MODEL, "input": "w5 w6 w7", "max_output_tokens": 500, "temperature": 0}
    with LiveServer(app) as live:
        r = httpx.post(live.url + "/v1/responses", json=long, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        events = list(_client(live).responses.create(**long, stream=True))
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2].code == "timeout" and "did not complete within" in events[-2].message
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "timeout" and failed.id == events[0].response.id
        wait_until(lambda: metric(live.url, "dflashkit_generations_total", outcome="timeout") == 2)
    app = create_app(tiny_generator(), model_id=MODEL)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        with http.stream("POST", "/v1/responses", json={**long, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines) == "event: response.created"
        wait_until(lambda: metric(live.url, "dflashkit_generations_total", outcome="cancelled") == 1)
        assert metric(live.url, "dflashkit_completion_tokens_total") < 500
        # the client left mid-stream: its request is a 499, not the 200 its status line said
        wait_until(lambda: metric(live.url, "dflashkit_requests_total", endpoint="/v1/responses", status="499") == 1)
        assert metric(live.url, "dflashkit_requests_total", endpoint="/v1/responses", status="200") == 0


def test_a_continued_response_keeps_the_tokens_the_model_wrote() -> None:
    """previous_response_id: the next prompt begins with the stored turn's own prompt and answer tokens (a random
    byte-level model writes bytes that do not survive decoding and re-encoding), so the prefix cache restores the
    whole turn; the answer is offline generation from those tokens."""

    def generator() -> SpeculativeGenerator:
        tok = merging_tokenizer()
        model = tiny_target("llama", vocab_size=len(tok))
        return SpeculativeGenerator(model, tok, tiny_drafter(model, block_size=4))

    offline = generator()
    tok = offline.tokenizer
    app = create_app(generator(), model_id=MODEL)
    with LiveServer(app) as live:
        client = _client(live)
        first = client.responses.create(
            model=MODEL, input="hi", max_output_tokens=24, temperature=1.0, extra_body={"seed": 1}
        )
        text1, ids1, answer = app.state.service.responses.get(first.id).continuation
        assert ids1 == offline.encode_prompt([{"role": "user", "content": "hi"}]) and answer
        second = client.responses.create(
            model=MODEL, input="more", previous_response_id=first.id, max_output_tokens=8, temperature=0
        )
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "more"},
    ]
    text2 = render_chat(tok, messages)
    ids2 = continued_prompt(tok, text2, (text1, ids1, answer))
    assert ids2[: len(ids1) + len(answer)] == ids1 + answer
    assert second.usage.input_tokens == len(ids2)
    assert second.usage.input_tokens_details.cached_tokens >= len(ids1) + len(answer) - 1
    assert second.output_text == offline.generate(ids2, max_new_tokens=8).text
    # re-encoded, the conversation would have parted from the stored tokens within the answer
    assert common_prefix(offline.encode_prompt(messages), ids1 + answer) < len(ids1) + len(answer) - 1


def test_text_then_a_call_is_a_message_then_a_function_call_item_streamed_or_not() -> None:
    """An answer with text before its call: output [message, function_call], the same through the client's
    stream helper (whose accumulation checks the events' item ids and indices) as in the whole response."""
    app = create_app(tool_generator(), model_id=MODEL)
    scripted(app, TEXT_THEN_CALL)
    with LiveServer(app) as live:
        client = _client(live)
        ask = {"model": MODEL, "input": "Pick a color.", "tools": [PICK_TOOL], "max_output_tokens": 50}
        whole = client.responses.create(**ask)
        with client.responses.stream(**ask) as stream:
            texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
    for resp in (whole, final):
        message, call = resp.output
        assert message.type == "message" and call.type == "function_call" and resp.status == "completed"
        assert (call.name, call.arguments) == ("pick_color", '{"color": "red"}')
    assert whole.output_text.strip() == "Let me pick." and "".join(texts) == final.output_text == "Let me pick. "


def test_truncation_auto_drops_the_earliest_turns_until_the_prompt_fits(client, offline) -> None:
    """A conversation past the context: refused with truncation "disabled" (the default); with "auto", its earliest
    turns are left out, whole (what is kept begins with a user message, even where leaving out the first message
    alone would fit) and the answer is offline generation of what is kept; the stored conversation keeps every
    turn, so each later request truncates again."""
    long = " ".join(f"w{4 + i % 90}" for i in range(200))
    first = client.responses.create(model=MODEL, input=long, max_output_tokens=40, temperature=0)
    second = client.responses.create(
        model=MODEL, input=long, previous_response_id=first.id, max_output_tokens=40, temperature=0
    )
    with pytest.raises(openai.BadRequestError) as e:  # 2 x 200 + 2 x 40 + 1 prompt tokens + 60 > 512 positions
        client.responses.create(model=MODEL, input="w5", previous_response_id=second.id, max_output_tokens=60)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_output_tokens"
    third = client.responses.create(
        model=MODEL, input="w5", previous_response_id=second.id, max_output_tokens=60, truncation="auto", temperature=0
    )
    kept = [
        {"role": "user", "content": long},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "w5"},
    ]  # the first turn left out, the second kept
    expected = offline_chat(offline, kept, 60)
    assert third.truncation == "auto" and third.output_text == expected.text
    assert third.usage.input_tokens == expected.prompt_tokens
    fourth = client.responses.create(
        model=MODEL, input="w6", previous_response_id=third.id, max_output_tokens=4, truncation="auto", temperature=0
    )
    assert fourth.usage.input_tokens == len(
        offline.encode_prompt(  # the first turn left out again, the rest fits
            [*kept, {"role": "assistant", "content": third.output_text}, {"role": "user", "content": "w6"}]
        )
    )


def test_input_items_list_the_request_input(client) -> None:
    """GET /v1/responses/{id}/input_items: the request's own input items, with ids, newest first by default,
    paged (the client's auto-pagination walks them with after)."""
    resp = client.responses.create(
        model=MODEL,
        max_output_tokens=2,
        input=[
            {"role": "developer", "content": "w9"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "w5 w6"}]},
            {"role": "assistant", "content": "w7"},
            {"role": "user", "content": "w8"},
        ],
    )
    items = client.responses.input_items.list(resp.id, order="asc").data
    assert [(i.role, [c.text for c in i.content]) for i in items] == [
        ("developer", ["w9"]),
        ("user", ["w5 w6"]),
        ("assistant", ["w7"]),
        ("user", ["w8"]),
    ]
    assert all(i.type == "message" and i.id.startswith("msg_") for i in items)
    newest_first = client.responses.input_items.list(resp.id)
    assert [i.id for i in newest_first.data] == [i.id for i in reversed(items)]
    assert [i.id for i in client.responses.input_items.list(resp.id, limit=1, order="asc")] == [i.id for i in items]
    page = client.responses.input_items.list(resp.id, limit=2, order="asc", after=items[0].id)
    assert [i.id for i in page.data] == [items[1].id, items[2].id] and page.has_more
    text = client.responses.create(model=MODEL, input="w5", max_output_tokens=2)
    (only,) = client.responses.input_items.list(text.id).data
    assert only.role == "user" and only.content[0].text == "w5"
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(resp.id, after="msg_unknown")
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
