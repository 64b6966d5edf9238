"""/v1/messages (Anthropic's Messages API), live on localhost, driven by the official `anthropic` client: answers
equal offline chat generation of the conversation the request means, streamed events accumulate (in the client's
own stream helper) to the same message, stop reasons and usage as Anthropic reports them, tool_use / tool_result
round trips, structured output, count_tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from pydantic import BaseModel

from dflashkit.server import create_app
from dflashkit.tool_calls import ToolRequest, parse_tool_calls
from tests.live_server import (
    TEXT_THEN_CALL,
    LiveServer,
    offline_chat,
    scripted,
    tiny_byte_generator,
    tiny_generator,
    tool_generator,
)

MODEL = "tiny-llama"
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK no longer has sampling keywords; the API takes them
SAMPLED = {"extra_body": {"temperature": 1.0, "seed": 3}}
PROMPT = "w5 w6 w7 w8 w9 w10 w11 w12"


def _client(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    return tiny_generator()


@pytest.fixture(scope="module")
def live():
    with LiveServer(create_app(tiny_generator(), model_id=MODEL, proposal="sample")) as server:
        yield server


@pytest.fixture(scope="module")
def client(live) -> anthropic.Anthropic:
    return _client(live)


def test_text_answer_equals_offline_chat_and_streams_the_same(client, offline) -> None:
    """system + user: the offline answer, stop_reason max_tokens at the limit, stop_sequence naming the stop that
    ended it; the client's stream helper gives the same text and message; usage splits restored prompt tokens
    (cache_read_input_tokens) from prefilled ones (input_tokens)."""
    messages = [{"role": "system", "content": "w20"}, {"role": "user", "content": PROMPT}]
    for options, temperature, seed in ((GREEDY, 0.0, None), (SAMPLED, 1.0, 3)):
        # the server decodes each request as a batch member: chains where a seeded request alone would verify
        # trees (generator.default_tree); the text is the same either way, the drafting statistics are not
        expected = offline_chat(offline, messages, 12, temperature, seed, tree=0)
        msg = client.messages.create(
            model=MODEL, max_tokens=12, system="w20", messages=[{"role": "user", "content": PROMPT}], **options
        )
        assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
        assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == expected.text
        assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None and msg.usage.output_tokens == 12
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == expected.prompt_tokens
        spec = msg.usage.model_extra["speculative"]
        assert (
            spec["drafting_steps"] == expected.stats.steps
            and spec["accepted_per_position"] == expected.stats.accepted_per_position
        )
        with client.messages.stream(
            model=MODEL,
            max_tokens=12,
            system=[{"type": "text", "text": "w20"}],
            messages=[{"role": "user", "content": PROMPT}],
            **options,
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == final.content[0].text == expected.text and final.stop_reason == "max_tokens"
        assert final.usage.cache_read_input_tokens > 0  # the same prompt again: restored from the prefix cache
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == expected.prompt_tokens
    words = expected.text.split(" ")
    stop = " " + words[3]
    cut = offline_chat(offline, messages, 12, 1.0, 3, stop=[stop, "w999"])
    assert cut.stop_string == stop
    msg = client.messages.create(
        model=MODEL,
        max_tokens=12,
        system="w20",
        stop_sequences=["w999", stop],
        messages=[{"role": "user", "content": PROMPT}],
        **SAMPLED,
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop and msg.content[0].text == cut.text
    assert msg.usage.model_extra["speculative"]["sampler"] == "coupled"  # seeded: the default
    msg = client.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[{"role": "user", "content": PROMPT}],
        extra_body={"temperature": 1.0, "seed": 3, "sampler": "rejection"},
    )
    assert msg.usage.model_extra["speculative"]["sampler"] == "rejection"  # the sampler extension


def test_count_tokens_counts_the_prompt(client, offline) -> None:
    messages = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": "w7"},
        {"role": "user", "content": [{"type": "text", "text": "w8 "}, {"type": "text", "text": "w9"}]},
    ]
    counted = client.messages.count_tokens(model=MODEL, system="w20", messages=messages)
    chat = [{"role": "system", "content": "w20"}, *messages[:2], {"role": "user", "content": "w8 w9"}]
    assert counted.input_tokens == len(offline.encode_prompt(chat))


PICK_TOOL = {
    "name": "pick_color",
    "description": "Pick a color",
    "input_schema": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
}


def test_tool_use_goes_out_and_tool_result_comes_back() -> None:
    """tool_choice any (one call): a tool_use block equal to offline generation under the tool grammar, streamed
    the same; sent back with a tool_result, the prompt is the one offline chat builds."""
    offline = tool_generator()
    chat_tool = {
        "type": "function",
        "function": {"name": "pick_color", "description": "Pick a color", "parameters": PICK_TOOL["input_schema"]},
    }
    with LiveServer(create_app(tool_generator(), model_id=MODEL)) as live:
        client = _client(live)
        request = ToolRequest.parse([chat_tool], "required", parallel_tool_calls=False)
        messages = [{"role": "user", "content": "Pick a color."}]
        expected = offline.generate(
            offline.encode_prompt(messages, tools=request.template_tools()),
            grammar=offline.tool_call_grammar(request),
            max_new_tokens=300,
        )
        _, (call,) = parse_tool_calls(expected.text, request.names)
        msg = client.messages.create(
            model=MODEL,
            max_tokens=300,
            messages=messages,
            tools=[PICK_TOOL],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            **GREEDY,
        )
        (block,) = msg.content
        assert msg.stop_reason == "tool_use" and block.type == "tool_use" and block.id.startswith("toolu_")
        assert block.name == call.name and block.input == json.loads(call.arguments)
        with client.messages.stream(
            model=MODEL,
            max_tokens=300,
            messages=messages,
            tools=[PICK_TOOL],
            tool_choice={"type": "tool", "name": "pick_color"},
            **GREEDY,
        ) as stream:
            final = stream.get_final_message()
        (streamed,) = final.content
        assert final.stop_reason == "tool_use" and (streamed.name, streamed.input) == (block.name, block.input)
        sent = [
            *messages,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": streamed.id,
                        "type": "function",
                        "function": {"name": "pick_color", "arguments": json.dumps(block.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": streamed.id, "content": "done"},
        ]
        prompt = offline.encode_prompt(sent, tools=[chat_tool])
        after = client.messages.create(
            model=MODEL,
            max_tokens=8,
            tools=[PICK_TOOL],
            **GREEDY,
            messages=[
                *messages,
                {"role": "assistant", "content": [streamed.model_dump(exclude_none=True)]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": streamed.id,
                            "content": [{"type": "text", "text": "done"}],
                        }
                    ],
                },
            ],
        )
        assert after.usage.input_tokens + after.usage.cache_read_input_tokens == len(prompt)
        assert after.content[0].text == offline.generate(prompt, max_new_tokens=8).text
        # no tool_choice: the model may answer with text (this one does)
        auto = client.messages.create(model=MODEL, max_tokens=4, messages=messages, tools=[PICK_TOOL], **GREEDY)
        assert auto.stop_reason == "max_tokens" and [b.type for b in auto.content] == ["text"]


class Pick(BaseModel):
    color: str
    ok: bool


def test_structured_output_parses() -> None:
    """output_config.format (the client's messages.parse with a pydantic model): JSON of that shape."""
    with LiveServer(create_app(tiny_byte_generator(), model_id=MODEL)) as live:
        parsed = _client(live).messages.parse(
            model=MODEL,
            max_tokens=300,
            output_format=Pick,
            **GREEDY,
            messages=[{"role": "user", "content": "Pick a color."}],
        )
        assert parsed.stop_reason == "end_turn" and isinstance(parsed.parsed_output, Pick)


ASKED = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}
TOOL_RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "w6"}]}

BAD = [
    ({"messages": [{"role": "user", "content": "w5"}]}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, 400, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "w5"}]}, 400, "role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "image"),
    (
        {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}],
        },
        400,
        "tool_use",
    ),
    ({"max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "w5"}]}, 400, "temperature"),
    ({"max_tokens": 4, "stop_sequences": "w5", "messages": [{"role": "user", "content": "w5"}]}, 400, "stop_sequences"),
    (
        {
            "max_tokens": 4,
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            "messages": [{"role": "user", "content": "w5"}],
        },
        400,
        "tools",
    ),
    (
        {
            "max_tokens": 4,
            "tool_choice": {"type": "maybe"},
            "tools": [PICK_TOOL],
            "messages": [{"role": "user", "content": "w5"}],
        },
        400,
        "tool_choice",
    ),
    (
        {
            "max_tokens": 4,
            "output_config": {"format": {"type": "yaml"}},
            "messages": [{"role": "user", "content": "w5"}],
        },
        400,
        "output_config",
    ),
    ({"max_tokens": 2000, "messages": [{"role": "user", "content": "w5"}]}, 400, "max_tokens"),
    ({"model": "other", "max_tokens": 4, "messages": [{"role": "user", "content": "w5"}]}, 404, "other"),
    # a tool_result answers a tool_use block of the assistant message just before it
    ({"max_tokens": 4, "messages": [TOOL_RESULT]}, 400, "messages[0].content[0].tool_use_id 'toolu_1'"),
    (
        {
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": "w5"},
                ASKED,
                TOOL_RESULT,
                ASKED,
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "w6"}]},
            ],
        },
        400,
        "messages[4].content[0].tool_use_id 'toolu_9' answers no tool_use block",
    ),
    (
        {"max_tokens": 4, "messages": [ASKED, {"role": "assistant", "content": "w5"}, TOOL_RESULT]},
        400,
        "messages[2].content[0].tool_use_id",
    ),
]


@pytest.mark.parametrize(("body", "status", "word"), BAD)
def test_bad_requests_get_anthropic_errors(live, body, status, word) -> None:
    r = httpx.post(live.url + "/v1/messages", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == status, r.text
    out = r.json()
    assert out["type"] == "error" and set(out["error"]) == {"type", "message"}, out
    assert out["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert word in out["error"]["message"], out
    with pytest.raises(anthropic.APIStatusError) as e:  # the client reads it as Anthropic's
        _client(live).post("/v1/messages", body={"model": MODEL, **body}, cast_to=anthropic.types.Message)
    assert e.value.status_code == status and e.value.body["error"]["message"] == out["error"]["message"]


def test_tool_results_are_checked_when_counting_tokens_too(live) -> None:
    """count_tokens refuses a tool_result without its tool_use as /v1/messages does, and counts a matched pair."""
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}, TOOL_RESULT]}
    r = httpx.post(live.url + "/v1/messages/count_tokens", json=ask, timeout=30)
    assert r.status_code == 400 and "tool_use_id 'toolu_1' answers no tool_use block" in r.json()["error"]["message"]
    ask["messages"].insert(1, ASKED)
    r = httpx.post(live.url + "/v1/messages/count_tokens", json=ask, timeout=30)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


def test_the_openai_endpoints_keep_openai_errors(live) -> None:
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_timeout_is_an_error_event_mid_stream() -> None:
    with LiveServer(create_app(tiny_generator(), model_id=MODEL, timeout=0.1)) as live:
        client = _client(live)
        ask = {"model": MODEL, "max_tokens": 500, "messages": [{"role": "user", "content": "w5 w6 w7"}], **GREEDY}
        with pytest.raises(anthropic.APIStatusError, match="did not complete within") as e:
            client.messages.create(**ask)
        assert e.value.status_code == 504 and e.value.body["error"]["type"] == "timeout_error"
        with (
            pytest.raises(anthropic.APIStatusError, match="did not complete within"),
            client.messages.stream(**ask) as stream,
        ):
            for _ in stream:
                pass


def test_models_list_reads_in_both_clients(live) -> None:
    """/v1/models answers the OpenAI client's and the Anthropic client's model calls."""
    import openai

    models = _client(live).models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].type == "model"
    assert models.data[0].display_name == MODEL and models.data[0].created_at.year >= 2026
    assert _client(live).models.retrieve(MODEL).id == MODEL
    assert [m.id for m in openai.OpenAI(base_url=live.url + "/v1", api_key="x").models.list()] == [MODEL]


def test_fields_a_coding_agent_sends_are_taken(client, offline) -> None:
    """What agents such as Claude Code add (cache_control on blocks, metadata, thinking, a system of blocks,
    anthropic-beta headers, ?beta=true) is accepted; the answer is the plain request's."""
    plain = client.messages.create(
        model=MODEL, max_tokens=6, system="w20", messages=[{"role": "user", "content": PROMPT}], **GREEDY
    )
    ephemeral = {"type": "ephemeral"}
    busy = client.messages.create(
        model=MODEL,
        max_tokens=6,
        metadata={"user_id": "u1"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        system=[{"type": "text", "text": "w20", "cache_control": ephemeral}],
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT, "cache_control": ephemeral}]}],
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"},
        extra_query={"beta": "true"},
        **GREEDY,
    )
    assert busy.content[0].text == plain.content[0].text


def test_text_then_a_call_is_a_text_then_a_tool_use_block_streamed_or_not() -> None:
    app = create_app(tool_generator(), model_id=MODEL)
    scripted(app, TEXT_THEN_CALL)
    with LiveServer(app) as live:
        client = _client(live)
        ask = {
            "model": MODEL,
            "max_tokens": 50,
            "tools": [PICK_TOOL],
            "messages": [{"role": "user", "content": "Pick a color."}],
        }
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            final = stream.get_final_message()
    for msg in (whole, final):
        text, call = msg.content
        assert msg.stop_reason == "tool_use" and text.type == "text" and text.text.startswith("Let me pick.")
        assert call.type == "tool_use" and (call.name, call.input) == ("pick_color", {"color": "red"})


def test_clamp_max_tokens_lowers_a_budget_past_the_context() -> None:
    """--clamp-max-tokens: a max_tokens past the context (an agent's fixed 32000) runs to the context's end
    instead of a 400; without it, the 400 says the most that fits."""
    ask = {"model": MODEL, "max_tokens": 32000, "messages": [{"role": "user", "content": "w5 w6 w7"}], **GREEDY}
    with (
        LiveServer(create_app(tiny_generator(), model_id=MODEL)) as live,
        pytest.raises(anthropic.BadRequestError, match="at most 509"),
        _client(live).messages.stream(**ask),
    ):
        pass
    with LiveServer(create_app(tiny_generator(), model_id=MODEL, clamp_max_tokens=True)) as live:
        with _client(live).messages.stream(**ask) as stream:
            msg = stream.get_final_message()
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 512 - 3
