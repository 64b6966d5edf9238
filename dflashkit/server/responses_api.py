"""OpenAI's Responses API (/v1/responses) over the chat engine.

A Responses request is turned into the chat request it means (instructions → a system turn, input items →
messages, function tools and ``text.format`` → their chat forms, ``previous_response_id`` → the stored
conversation before it), so it is validated, tokenised and generated exactly as /v1/chat/completions would;
only the answer's shape differs: a response object with ``output`` items (an assistant message, function
calls), or, streamed, the typed events ``response.created`` … ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut the answer). Responses are kept in memory (``store``, the default) so that a later
request can continue one with ``previous_response_id`` or fetch it with GET /v1/responses/{id}.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from dflashkit.generator import GenerationResult, TextDelta
from dflashkit.server.errors import APIError, bad_request
from dflashkit.server.responses import ResponseBuilder, usage
from dflashkit.server.schemas import ChatCompletionRequest, OpenAIRequest, Stop, chat_request
from dflashkit.target.logprobs import MAX_TOP_LOGPROBS
from dflashkit.tool_calls import ToolCall

if TYPE_CHECKING:
    from dflashkit.server.plan import Plan

# chat request fields, as the Responses API names them (for the `param` of a 400)
PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "logprobs": "include",
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def renamed(error: APIError) -> APIError:
    """`error` with its param named as in the Responses API (the token limit in its message too)."""
    if error.param in ("max_tokens", "max_completion_tokens"):
        error.message = error.message.replace("max_tokens", "max_output_tokens")
    error.param = PARAMS.get(error.param, error.param) if error.param is not None else None
    return error


class ResponsesRequest(OpenAIRequest):
    """/v1/responses. Unknown fields are ignored; fields the engine cannot honour are refused, naming them."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    stream: bool = False
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[Any] | None = None  # function tools: {"type": "function", "name", "description", "parameters"}
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required, or {"type": "function", "name": ...}
    parallel_tool_calls: bool = True
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" adds each token's log-probability
    store: bool = True  # kept in memory for previous_response_id and GET /v1/responses/{id}
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    reasoning: dict[str, Any] | None = None  # accepted and ignored: these models do not reason apart
    background: bool = False
    user: str | None = None
    # dflashkit extensions, as in the chat endpoint
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    top_k: Annotated[int, Field(ge=-1)] = 0
    stop: Stop = None
    cache_prompt: bool = True
    sampler: Literal["rejection", "coupled"] | None = None

    def check_supported(self) -> None:
        if self.background:
            raise bad_request(
                "background responses are not supported by this server: leave background false",
                param="background",
                code="unsupported_parameter",
            )
        for name in ("conversation", "prompt"):
            if (self.model_extra or {}).get(name) is not None:
                raise bad_request(f"{name} is not supported by this server", param=name, code="unsupported_parameter")

    @property
    def logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])

    def text_format(self) -> dict[str, Any]:
        """``text.format`` as given ({"type": "text"} when absent)."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if not isinstance(fmt, dict):
            raise bad_request(f"text.format must be an object, got {fmt!r:.80}", param="text")
        return fmt

    def as_chat(
        self, history: list[dict[str, Any]], drop: int = 0
    ) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """The chat request this request means, after the conversation `history` (chat messages) less its first
        `drop` messages (truncation), and the messages of its input (to store with its answer)."""
        self.check_supported()
        messages = input_messages(self.input)
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": [*system, *[*history, *messages][drop:]],
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "top_k": self.top_k,
            "cache_prompt": self.cache_prompt,
        }
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "seed": self.seed,
            "stop": self.stop,
            "sampler": self.sampler,
            "tools": chat_tools(self.tools),
            "tool_choice": chat_tool_choice(self.tool_choice),
            "response_format": response_format(self.text_format()),
            "user": self.user,
        }
        chat.update({k: v for k, v in optional.items() if v is not None})
        if self.logprobs:
            chat.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        return chat_request(chat, PARAMS), messages


# ---- request items → chat messages ----------------------------------------------------------------------------


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """The text of a message's content: a string, or parts of the given types (input_text, output_text...)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be text or a list of content parts, got {content!r:.80}", param="input"
        )
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(
                f"{where}.content[{i}] is {kind}: this model reads text only", param="input", code="unsupported_content"
            )
        if kind not in kinds or not isinstance(part.get("text" if kind != "refusal" else "refusal"), str):
            raise bad_request(
                f"{where}.content[{i}] must be one of {', '.join(kinds)} with its text, got {part!r:.80}", param="input"
            )
        texts.append(part["text" if kind != "refusal" else "refusal"])
    return "".join(texts)


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """Chat messages of a Responses ``input``: a text (one user turn) or items: messages (role user, system,
    developer or assistant), ``function_call`` items (an assistant's calls; consecutive ones, and a call right
    after an assistant message, make one assistant turn) and ``function_call_output`` items (tool turns)."""
    if not items:  # "" or []
        raise bad_request("input must not be empty", param="input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object, got {item!r:.80}", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"{where}.role must be user, system, developer or assistant, got {role!r}", param="input"
                )
            kinds = ("output_text", "refusal", "input_text") if role == "assistant" else ("input_text",)
            out.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _text_of(item.get("content"), where, kinds),
                }
            )
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) for v in (name, arguments, call_id)):
                raise bad_request(
                    f"{where}: a function_call item needs name, arguments (JSON text) and call_id", param="input"
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if (
                last is not None
                and last["role"] == "assistant"
                and items[i - 1].get("type", "message") in ("message", "function_call")
            ):
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad_request(f"{where}: a function_call_output item needs the call_id it answers", param="input")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _text_of(output, where, ("input_text", "output_text")),
                }
            )
        elif kind == "item_reference":
            raise bad_request(
                f"{where}: item references are not supported by this server; send the item itself or "
                "continue a stored response with previous_response_id",
                param="input",
                code="unsupported_content",
            )
        else:
            raise bad_request(
                f"{where}: items of type {kind!r} are not supported (message, function_call and "
                "function_call_output are)",
                param="input",
                code="unsupported_content",
            )
    return out


def listed_items(items: str | list[Any]) -> list[dict[str, Any]]:
    """A request's input as GET /v1/responses/{id}/input_items lists it: each item with an id (its own, if it
    had one) and a status, a text as a user message, text content as content parts."""
    out = []
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else items:
        item = {"type": "message", **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(item["type"], "item")
        out.append({"id": _item_id(prefix), "status": "completed", **item})
    return out


def next_turn(conversation: list[dict[str, Any]], start: int) -> int | None:
    """Where the conversation goes on after dropping its earliest turn from `start` (truncation "auto"): the next
    user message after it, so that what is kept begins with a user turn (never an answer or a tool's result
    without the call before it); None when the last user turn is all that is left."""
    return next((i for i in range(start + 1, len(conversation)) if conversation[i]["role"] == "user"), None)


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type": "function", "name", ...}) in the chat form the template is shown."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(
                f"tools[{i}]: only function tools are supported by this server, got type {kind!r}", param="tools"
            )
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format`` (None for plain text)."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt  # json_object; anything else is refused by the grammar with param "text"


# ---- the store ---------------------------------------------------------------------------------------------------

Continuation = tuple[str, list[int], list[int]]  # a turn's prompt text, its prompt ids, its answer's ids


@dataclass
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation up to and including this response's answer (no instructions)
    # the tokens the model saw and wrote: a request that continues this response begins its prompt with them
    # (dflashkit.chat.continued_prompt), so the prefix cache restores the whole turn, not only up to where
    # re-encoding the answer's text would give other tokens
    continuation: Continuation | None = None
    input_items: list[dict[str, Any]] = field(default_factory=list)  # the request's input, listed (listed_items)
    owner: str = ""  # the tenant that stored it (the server's id of its API key; "" without keys): only it sees it


class ResponseStore:
    """The last `capacity` stored responses, in memory (lost when the server stops), each seen only by its owner.

    The capacity and its least-recently-used order are shared by all owners. To any other owner a stored response
    does not exist: it is answered with the same 404 as an id never stored, so an id tells nothing about another
    client's responses.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[stored.response["id"]] = stored
        self._items.move_to_end(stored.response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None, owner: str = "") -> StoredResponse:
        """The response stored as ``response_id`` by ``owner``; a 404 APIError when there is none (whether no
        response has that id or another owner's has)."""
        stored = self._items.get(response_id)
        if stored is None or stored.owner != owner:
            raise APIError(
                404,
                f"No response with id {response_id!r} is stored here (this server keeps the last "
                f"{self.capacity} responses made with store true, in memory)",
                param=param,
                type="not_found_error",
                code="response_not_found",
            )
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str, owner: str = "") -> None:
        self.get(response_id, owner=owner)
        del self._items[response_id]

    def input_items(
        self, response_id: str, after: str | None = None, limit: int = 20, order: str = "desc", owner: str = ""
    ) -> dict[str, Any]:
        """GET /v1/responses/{id}/input_items: the response's input items, a page of them (OpenAI's list shape)."""
        if not 1 <= limit <= 100:
            raise bad_request(f"limit must be in 1..100, got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be asc or desc, got {order!r}", param="order")
        items = self.get(response_id, owner=owner).input_items
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"after names no input item of this response: {after!r}", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }


# ---- the answer ----------------------------------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesBuilder:
    """One response: the whole object at the end, or the stream of its events."""

    def __init__(
        self, plan: Plan, body: ResponsesRequest, model_id: str, token_bytes: Callable[[int], bytes] | None = None
    ) -> None:
        self.body = body
        self.chat = ResponseBuilder(plan, model_id, token_bytes)  # text pieces, logprob entries, usage
        self.id = _item_id("resp")
        self.created_at = int(time.time())
        self.model = model_id
        self.sequence = 0
        self.message_id = _item_id("msg")
        self.message_open = False
        self.text: list[str] = []  # the message's text as streamed
        self.entries: list[dict[str, Any]] = []  # logprob entries of the streamed text
        self.pending: list[dict[str, Any]] = []  # logprob entries whose text is still held back
        self.final: dict[str, Any] = {}  # streamed: the response the last event carries

    def envelope(
        self,
        status: str,
        output: list[dict[str, Any]],
        result: GenerationResult | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        b = self.body
        incomplete = result is not None and result.finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": b.store,
            "temperature": b.temperature,
            "text": {"format": b.text_format()},
            "tool_choice": self._tool_choice(),
            "tools": b.tools or [],
            "top_p": b.top_p,
            "top_logprobs": b.top_logprobs,
            "truncation": b.truncation,
            "user": b.user,
            "metadata": b.metadata or {},
            "usage": self.usage(result) if result is not None else None,
        }

    def _tool_choice(self) -> str | dict[str, Any]:
        choice = self.body.tool_choice
        return choice if choice is not None else "auto"

    def usage(self, result: GenerationResult) -> dict[str, Any]:
        chat = usage(result.stats, self.chat.prompt_tokens, len(result.token_ids), result.stats.cached_prompt_tokens)
        return {
            "input_tokens": chat["prompt_tokens"],
            "input_tokens_details": chat["prompt_tokens_details"],
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"],
            "speculative": chat["speculative"],
        }

    def message(self, text: str, entries: list[dict[str, Any]], status: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self.body.logprobs:
            part["logprobs"] = entries
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": [part]}

    @staticmethod
    def function_call(call: ToolCall, status: str = "completed") -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": _item_id("fc"),
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": status,
        }

    def output(
        self, text: str | None, calls: list[ToolCall], entries: list[dict[str, Any]], result: GenerationResult
    ) -> list[dict[str, Any]]:
        """A message when there is text (or no call), then the calls."""
        items = []
        if text or not calls:
            items.append(
                self.message(text or "", entries, "incomplete" if result.finish_reason == "length" else "completed")
            )
        items.extend(self.function_call(call) for call in calls)
        return items

    @staticmethod
    def status(result: GenerationResult) -> str:
        return "incomplete" if result.finish_reason == "length" else "completed"

    # ---- whole -----------------------------------------------------------------------------------------------

    def add(self, delta: TextDelta) -> None:
        self.chat.add(delta)

    def complete(self, result: GenerationResult) -> dict[str, Any]:
        state = self.chat.choices[0]
        text, calls = state.whole()
        self.final = self.envelope(self.status(result), self.output(text, calls, state.logprob_entries, result), result)
        return self.final

    # ---- streamed ----------------------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def start_events(self) -> list[str]:
        snapshot = self.envelope("in_progress", [])
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def _open_message(self) -> list[str]:
        if self.message_open:
            return []
        self.message_open = True
        item = {"type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        if self.body.logprobs:
            part["logprobs"] = []
        return [
            self.event("response.output_item.added", output_index=0, item=item),
            self.event(
                "response.content_part.added", item_id=self.message_id, output_index=0, content_index=0, part=part
            ),
        ]

    def _text_events(self, text: str) -> list[str]:
        """A text delta of the message (opened first if need be), with the logprob entries held for it."""
        if not text and not self.pending:
            return []
        out = self._open_message()
        self.text.append(text)
        entries, self.pending = self.pending, []
        self.entries.extend(entries)
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=entries,
            )
        )
        return out

    def delta_events(self, delta: TextDelta) -> list[str]:
        text, entries = self.chat.choices[0].release(delta)
        self.pending.extend(entries)
        return self._text_events(text) if text or self.chat.tool_names is None else []

    def done_events(self, result: GenerationResult) -> list[str]:
        """The events that end the stream (the response they end with: :attr:`final`)."""
        state = self.chat.choices[0]
        rest = state.finish_calls()
        calls = state.tool_calls
        if calls:
            self.pending = []  # the held text was calls: no message text carries those tokens
        out = self._text_events(rest)
        if not calls:
            out += self._open_message()
        items = []
        if self.message_open:
            text = "".join(self.text)
            message = self.message(text, self.entries, self.status(result))
            done = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            out.append(self.event("response.output_text.done", **done, text=text, logprobs=self.entries))
            out.append(self.event("response.content_part.done", **done, part=message["content"][0]))
            out.append(self.event("response.output_item.done", output_index=0, item=message))
            items.append(message)
        for call in calls:
            index = len(items)
            item = self.function_call(call)
            out.append(
                self.event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"},
                )
            )
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=call.arguments,
                )
            )
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            out.append(self.event("response.output_item.done", output_index=index, item=item))
            items.append(item)
        self.final = response = self.envelope(self.status(result), items, result)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        out.append(self.event(kind, response=response))
        return out

    def failed_events(self, error: APIError) -> list[str]:
        """An error mid-stream: the error event, then the response failed."""
        return [
            self.event("error", code=error.code or error.type, message=error.message, param=error.param),
            self.event(
                "response.failed",
                response=self.envelope(
                    "failed", [], error={"code": error.code or error.type, "message": error.message}
                ),
            ),
        ]


def stored_messages(
    input_messages_: list[dict[str, Any]], history: list[dict[str, Any]], response: dict[str, Any]
) -> list[dict[str, Any]]:
    """The conversation after `response`: the history, the request's input, then the answer as chat messages."""
    answer: dict[str, Any] | None = None
    for item in response["output"]:
        if item["type"] == "message":
            answer = {"role": "assistant", "content": "".join(p["text"] for p in item["content"])}
        else:
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if answer is None:
                answer = {"role": "assistant", "content": None}
            answer.setdefault("tool_calls", []).append(call)
    return [*history, *input_messages_, *([answer] if answer is not None else [])]
