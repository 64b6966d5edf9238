"""OpenAI response objects for one request: streamed chunks (SSE) or the whole response, with usage."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dflashkit.decoding.stats import DecodeStats
from dflashkit.generator import GenerationResult, TextDelta
from dflashkit.server.plan import Echo
from dflashkit.target.logprobs import TokenLogprob
from dflashkit.tool_calls import ToolCall, ToolCallStream, parse_tool_calls

if TYPE_CHECKING:
    from dflashkit.server.plan import Plan


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(stats: DecodeStats, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI usage (with ``prompt_tokens_details.cached_tokens``: prompt tokens restored from the prefix cache)
    plus `speculative`: τ (mean tokens per draft-and-verify step; null when no step ran), steps, drafted and
    accepted tokens in all and per block position, and the sampler of a sampled request."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "speculative": {
            "mean_acceptance_length": stats.tau if stats.steps else None,
            "drafting_steps": stats.steps,
            "draft_tokens": sum(stats.drafted_lengths),
            "accepted_tokens": sum(stats.accepted_lengths),
            "accepted_per_position": stats.accepted_per_position,
            "drafted_per_position": stats.drafted_per_position,
            "block_size": stats.block_size,
            "adaptive_block_size": stats.adaptive,
            "tokens_per_s": stats.tokens_per_s,
            "tree": stats.tree_summary() if stats.tree else None,
            "sampler": stats.sampler,  # "coupled" / "rejection" when sampled (null: greedy)
        },
    }


class ChoiceBuilder:
    """One choice's content: its text, token origins and logprobs as they stream in."""

    def __init__(self, builder: ResponseBuilder, index: int, echo: Echo | None = None) -> None:
        self.builder, self.index, self.echo = builder, index, echo
        self.text: list[str] = []
        self.tokens: list[dict[str, Any]] = []  # token_origins
        self.logprob_entries: list[dict[str, Any]] = []  # chat's format; completions add text_offset
        self.text_offset = 0  # completions: characters released before the next token
        self.echoed = echo is None  # completions with echo: the prompt goes before the first delta
        tools = builder.tool_names
        self.tool_stream = ToolCallStream(tools) if tools is not None and builder.streaming else None
        self.tool_calls: list[ToolCall] = []  # streamed: the calls found when the answer ended

    def add(self, delta: TextDelta) -> None:
        text, entries = self.piece(delta)
        self.text.append(text)
        if self.builder.origins:
            self.tokens.extend(_origins(delta))
        self.logprob_entries.extend(entries)

    def release(self, delta: TextDelta) -> tuple[str, list[dict[str, Any]]]:
        """Streamed: the text `delta` releases now (with tools, what may begin a call is held back until the answer
        ends) and its logprob entries."""
        text, entries = self.piece(delta)
        if self.tool_stream is not None:
            text = self.tool_stream.feed(text)
        return text, entries

    def finish_calls(self) -> str:
        """Streamed, when the answer ends: the held-back text still to release (its calls: ``tool_calls``)."""
        if self.tool_stream is None:
            return ""
        rest, self.tool_calls = self.tool_stream.finish()
        return rest

    def whole(self) -> tuple[str | None, list[ToolCall]]:
        """Not streamed: the answer's content (None: calls only) and its tool calls."""
        text = "".join(self.text)
        tools = self.builder.tool_names
        return parse_tool_calls(text, tools) if tools is not None else (text, [])

    def piece(self, delta: TextDelta) -> tuple[str, list[dict[str, Any]]]:
        """The text and logprob entries `delta` adds (the echoed prompt first, on the first delta)."""
        text, entries = delta.text, []
        if not self.echoed:
            self.echoed = True
            echo = self.echo
            assert echo is not None
            text = echo.text + text
            if self.builder.logprobs:
                entries = self._prompt_entries(echo, delta.prompt_logprobs or [])
            self.text_offset = len(echo.text)
        if self.builder.logprobs:
            entries += self.logprob_entries_of(delta)
        return text, entries

    def _prompt_entries(self, echo: Echo, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
        """The prompt's tokens, the first with no log-probability (nothing comes before it)."""
        offsets = [sum(len(p) for p in echo.pieces[:i]) for i in range(len(echo.pieces))]
        first = self.builder.token_entry(echo.token_ids[0], None)
        first.update(top_logprobs=None, text_offset=offsets[0])
        entries = [first]
        for lp, offset in zip(logprobs, offsets[1:]):
            entry = self.builder.token_entry(lp.token_id, lp.logprob)
            entry.update(top_logprobs=[self.builder.token_entry(t, v) for t, v in lp.top], text_offset=offset)
            entries.append(entry)
        return entries

    def logprob_entries_of(self, delta: TextDelta) -> list[dict[str, Any]]:
        """One entry per token of `delta`: {token, logprob, bytes, top_logprobs} (+ text_offset for completions)."""
        texts = delta.token_text or [delta.text] + [""] * (len(delta.token_ids) - 1)
        entries = []
        for lp, released in zip(delta.logprobs or [], texts):
            entry = self.builder.token_entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self.builder.token_entry(t, v) for t, v in lp.top]
            if not self.builder.chat:
                entry["text_offset"] = self.text_offset
                self.text_offset += len(released)
            entries.append(entry)
        return entries


def _finish_reason(result: GenerationResult, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended (not cut by max_tokens) with tool calls."""
    return "tool_calls" if called and result.finish_reason == "stop" else result.finish_reason


def _origins(delta: TextDelta) -> list[dict[str, Any]]:
    """The token_origins extension: each token's id, the text it released, and where it came from: ``origin`` is
    "drafter" (an accepted DFlash draft), "copy" (an accepted prompt-lookup copy) or "target" (the target's own
    token); ``from_draft`` (drafter or copy) is kept for clients written before ``origin``."""
    texts = delta.token_text or [delta.text] + [""] * (len(delta.token_ids) - 1)
    origins = delta.origins or ["drafter" if f else "target" for f in delta.from_draft]
    return [
        {"id": t, "text": s, "from_draft": f, "origin": o}
        for t, s, f, o in zip(delta.token_ids, texts, delta.from_draft, origins)
    ]


class ResponseBuilder:
    """Builds one request's OpenAI objects: chunks while streaming, or the full response at the end; one choice
    per generation of the plan (prompt p's choice i has index p * candidates + i), generated in turn."""

    def __init__(self, plan: Plan, model_id: str, token_bytes: Callable[[int], bytes] | None = None) -> None:
        """`token_bytes`: a token id's bytes (needed when the request asks for logprobs)."""
        self.chat = plan.chat
        self.streaming = plan.body.stream
        # chat with tools (not "none"): the names of the tools whose calls are parsed out of the answers
        self.tool_names = plan.tools.names if plan.tools is not None and plan.tools.active else None
        self.origins = plan.body.token_origins
        self.token_ids = plan.body.return_token_ids
        self.logprobs = plan.body.requested_logprobs() is not None
        self.token_bytes = token_bytes
        self.prompt_tokens = sum(len(ids) for ids in plan.prompts)  # each prompt once
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_id
        per_prompt = self.per_prompt = plan.body.candidates
        self.choices = [
            ChoiceBuilder(self, i, plan.echoes[i // per_prompt] if plan.echoes else None)
            for i in range(plan.generations)
        ]

    def token_entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        assert self.token_bytes is not None
        raw = self.token_bytes(token_id)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs_object(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Chat's {"content": [...]}, or the legacy completions {"tokens", "token_logprobs", ...}."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                for e in entries
            ],
            "text_offset": [e["text_offset"] for e in entries],
        }

    def _chunk_choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[ToolCall] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [call.as_openai(i) for i, call in enumerate(tool_calls)]
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}

    # ---- streaming -----------------------------------------------------------------------------------------

    def first_chunk(self, index: int = 0) -> dict[str, Any]:
        """Chat streams open each choice with the assistant role; completions with an empty text."""
        return self._envelope([self._chunk_choice(index, None if self.chat else "", None, role=True)], chunk=True)

    def chunk(self, delta: TextDelta, index: int = 0) -> dict[str, Any]:
        text, entries = self.choices[index].release(delta)
        choice = self._chunk_choice(index, text, None, logprobs=self._logprobs_object(entries))
        if self.origins:
            choice["token_origins"] = _origins(delta)
        if self.token_ids:
            choice["token_ids"] = list(delta.token_ids)
        return self._envelope([choice], chunk=True)

    def tool_chunks(self, index: int = 0) -> list[dict[str, Any]]:
        """When a choice with tools ends: the text held back as content (if not calls), then its tool calls."""
        state = self.choices[index]
        rest = state.finish_calls()
        out = []
        if rest:
            out.append(self._envelope([self._chunk_choice(index, rest, None)], chunk=True))
        if state.tool_calls:
            out.append(self._envelope([self._chunk_choice(index, None, None, tool_calls=state.tool_calls)], chunk=True))
        return out

    def final_chunk(
        self, result: GenerationResult, index: int = 0, results: list[GenerationResult] | None = None
    ) -> dict[str, Any]:
        """A choice's finish_reason; with `results` (all the choices', on the last one) the request's usage."""
        reason = _finish_reason(result, bool(self.choices[index].tool_calls))
        out = self._envelope([self._chunk_choice(index, None if self.chat else "", reason)], chunk=True)
        if results is not None:
            out["usage"] = self.usage_of(results)
        return out

    # ---- whole responses -----------------------------------------------------------------------------------

    def add(self, delta: TextDelta, index: int = 0) -> None:
        self.choices[index].add(delta)

    def usage_of(self, results: list[GenerationResult]) -> dict[str, Any]:
        """The request's usage: the prompt once (its cached tokens as its first choice found them), every choice's
        tokens and draft steps."""
        stats = results[0].stats if len(results) == 1 else DecodeStats.combined([r.stats for r in results])
        cached = sum(r.stats.cached_prompt_tokens for r in results[:: self.per_prompt])
        return usage(stats, self.prompt_tokens, sum(len(r.token_ids) for r in results), cached)

    def complete(self, results: list[GenerationResult], keep: list[int] | None = None) -> dict[str, Any]:
        """The whole response: the choices `keep` names (indices of the generations, in the order returned;
        None: all), numbered 0.. in that order; usage covers every generation run."""
        choices = []
        for index, i in enumerate(keep if keep is not None else range(len(results))):
            state, result = self.choices[i], results[i]
            logprobs = self._logprobs_object(state.logprob_entries)
            if self.chat:
                content, calls = state.whole()
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = [call.as_openai() for call in calls]
                choice = {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": _finish_reason(result, bool(calls)),
                }
            else:
                choice = {
                    "index": index,
                    "text": "".join(state.text),
                    "logprobs": logprobs,
                    "finish_reason": result.finish_reason,
                }
            if self.origins:
                choice["token_origins"] = state.tokens
            if self.token_ids:  # the generated ids, a final stop token included (as vLLM gives them)
                choice["token_ids"] = list(result.token_ids)
            choices.append(choice)
        out = self._envelope(choices, chunk=False)
        out["usage"] = self.usage_of(results)
        return out
