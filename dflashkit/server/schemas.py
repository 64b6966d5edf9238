"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types).

Fields the engine cannot honour (functions, suffix, best_of in chat...) are refused with a 400 naming the
field rather than silently ignored; unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflashkit.decoding.grammar import Grammar
from dflashkit.errors import InvalidInputError
from dflashkit.server.errors import bad_request
from dflashkit.target.logprobs import MAX_TOP_LOGPROBS
from dflashkit.tool_calls import ToolError, ToolRequest

MAX_STOP_STRINGS = 4
MAX_CHOICES = 16  # n: choices per request, generated one after another

Probability = Annotated[float, Field(gt=0, le=1)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool = True  # usage always arrives on the final chunk


class OpenAIRequest(BaseModel):
    """A request body: strict types, unknown fields ignored, `"field": null` the same as leaving it out."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """`"field": null` is the same as leaving the field out (as OpenAI treats it)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class GenerationRequest(OpenAIRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Probability = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # 0 or -1: off (-1 as in vLLM)
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None  # what torch.Generator takes
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # dflashkit extension: every chunk / choice lists its tokens with their text and origin
    token_origins: bool = False
    return_token_ids: bool = False  # vLLM's extension: every chunk / choice carries its token ids ("token_ids")
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1  # choices, generated in turn (sampled: different seeds)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0  # vLLM's extension (1: off)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # {"token id": bias}
    user: str | None = None
    cache_prompt: bool = True  # llama.cpp server's field: false = this request neither reuses nor keeps a prefix
    # dflashkit extension: the sampler of a sampled request (None: the server's --sampler, else coupled with a seed)
    sampler: Literal["rejection", "coupled"] | None = None
    # structured output, vLLM's extension fields (chat also takes OpenAI's response_format); at most one
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None  # a Lark grammar (llguidance's dialect; start rule `start`)

    def check_supported(self) -> None:
        """Refuse options the engine does not implement, naming the field."""
        unsupported = {}
        for name in self._extra_unsupported():
            unsupported[name] = True
        for name, bad in unsupported.items():
            if bad:
                raise bad_request(f"{name} is not supported by this server", param=name, code="unsupported_parameter")

    def _extra_unsupported(self) -> list[str]:
        return []

    def grammar(self) -> Grammar | None:
        """The structured output asked for (None: plain text); a 400 names the field that is wrong."""
        asked = {
            name: getattr(self, name)
            for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if getattr(self, name, None) is not None
        }
        if len(asked) > 1:
            raise bad_request(f"give at most one of {', '.join(asked)}", param=list(asked)[1])
        if not asked:
            return None
        ((name, value),) = asked.items()
        make = {
            "response_format": Grammar.from_response_format,
            "guided_json": Grammar.json_schema,
            "guided_regex": Grammar.regex,
            "guided_choice": Grammar.choice,
            "guided_grammar": Grammar.lark,
        }[name]
        try:
            return make(value)
        except InvalidInputError as e:
            raise bad_request(str(e), param=name) from e

    def token_logit_bias(self) -> dict[int, float]:
        """logit_bias with its keys as token ids; a key that is not one raises a 400."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit():
                raise bad_request(f'logit_bias keys must be token ids (e.g. "50256"), got {key!r}', param="logit_bias")
            out[int(key)] = bias
        return out

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def effective_top_k(self) -> int:
        return max(0, self.top_k)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """Alternatives to list per token (0: only the token's own log-probability); None: no logprobs."""
        return None

    @property
    def candidates(self) -> int:
        """Generations to run: n, or best_of of which the n best are returned (completions)."""
        return self.n


class CompletionRequest(GenerationRequest):
    """/v1/completions: raw text (no chat template) or token ids."""

    # one text, several texts, one token-id prompt, or several (each prompt's choices follow one another)
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]
    )
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt tokens' too)
    suffix: str | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: with echo, the prompt scored, nothing generated
    logprobs: TopLogprobs | None = None  # the legacy API's form: the number of alternatives per token
    top_logprobs: Any = None  # chat's form: refused here, with a pointer to logprobs
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None  # generate these, return the n best

    @property
    def candidates(self) -> int:
        return self.best_of or self.n

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a text or a list of token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens 0 generates nothing: it needs echo (to score the prompt)", param="max_tokens")
        if self.best_of is not None and self.best_of < self.n:
            raise bad_request(f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise bad_request("best_of > n cannot be streamed: the best are known only at the end", param="best_of")
        if self.top_logprobs is not None:
            raise bad_request(
                "top_logprobs is a chat completions parameter: /v1/completions takes logprobs=N "
                f"(0 to {MAX_TOP_LOGPROBS} alternatives per token)",
                param="top_logprobs",
                code="unsupported_parameter",
            )

    def _extra_unsupported(self) -> list[str]:
        return ["suffix"] if self.suffix else []

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back with the tool's answer)."""

    model_config = ConfigDict(strict=True, extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant turn that made tool calls
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call answered

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates expect it (developer → system, text parts joined; an assistant's tool
        calls and a tool answer's call id kept; dflashkit.tool_calls.template_messages does the rest)."""
        text = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


class ChatCompletionRequest(GenerationRequest):
    """/v1/chat/completions: messages through the target's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Any] | None = None  # OpenAI function tools (dflashkit.tool_calls: the <tool_call> convention)
    tool_choice: str | dict[str, Any] | None = None  # none, auto (default), required, or a named function
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # the deprecated form of tools: refused
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (structured output)
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None  # alternatives per token; needs logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        self.check_tool_turns()

    def check_tool_turns(self) -> None:
        """Each tool message answers a call of the assistant message before it (other tool messages may stand
        between them: the answers to its other calls), as OpenAI requires; its tool_call_id, if given, is one of
        that message's call ids (when its calls have ids). A 400 names the message at fault."""
        calls: list[str] | None = None  # the ids of the calls being answered; None: no calls to answer here
        for i, message in enumerate(self.messages):
            if message.role == "assistant":
                calls = [c.id for c in message.tool_calls if c.id is not None] if message.tool_calls else None
            elif message.role != "tool":
                calls = None
            elif calls is None:
                raise bad_request(
                    f"messages[{i}]: a tool message must answer a tool call: it has to follow an assistant message "
                    "with tool_calls (or another tool message answering them)",
                    param="messages",
                )
            elif message.tool_call_id is not None and calls and message.tool_call_id not in calls:
                raise bad_request(
                    f"messages[{i}].tool_call_id {message.tool_call_id!r} matches no call of the assistant message "
                    f"before it (its tool_calls' ids: {', '.join(map(repr, calls))})",
                    param="messages",
                )

    def tool_request(self) -> ToolRequest | None:
        """The request's tools and tool_choice, checked (None: no tools); a 400 names the field at fault."""
        try:
            return ToolRequest.parse(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolError as e:
            raise bad_request(str(e), param=e.field) from e

    def _extra_unsupported(self) -> list[str]:
        return [
            name
            for name, bad in (
                ("functions", bool(self.functions)),
                ("best_of", self.model_extra is not None and self.model_extra.get("best_of") not in (None, 1)),
            )
            if bad
        ]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def chat_request(fields: dict[str, Any], params: dict[str, str]) -> ChatCompletionRequest:
    """The chat request another API's request means (the Responses and Messages APIs); a field it refuses is a
    400 naming the field as that API calls it (`params`: chat name -> its name)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(x) for x in first.get("loc", ())]
        raise bad_request(
            f"{'.'.join(loc)}: {first.get('msg', 'invalid value')}", param=params.get(loc[0], loc[0]) if loc else None
        ) from e
