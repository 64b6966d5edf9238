"""Tool calling in the <tool_call> convention: request checks, parsing (whole and streamed), the forced-call grammar."""

from __future__ import annotations

import json
import random

import pytest

from dflashkit import SpeculativeGenerator
from dflashkit.errors import InvalidInputError
from dflashkit.tool_calls import CLOSE, OPEN, ToolCallStream, ToolError, ToolRequest, check_template, parse_tool_calls
from tests.conftest import BYTE_VOCAB, byte_tokenizer, tiny_drafter, tiny_target
from tests.live_server import TOOLS_TEMPLATE, tiny_byte_generator, tool_generator

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"$ref": "#/$defs/zone"}},
            "required": ["zone"],
            "additionalProperties": False,
            "$defs": {"zone": {"enum": ["UTC", "CET"]}},
        },
    },
}
NAMES = ["get_weather", "get_time"]


# ---- request checks -------------------------------------------------------------------------------------------


def test_tool_request_parses_tools_and_choices():
    assert ToolRequest.parse(None) is None and ToolRequest.parse([], "none") is None
    req = ToolRequest.parse([WEATHER, TIME])
    assert req.choice == "auto" and req.names == NAMES and req.active and req.grammar() is None
    assert req.template_tools() == [WEATHER, TIME]
    assert (
        not ToolRequest.parse([WEATHER], "none").active
        and ToolRequest.parse([WEATHER], "none").template_tools() is None
    )
    named = ToolRequest.parse([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert (named.choice, named.function) == ("function", "get_time")
    no_params = ToolRequest.parse([{"type": "function", "function": {"name": "ping"}}])
    assert no_params.tools[0].parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    "tools, choice, field, match",
    [
        ([WEATHER], "sometimes", "tool_choice", "tool_choice must be one of"),
        ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice", "not among the tools"),
        ([WEATHER], {"type": "function"}, "tool_choice", "tool_choice must be one of"),
        (None, "required", "tool_choice", "tool_choice needs tools"),
        ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools", "letters, digits"),
        ([{"type": "retrieval"}], None, "tools", r"tools\[0\] must be"),
        ([WEATHER, WEATHER], None, "tools", "distinct"),
        ({"a": 1}, None, "tools", "must be a list"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools", "JSON schema object"),
    ],
)
def test_tool_request_refuses_malformed_tools(tools, choice, field, match):
    with pytest.raises(ToolError, match=match) as info:
        ToolRequest.parse(tools, choice)
    assert info.value.field == field and isinstance(info.value, InvalidInputError)


def test_check_template_refuses_templates_without_the_convention():
    class Tok:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    with pytest.raises(ToolError, match="no tools"):
        check_template(Tok())
    Tok.chat_template = "{% if tools %}[TOOL_CALLS]{% endif %}"
    with pytest.raises(ToolError, match="convention"):
        check_template(Tok())
    Tok.chat_template = TOOLS_TEMPLATE
    check_template(Tok())
    Tok.chat_template = {"default": "no", "tool_use": TOOLS_TEMPLATE}
    check_template(Tok())


# ---- parsing ----------------------------------------------------------------------------------------------------


def test_parse_tool_calls():
    one = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Oslo", "unit": "C"}}}}\n{CLOSE}'
    content, calls = parse_tool_calls(one, NAMES)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"})
    ]
    assert calls[0].id.startswith("call_")
    two = f'Let me check.\n{one}\n{OPEN}{{"name": "get_time", "arguments": "{{\\"zone\\": \\"UTC\\"}}"}}'  # unclosed
    content, calls = parse_tool_calls(two, NAMES)
    assert content == "Let me check." and [c.name for c in calls] == NAMES
    assert json.loads(calls[1].arguments) == {"zone": "UTC"} and calls[0].id != calls[1].id
    assert parse_tool_calls("no calls here", NAMES) == ("no calls here", [])
    cut = f'{one}\n{OPEN}\n{{"name": "get_'  # max_tokens ended the answer inside a second call
    content, calls = parse_tool_calls(cut, NAMES)
    assert [c.name for c in calls] == ["get_weather"] and content == f'{OPEN}\n{{"name": "get_'
    # a bare JSON call as the whole answer (small models drop the tags); other JSON stays content
    content, calls = parse_tool_calls(' {"name": "get_time", "arguments": {"zone": "UTC"}}\n', NAMES)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "UTC"}')]
    for text in ('{"name": "rm_rf", "arguments": {}}', '{"color": "red"}', 'Try {"name": "get_time", "arguments": {}}'):
        assert parse_tool_calls(text, NAMES) == (text, [])
    for bad in (
        f'{OPEN}{{"name": "rm_rf", "arguments": {{}}}}{CLOSE}',  # unknown tool
        f'{OPEN}{{"name": "get_time", "arguments": {{"zone": }}{CLOSE}',  # not JSON
        f'{OPEN}{{"name": "get_time", "arguments": [1]}}{CLOSE}',  # arguments not an object
        f'{one}{OPEN}["get_time"]{CLOSE}',
    ):  # one bad block: all of it is text
        assert parse_tool_calls(bad, NAMES) == (bad, [])


@pytest.mark.parametrize("seed", range(6))
def test_tool_call_stream_matches_whole_text_parsing(seed):
    """However the text is cut into deltas, the released content + the calls at the end equal parsing the whole
    text; content before a call goes out before the answer ends, a possible start of a call does not."""
    call = f'{OPEN}\n{{"name": "get_time", "arguments": {{"zone": "CET"}}}}\n{CLOSE}'
    bare = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    for text in (
        "Plain answer with < and <tool and <tool_cal in it",
        f"Checking the time. {call}",
        f"{call}\n{call}",
        f"{OPEN} not json {CLOSE} after",
        f"\n {bare}",
        '{"color": "red"} is JSON',
        '{"arguments": {"zone": "UTC"}, "name": "get_time"}',
        f"{bare} is the call",
        f'{{"a": 1}} {call}',
        '{"name": "get_time", "arguments": {}, "id": 7}',
        '{"name": "x", "arguments": {}, "name": "get_time"}',
        '{"name": "Ada", "age": 36}',
        '{"name": ["get_time"]}',
        f"{bare[:-1]}",
    ):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = ToolCallStream(NAMES)
        released = [stream.feed(p) for p in pieces]
        rest, calls = stream.finish()
        whole_content, whole_calls = parse_tool_calls(text, NAMES)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
        if calls:
            assert ("".join(released) + rest).strip() == (whole_content or "")
            assert OPEN not in "".join(released)
        else:
            assert "".join(released) + rest == text
    stream = ToolCallStream(NAMES)
    assert stream.feed("Checking <to") == "Checking " and stream.feed("day> done") == "<today> done"
    stream = ToolCallStream(NAMES)
    assert stream.feed("  ") == "" and stream.feed("Hi") == "  Hi"  # leading whitespace waits for the first word


def test_tool_call_stream_releases_json_that_is_no_call_early():
    """An answer that begins with "{" is held only while it may still be a bare call: a JSON answer (say under
    response_format) streams from its first key that no call has, or from a name that is no tool's."""
    stream = ToolCallStream(NAMES)
    assert stream.feed(' {"ci') == "" and stream.feed('ty": "Par') == ' {"city": "Par' and stream.feed("is") == "is"
    assert stream.finish() == ("", [])
    stream = ToolCallStream(NAMES)
    assert stream.feed('{"name": "Ad') == "" and stream.feed('a", "age"') == '{"name": "Ada", "age"'
    stream = ToolCallStream(NAMES)
    for piece in ('{"name": "get_time", ', '"arguments": {"zone": "UTC", "x": {"name": "no"}}', "}"):
        assert stream.feed(piece) == ""  # a call so far: held (keys inside the arguments are not the call's)
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["get_time"]
    stream = ToolCallStream(NAMES)
    assert stream.feed('{"name": "get_time", "arguments": {}}') == "" and stream.feed(" and") == (
        '{"name": "get_time", "arguments": {}} and'
    )


# ---- the forced call -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_call_is_a_valid_call_and_exactly_the_constrained_target(choice):
    """tool_choice required / named on a random tiny target: the grammar makes every answer well-formed calls with
    schema-valid arguments ($ref to hoisted $defs included), and speculative greedy equals plain greedy."""
    gen = tool_generator()
    req = ToolRequest.parse([WEATHER, TIME], choice, parallel_tool_calls=False)
    ids = gen.encode_prompt([{"role": "user", "content": "What time is it?"}], tools=req.template_tools())
    prompt_text = gen.tokenizer.decode(ids)
    assert '"name": "get_time"' in prompt_text and "<|assistant|>" in prompt_text  # the template showed the tools
    grammar = gen.tool_call_grammar(req)
    spec = gen.generate(ids, max_new_tokens=160, grammar=grammar, block_size=4, compare_ar=True)
    assert spec.token_ids == spec.ar.token_ids  # fp32: speculative greedy is plain greedy
    text = gen.tokenizer.decode(spec.token_ids, skip_special_tokens=True)
    assert spec.finish_reason == "stop", text
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None and len(calls) == 1
    args = json.loads(calls[0].arguments)
    if isinstance(choice, dict):
        assert calls[0].name == "get_time"
    if calls[0].name == "get_time":
        assert set(args) == {"zone"} and args["zone"] in ("UTC", "CET")
    else:
        assert set(args) == {"city", "unit"} and len(args["city"]) <= 12 and args["unit"] in ("C", "F")


def test_tools_and_tool_turns_go_through_the_template():
    gen = tool_generator()
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "content": "4 degrees, rain", "tool_call_id": "call_1"},
    ]
    text = gen.tokenizer.decode(gen.encode_prompt(messages, tools=[WEATHER]))
    # the arguments reach the template as an object (printed once as JSON, not as a quoted string)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}' in text
    assert "<|tool|>4 degrees, rain" in text and '"description": "Current weather in a city"' in text
    with pytest.raises(InvalidInputError, match="chat=False"):
        gen.encode_prompt("hi", chat=False, tools=[WEATHER])
    plain = tiny_byte_generator()
    plain.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ToolError, match="no tools"):
        plain.encode_prompt("hi", tools=[WEATHER])
    assert "tools" not in gen.tokenizer.decode(gen.encode_prompt("hi"))  # without tools: the plain chat turn


def test_tags_that_are_tokens_are_forced_as_those_tokens():
    """Qwen's tokenizer has <tool_call> and </tool_call> as added tokens (llguidance reads them as special): the
    forced call uses those tokens, as the model writes them, not the tags spelled in pieces."""
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([OPEN, CLOSE])  # ids BYTE_VOCAB, BYTE_VOCAB + 1
    model = tiny_target("llama", vocab_size=BYTE_VOCAB + 2, max_position_embeddings=2048)
    gen = SpeculativeGenerator(model, tokenizer, tiny_drafter(model, block_size=4))
    gen.tokenizer.chat_template = TOOLS_TEMPLATE
    req = ToolRequest.parse([TIME], "required", parallel_tool_calls=False)
    assert json.dumps(OPEN) in req.grammar().source  # without a tokenizer: the text
    ids = gen.encode_prompt([{"role": "user", "content": "Time?"}], tools=req.template_tools())
    result = gen.generate(ids, grammar=gen.tool_call_grammar(req), max_new_tokens=1000, block_size=4)
    assert result.token_ids[0] == BYTE_VOCAB and result.token_ids.count(BYTE_VOCAB + 1) == 1
    content, calls = parse_tool_calls(result.text, NAMES)
    assert content is None and calls[0].name == "get_time"
    assert json.loads(calls[0].arguments)["zone"] in ("UTC", "CET")
