"""Tool calling (OpenAI ``tools``) in the ``<tool_call>`` convention of the Qwen2.5 / Qwen3 / Hermes chat templates.

The chat template shows the model its tools (``apply_chat_template(..., tools=...)``) and the model calls one by
writing ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (a block per call, several for parallel
calls): :func:`parse_tool_calls` takes those blocks out of the text as :class:`ToolCall` objects, and
:class:`ToolCallStream` does it on streamed text (content before a call is released at once, a call when the
generation ends). With ``tool_choice`` ``"required"`` or a named function, :meth:`ToolRequest.grammar` constrains the
output (:mod:`dflashkit.decoding.grammar`) to well-formed calls of those tools whose arguments are valid under each
tool's
``parameters`` schema: the output is then exactly the target's, constrained to that grammar. Templates that do not
use this convention (e.g. SmolLM2's, which has no tools at all) are refused by :func:`check_template`, rather than
tools being silently dropped.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dflashkit.decoding.grammar import JSON_WHITESPACE, Grammar
from dflashkit.errors import InvalidInputError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


class ToolError(InvalidInputError):
    """A malformed ``tools`` / ``tool_choice``, or tools for a template that cannot take them; ``field`` names
    the request field at fault."""

    def __init__(self, message: str, field: str = "tools") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object (no arguments: an empty object)
    spec: dict[str, Any]  # the tool as the request wrote it: what the chat template is shown


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools and what it asks of them: ``choice`` "none" (tools neither shown nor parsed), "auto"
    (the model decides; calls are parsed out), "required" (at least one call) or "function" (a call of
    ``function``)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True  # several calls in one answer

    @classmethod
    def parse(cls, tools: Any, tool_choice: Any = None, parallel_tool_calls: bool = True) -> ToolRequest | None:
        """Check OpenAI ``tools`` / ``tool_choice``; None when there are no tools (and no tool_choice but "none")."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise ToolError("tool_choice needs tools", field="tool_choice")
            return None
        if not isinstance(tools, list):
            raise ToolError(f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, got {tools!r:.80}")
        parsed = tuple(_parse_tool(t, i) for i, t in enumerate(tools))
        names = [t.name for t in parsed]
        if len(set(names)) != len(names):
            raise ToolError(f"tool names must be distinct, got {names}")
        choice, function = _parse_choice(tool_choice, names)
        return cls(parsed, choice, function, bool(parallel_tool_calls))

    @property
    def active(self) -> bool:
        """Whether the template sees the tools and the output is parsed for calls."""
        return self.choice != "none"

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tools]

    @property
    def forced(self) -> bool:
        """Whether the answer must be calls ("required" or a named function): see :meth:`grammar`."""
        return self.choice in ("required", "function")

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [copy.deepcopy(t.spec) for t in self.tools] if self.active else None

    def grammar(self, markers: Mapping[str, str] | None = None) -> Grammar | None:
        """For "required" or a named function: the output is one call (or, with ``parallel``, one or more calls
        of any of the tools), each ``<tool_call>\\n{json}\\n</tool_call>`` with valid arguments. ``markers``: the
        Lark terms of the two tags for a tokenizer that has them as single tokens (:func:`marker_terms`);
        by default their text."""
        if not self.forced:
            return None
        terms = {OPEN: json.dumps(OPEN), CLOSE: json.dumps(CLOSE), **(markers or {})}
        tools = [t for t in self.tools if self.choice == "required" or t.name == self.function]
        rules = [f"tool{i}: %json {json.dumps(_call_schema(t))}" for i, t in enumerate(tools)]
        alternatives = " | ".join(f"tool{i}" for i in range(len(tools)))
        call = f'call: {terms[OPEN]} "\\n" ({alternatives}) "\\n" {terms[CLOSE]}'
        start = 'start: call ("\\n" call)*' if self.parallel and self.choice == "required" else "start: call"
        return Grammar.lark("\n".join([start, call, *rules]))


def _parse_tool(tool: Any, index: int) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    if not isinstance(fn.get("description", ""), str):
        raise ToolError(f"{where}.function.description must be text")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema object")
    return Tool(name, parameters, tool)


def _parse_choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    malformed = ToolError(
        f"tool_choice must be one of {', '.join(CHOICES)} or {{'type': 'function', 'function': "
        f"{{'name': ...}}}}, got {tool_choice!r:.80}",
        field="tool_choice",
    )
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise malformed
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise malformed
    if name not in names:
        raise ToolError(
            f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})", field="tool_choice"
        )
    return "function", name


def _call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of one call's object; the parameters' definitions move to its root, where their
    ``#/$defs/...`` references point."""
    parameters = copy.deepcopy(tool.parameters)
    hoisted = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_pattern": JSON_WHITESPACE},
        **hoisted,
    }


def marker_terms(tokenizer: Any, llg_tokenizer: Any) -> dict[str, str]:
    """The Lark terms of ``<tool_call>`` / ``</tool_call>`` for a grammar over this tokenizer: where a tag is one
    token that llguidance reads as special (Qwen's added tokens 151657 / 151658), that token (``<[id]>``: the
    text would have to be spelled in pieces the model never writes); elsewhere the text."""
    out = {}
    for tag in (OPEN, CLOSE):
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) == 1 and llg_tokenizer.is_special_token(ids[0]):
            out[tag] = f"<[{ids[0]}]>"
    return out


def check_template(tokenizer: Any) -> None:
    """Raise ToolError unless the tokenizer's chat template shows tools and writes calls as ``<tool_call>``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the one for tools, else the default
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or "tools" not in template:
        raise ToolError("this model's chat template has no tools: it cannot be offered functions to call")
    if OPEN not in template:
        raise ToolError(
            f"this model's chat template writes tool calls in a convention dflashkit does not parse "
            f"(it parses {OPEN}...{CLOSE}, as in Qwen2.5, Qwen3 and Hermes templates)"
        )


def template_messages(messages: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as chat templates take them: an assistant's tool call arguments as objects (OpenAI
    sends JSON text, templates print ``arguments | tojson``), the null content of a turn with tool calls as
    empty text (other messages are left as they are, to be checked by the caller)."""
    out = []
    for message in messages:
        m = dict(message)
        if m.get("content") is None and m.get("tool_calls"):
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError:
                        pass  # kept as text: the template prints what it was given
                calls.append({**call, "function": function})
            m["tool_calls"] = calls
        out.append(m)
    return out


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


BARE_KEYS = frozenset({"name", "arguments", "parameters"})  # all a bare (untagged) call may have at its top


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({key for key, _ in pairs}) != len(pairs):
        raise ValueError("duplicate key")
    return dict(pairs)


def _call_of(body: str, names: Sequence[str], bare: bool = False) -> ToolCall | None:
    """The call a JSON text writes, or None. ``bare`` (an answer without tags): stricter, so that a stream can tell
    early that a JSON answer is no call (:func:`_no_bare_call`): only the keys of BARE_KEYS, each once."""
    try:
        obj = json.loads(body, object_pairs_hook=_unique_keys if bare else None)
    except ValueError:  # not JSON (json.JSONDecodeError), or a key twice in a bare call
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names or (bare and not set(obj) <= BARE_KEYS):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False), _new_id())


def parse_tool_calls(text: str, names: Sequence[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a generated answer: the ``<tool_call>`` blocks (the last may lack its closing tag,
    when the generation ended there) as calls, the rest as content (None when only whitespace). If a closed block
    is not a JSON call of a known tool, the whole text is content and there are no calls; an unclosed last block
    that is not one (an answer cut by max_tokens in the middle of a call) stays content. An answer that is nothing
    but one bare JSON call of a known tool is a call too: small models drop the tags (Qwen2.5-Coder-0.5B-Instruct
    answered a weather question with ``{"name": "get_weather", "arguments": {...}}`` alone)."""
    if OPEN not in text:
        bare = text.strip()
        call = _call_of(bare, names, bare=True) if bare.startswith("{") and bare.endswith("}") else None
        return (None, [call]) if call is not None else (text, [])
    calls, pieces, end = [], [], 0
    for match in _BLOCK.finditer(text):
        call = _call_of(match.group(1).strip(), names)
        if call is None:
            if calls and not match.group(0).endswith(CLOSE):  # cut short: the calls before it stand
                break
            return text, []
        calls.append(call)
        pieces.append(text[end : match.start()])
        end = match.end()
    if not calls:
        return text, []
    content = "".join(pieces) + text[end:]
    return (content.strip() or None), calls


def _no_bare_call(text: str, names: Sequence[str]) -> bool:
    """True when ``text`` (an answer so far that begins with ``{``) can no longer become a bare call however it goes
    on, as :func:`parse_tool_calls` reads one: its top-level object has closed and more follows, or has a key other
    than those of BARE_KEYS, or a ``"name"`` that is no tool's. Scans strings and brackets only: a text that is not
    JSON at all is found out when the answer ends."""
    depth, i, n = 0, len(text) - len(text.lstrip()), len(text)
    key: str | None = None  # the top-level key whose value comes next
    while i < n:
        c = text[i]
        if c == '"':
            try:
                value, end = json.decoder.scanstring(text, i + 1)
            except ValueError:  # the string has not ended yet
                return False
            if depth == 1 and key is None:  # a top-level key (the scan is past its ':' only for values)
                rest = text[end:].lstrip()
                if rest.startswith(":"):
                    if value not in BARE_KEYS:
                        return True
                    key = value
            elif depth == 1 and key == "name" and value not in names:
                return True
            i = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return bool(text[i + 1 :].strip())
        elif c == "," and depth == 1:
            key = None
        elif depth == 1 and key == "name" and not c.isspace() and c != ":":
            return True  # a name that is not a string
        i += 1
    return False


class ToolCallStream:
    """Streamed text in, content to release now out; the calls at :meth:`finish`. Text that may begin a
    ``<tool_call>`` is held back until it is known not to; from a ``<tool_call>`` on, everything is held. An answer
    that begins with ``{`` is held while it may still be a bare JSON call (a JSON answer that is none, e.g. under
    ``response_format``, streams once its first key or its name shows it)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self._pending = ""  # a possible start of OPEN (or the leading whitespace), not yet released
        self._held: str | None = None  # from the first OPEN on
        self._bare: str | None = None  # an answer that begins with "{", while it may be a bare call
        self._begun = False  # a non-whitespace character has come

    def feed(self, text: str) -> str:
        if self._held is not None:
            self._held += text
            return ""
        if self._bare is not None:
            self._bare += text
            if OPEN not in self._bare and not _no_bare_call(self._bare, self.names):
                return ""
            text, self._bare = self._bare, None  # no bare call: streamed as any answer from here
        else:
            text = self._pending + text
        if not self._begun:
            if not text.strip():
                self._pending = text
                return ""
            self._begun = True
            if text.lstrip().startswith("{"):
                self._pending, self._bare = "", ""
                return self.feed(text)
        at = text.find(OPEN)
        if at >= 0:
            self._pending, self._held = "", text[at:]
            return text[:at]
        keep = next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-k:])), 0)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still to release, calls): the held text is content when it holds no valid calls."""
        rest, self._pending = self._pending, ""
        if self._bare is not None:
            rest, self._held, self._bare = "", self._bare, None
        if self._held is None:
            return rest, []
        held, self._held = self._held, None
        content, calls = parse_tool_calls(held, self.names)
        if not calls:
            return rest + held, []
        return rest + (content or ""), calls
