"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over the chat engine.

For clients written against Anthropic's SDK (and tools that take an ``ANTHROPIC_BASE_URL``). As with the
Responses API, a request is turned into the chat request it means (``system`` → a system turn, content blocks →
messages: ``tool_use`` blocks → an assistant's tool calls, ``tool_result`` blocks → tool turns; tools with their
``input_schema`` → function tools; ``tool_choice`` auto / any / tool / none), so it is validated, tokenised and
generated exactly as /v1/chat/completions would be; the answer is a message with ``text`` and ``tool_use`` content
blocks and a ``stop_reason``, or, streamed, Anthropic's events (``message_start`` … ``message_stop``). Errors on these
paths are Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from dflashkit.generator import GenerationResult, TextDelta
from dflashkit.server.errors import APIError, bad_request
from dflashkit.server.responses import ResponseBuilder, usage
from dflashkit.server.schemas import ChatCompletionRequest, OpenAIRequest, chat_request
from dflashkit.tool_calls import ToolCall

if TYPE_CHECKING:
    from dflashkit.server.plan import Plan

PATH = "/v1/messages"
# chat request fields, as the Messages API names them (for the error messages)
PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    """An APIError in Anthropic's shape (the field at fault, if known, named in the message)."""
    message = error.message
    param = PARAMS.get(error.param, error.param) if error.param else None
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": message}}


class MessagesRequest(OpenAIRequest):
    """/v1/messages (and, without max_tokens, count_tokens). Unknown fields (cache_control, metadata, ...) are
    ignored; what the engine cannot honour is refused."""

    model: str
    messages: Annotated[list[Any], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # required by /v1/messages (checked there)
    system: str | list[Any] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[Any] | None = None  # {"name", "description", "input_schema"}
    tool_choice: dict[str, Any] | None = None  # {"type": "auto" | "any" | "tool" | "none", "name", ...}
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema": {...}}}; effort ignored
    thinking: dict[str, Any] | None = None  # accepted and ignored: these models do not think apart
    # dflashkit extensions, as in the chat endpoint
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    cache_prompt: bool = True
    sampler: Literal["rejection", "coupled"] | None = None

    def as_chat(self, generation: bool = True) -> ChatCompletionRequest:
        """The chat request this request means (``generation`` False: for counting its tokens only)."""
        if generation and self.max_tokens is None:
            raise bad_request("max_tokens: Field required", param="max_tokens")
        system = [{"role": "system", "content": _text(self.system, "system")}] if self.system is not None else []
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": [*system, *chat_messages(self.messages)],
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stream": self.stream,
            "cache_prompt": self.cache_prompt,
        }
        choice, parallel = chat_tool_choice(self.tool_choice)
        optional = {
            "max_completion_tokens": self.max_tokens,
            "seed": self.seed,
            "stop": self.stop_sequences,
            "sampler": self.sampler,
            "tools": chat_tools(self.tools),
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
            "response_format": self.response_format(),
        }
        chat.update({k: v for k, v in optional.items() if v is not None})
        return chat_request(chat, PARAMS)

    def response_format(self) -> dict[str, Any] | None:
        """``output_config.format`` as a chat response_format (structured output)."""
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad_request(
                'output_config.format must be {"type": "json_schema", "schema": {...}}', param="output_config"
            )
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _text(content: Any, where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content
    ):
        return "".join(b["text"] for b in content)
    raise bad_request(f"{where} must be text or a list of text blocks", param=where.split("[")[0].split(".")[0])


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages of Anthropic ``messages``: a user turn's ``tool_result`` blocks become tool turns (before its
    text, as Anthropic requires them first), an assistant turn's ``tool_use`` blocks its tool calls."""
    out: list[dict[str, Any]] = []
    answerable: list[str] = []  # the tool_use ids of the message before this one: what a tool_result may answer
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        asked, answerable = answerable, []
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant, got {role!r}", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be text or a list of content blocks", param="messages")
        texts, calls = [], []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
                if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, dict):
                    raise bad_request(f"{at}: a tool_use block needs id, name and an input object", param="messages")
                answerable.append(call_id)
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
                    }
                )
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_request(f"{at}: a tool_result block needs the tool_use_id it answers", param="messages")
                if block["tool_use_id"] not in asked:
                    raise bad_request(
                        f"{at}.tool_use_id {block['tool_use_id']!r} answers no tool_use block: a tool_result must "
                        "answer one of the assistant message just before it"
                        + (f" (its tool_use ids: {', '.join(map(repr, asked))})" if asked else ", which has none"),
                        param="messages",
                    )
                result = _text(block.get("content", ""), f"{at}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
            elif kind in ("image", "document", "search_result"):
                raise bad_request(f"{at} is {kind}: this model reads text only", param="messages")
            else:
                raise bad_request(
                    f"{at}: blocks of type {kind!r} are not supported here (text; tool_use in assistant "
                    "turns, tool_result in user turns)",
                    param="messages",
                )
        if calls:
            out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
        elif texts or role == "assistant":
            out.append({"role": role, "content": "".join(texts)})
    return out


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Anthropic client tools ({"name", "description", "input_schema"}) as function tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "name" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(
                f"tools[{i}]: only client tools ({{name, description, input_schema}}) are supported by "
                f"this server, got type {kind!r}",
                param="tools",
            )
        function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat tool_choice, parallel_tool_calls) of an Anthropic tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise bad_request(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice")


def _stop_reason(result: GenerationResult, calls: list[ToolCall]) -> tuple[str, str | None]:
    if result.finish_reason == "length":
        return "max_tokens", None
    if result.stop_string is not None:
        return "stop_sequence", result.stop_string
    return ("tool_use" if calls else "end_turn"), None


class MessageBuilder:
    """One answer: the whole message at the end, or the stream of its events."""

    def __init__(self, plan: Plan, model_id: str) -> None:
        self.chat = ResponseBuilder(plan, model_id)  # the text pieces and the usage
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model_id
        self.blocks = 0  # content blocks opened so far
        self.text_open = False

    def usage(self, result: GenerationResult | None) -> dict[str, Any]:
        """Anthropic's usage: input_tokens are those prefilled, cache_read_input_tokens those restored."""
        prompt = self.chat.prompt_tokens
        if result is None:
            return {
                "input_tokens": prompt,
                "output_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0,
            }
        cached = result.stats.cached_prompt_tokens
        return {
            "input_tokens": prompt - cached,
            "output_tokens": len(result.token_ids),
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "speculative": usage(result.stats, prompt, len(result.token_ids))["speculative"],
        }

    def message(
        self, content: list[dict[str, Any]], result: GenerationResult | None, calls: list[ToolCall] | None = None
    ) -> dict[str, Any]:
        reason, sequence = _stop_reason(result, calls or []) if result is not None else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self.usage(result),
        }

    @staticmethod
    def tool_use(call: ToolCall) -> dict[str, Any]:
        return {
            "type": "tool_use",
            "id": f"toolu_{uuid.uuid4().hex[:24]}",
            "name": call.name,
            "input": json.loads(call.arguments),
        }

    # ---- whole -----------------------------------------------------------------------------------------------

    def add(self, delta: TextDelta) -> None:
        self.chat.add(delta)

    def complete(self, result: GenerationResult) -> dict[str, Any]:
        text, calls = self.chat.choices[0].whole()
        content = [{"type": "text", "text": text or ""}] if text or not calls else []
        content += [self.tool_use(call) for call in calls]
        return self.message(content, result, calls)

    # ---- streamed ----------------------------------------------------------------------------------------------

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    def start_events(self) -> list[str]:
        return [self.event("message_start", message=self.message([], None)), self.event("ping")]

    def _text_events(self, text: str) -> list[str]:
        if not text:
            return []
        out = []
        if not self.text_open:
            self.text_open = True
            out.append(self.event("content_block_start", index=self.blocks, content_block={"type": "text", "text": ""}))
            self.blocks += 1
        out.append(self.event("content_block_delta", index=self.blocks - 1, delta={"type": "text_delta", "text": text}))
        return out

    def delta_events(self, delta: TextDelta) -> list[str]:
        return self._text_events(self.chat.choices[0].release(delta)[0])

    def done_events(self, result: GenerationResult) -> list[str]:
        state = self.chat.choices[0]
        out = self._text_events(state.finish_calls())
        calls = state.tool_calls
        if not calls and not self.text_open:  # an empty answer: one empty text block
            out.append(self.event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
            self.text_open, self.blocks = True, 1
        if self.text_open:
            out.append(self.event("content_block_stop", index=self.blocks - 1))
        for call in calls:
            block = self.tool_use(call)
            out.append(self.event("content_block_start", index=self.blocks, content_block={**block, "input": {}}))
            out.append(
                self.event(
                    "content_block_delta",
                    index=self.blocks,
                    delta={"type": "input_json_delta", "partial_json": call.arguments},
                )
            )
            out.append(self.event("content_block_stop", index=self.blocks))
            self.blocks += 1
        reason, sequence = _stop_reason(result, calls)
        usage_ = self.usage(result)
        out.append(self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage_))
        out.append(self.event("message_stop"))
        return out

    def failed_events(self, error: APIError) -> list[str]:
        body = error_body(error)
        return [self.event("error", error=body["error"])]
