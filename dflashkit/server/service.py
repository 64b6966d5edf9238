"""The service behind the HTTP app: one generator, its scheduler, the prefix cache, the stored responses."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dflashkit.chat import completed_turn, continued_prompt
from dflashkit.decoding.batching import BatchMember
from dflashkit.decoding.defaults import default_block_size
from dflashkit.decoding.grammar import CompiledGrammar, Grammar
from dflashkit.decoding.options import check_draft_window
from dflashkit.decoding.penalties import Penalties
from dflashkit.decoding.prefix_cache import PrefixCache
from dflashkit.decoding.sampling import SamplingParams, check_sampler
from dflashkit.decoding.tree import check_tree_option
from dflashkit.drafter.config import check_proposal_temperature
from dflashkit.errors import InvalidInputError
from dflashkit.generator import GenerationResult, GenerationStream, SpeculativeGenerator, TextDelta
from dflashkit.server import messages_api
from dflashkit.server.errors import APIError, bad_request, from_exception
from dflashkit.server.plan import Echo, Plan
from dflashkit.server.responses import ResponseBuilder, sse_event
from dflashkit.server.responses_api import (
    Continuation,
    ResponsesBuilder,
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
    listed_items,
    next_turn,
    renamed,
    stored_messages,
)
from dflashkit.server.scheduler import Delta, Done, Event, Failed, Job, QueueFullError, Scheduler, ServerShuttingDown
from dflashkit.server.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest
from dflashkit.text import IncrementalDetokenizer, render_chat
from dflashkit.tool_calls import ToolError, ToolRequest, template_messages

DISCONNECT_POLL_S = 0.1
_WHITESPACE = re.compile(r"\s+")
SSE_DONE = "data: [DONE]\n\n"  # the last event of every chat and completions stream


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


MAX_BATCH = 16  # generations running at once, at most


@dataclass
class ServerSettings:
    """How the server serves; invalid values raise InvalidInputError."""

    model_id: str | None = None  # the name clients send; None: the target's name or path
    max_queue: int = 16  # requests that may wait while max_batch run; more are answered 429
    max_batch: int = 4  # generations that run at once, their target passes batched (dflashkit.decoding.batching)
    timeout: float | None = 600.0  # seconds from arrival to the last token; None: no limit
    default_max_tokens: int = 256  # when a request gives none (capped by the context)
    block_size: int | str | None = None  # verify block size ("auto": adaptive; None: "auto", with `tree` the drafter's)
    proposal: str = "sample"  # how drafts are proposed when sampling ("sample" or "argmax"; both exact)
    proposal_temperature: float | None = None  # drafts drawn at this multiple of the temperature (None: the drafter's)
    sampler: str | None = (
        None  # "rejection" / "coupled" (None: coupled for requests with a seed; dflashkit.decoding.sampling)
    )
    lookup: bool | None = None  # prompt lookup: copy a repeated n-gram's continuation (None: generator.uses_lookup())
    tree: int | None = None  # drafter steps verify token trees of up to this many nodes (None: the default; 0: chains)
    draft_window: int | None = None  # drafting attends to the last N context tokens (None: the drafter's own; 0: all)
    prefix_cache_mb: float = 256.0  # finished generations kept for prompts that begin the same way (0: none)
    stored_responses: int = 256  # /v1/responses kept in memory for previous_response_id (0: none)
    api_key: str | list[str] | None = None  # one key or several: /v1/* then needs "Authorization: Bearer KEY"
    clamp_max_tokens: bool = False  # a max_tokens past the context is lowered to what fits instead of refused
    allowed_origins: list[str] = field(default_factory=list)  # browser origins allowed cross-origin calls (CORS)
    shutdown_timeout: float = 30.0  # seconds running generations may go on after a shutdown begins (lifecycle)
    max_body_bytes: int = 4 * 2**20  # a larger request body is refused (413) before it is read
    allowed_hosts: list[str] | None = None  # Host header names served (None: loopback names only; ["*"]: any)
    header_timeout: float = 10.0  # seconds a request's line and headers may take to arrive (dflashkit.server.http)
    body_timeout: float = 30.0  # seconds a request's body may take to arrive, from its headers' arrival
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise InvalidInputError(f"max_queue must be >= 0, got {self.max_queue}")
        if not isinstance(self.max_batch, int) or not 1 <= self.max_batch <= MAX_BATCH:
            raise InvalidInputError(f"max_batch must be an integer in 1..{MAX_BATCH}, got {self.max_batch!r}")
        if self.timeout is not None and not self.timeout > 0:
            raise InvalidInputError(f"timeout must be positive, got {self.timeout}")
        if not 0 < self.shutdown_timeout < float("inf"):
            raise InvalidInputError(f"shutdown_timeout must be positive seconds, got {self.shutdown_timeout}")
        if self.default_max_tokens < 1:
            raise InvalidInputError(f"default_max_tokens must be at least 1, got {self.default_max_tokens}")
        if self.proposal not in ("argmax", "sample"):
            raise InvalidInputError(f"proposal must be 'argmax' or 'sample', got {self.proposal!r}")
        if self.proposal_temperature is not None:
            check_proposal_temperature(self.proposal_temperature)
        check_tree_option(self.tree)
        if self.sampler is not None:
            check_sampler(self.sampler)
        check_draft_window(self.draft_window)
        PrefixCache.of_mib(self.prefix_cache_mb)  # checks the size
        self._check_access()
        if not isinstance(self.stored_responses, int) or self.stored_responses < 0:
            raise InvalidInputError(f"stored_responses must be an integer >= 0, got {self.stored_responses!r}")
        if (
            self.block_size is not None
            and self.block_size != "auto"
            and (not isinstance(self.block_size, int) or self.block_size < 2)
        ):
            raise InvalidInputError(f"block_size must be an integer >= 2 or 'auto', got {self.block_size!r}")

    @property
    def api_keys(self) -> list[str]:
        """The keys a /v1/* request may carry (none: the API is open)."""
        return [] if self.api_key is None else [self.api_key] if isinstance(self.api_key, str) else list(self.api_key)

    def _check_access(self) -> None:
        """The API keys, the allowed hosts and the request limits (dflashkit.server.guards, dflashkit.server.http)."""
        if isinstance(self.api_key, list) and not self.api_key:
            raise InvalidInputError("api_key must be a key or a non-empty list of keys")
        for key in self.api_keys:
            if not isinstance(key, str) or not key or key != key.strip():
                raise InvalidInputError("api_key must be non-empty text without surrounding spaces")
        if self.allowed_hosts is not None:
            if not self.allowed_hosts:
                raise InvalidInputError("allowed_hosts must name at least one host ('*' for any; None: loopback)")
            for host in self.allowed_hosts:
                if not isinstance(host, str) or not host or any(c.isspace() or c in "/@" for c in host):
                    raise InvalidInputError(f"allowed_hosts: {host!r} is not a host name")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise InvalidInputError(f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}")
        for name in ("header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidInputError(f"{name} must be positive, got {getattr(self, name)}")


def _best(results: list[GenerationResult], n: int) -> list[int]:
    """The indices of the n results of highest mean log-probability per token, best first (all of them, in
    order, when there are only n)."""
    if len(results) == n:
        return list(range(n))

    def score(i: int) -> float:
        lps = results[i].logprobs or []
        return sum(lp.logprob for lp in lps) / max(1, len(lps))

    return sorted(range(len(results)), key=lambda i: (-score(i), i))[:n]


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def tenant(request: Request) -> str:
    """The client's tenant id, set by the API-key guard ("" when the server has no keys: one tenant)."""
    return getattr(request.state, "tenant", "")


def authenticated(request: Request) -> bool:
    """Whether the request carried a valid API key (always, when the server has no keys)."""
    return getattr(request.state, "authenticated", True)


def _cancel_all(jobs: list[Job]) -> None:
    for job in jobs:
        job.cancel("cancelled")  # a no-op for a job that already ended


class Service:
    """Validates requests, queues them, and turns their events into OpenAI responses."""

    def __init__(self, generator: SpeculativeGenerator, settings: ServerSettings, scheduler: Scheduler) -> None:
        self.generator, self.settings, self.scheduler = generator, settings, scheduler
        self.prefix_cache = PrefixCache.of_mib(settings.prefix_cache_mb)
        self.responses = ResponseStore(settings.stored_responses)

    # ---- small endpoints ---------------------------------------------------------------------------------

    def model_card(self) -> dict[str, Any]:
        """The served model, in OpenAI's shape (object, created, owned_by) and Anthropic's (type, display_name,
        created_at)."""
        created = self.settings.created
        return {
            "id": self.settings.model_id,
            "object": "model",
            "created": created,
            "owned_by": "dflashkit",
            "type": "model",
            "display_name": self.settings.model_id,
            "created_at": datetime.fromtimestamp(created, timezone.utc).isoformat().replace("+00:00", "Z"),
        }

    def check_model(self, model: str) -> None:
        if model != self.settings.model_id:
            raise APIError(
                404,
                f"The model {model!r} does not exist: this server serves '{self.settings.model_id}'",
                param="model",
                code="model_not_found",
            )

    def health(self, full: bool = True) -> dict[str, Any]:
        """/health: status and settings. ``full`` False (a request without a valid key, on a server with keys):
        the status and the model only, nothing of the queue, the prefix cache or the stored responses, which
        would tell of other clients' use."""
        if not full:
            return {"status": "ok", "model": self.settings.model_id}
        drafter = self.generator.drafter
        lookup = self.generator.uses_lookup(self.settings.lookup)  # as the generations decide it
        block_size = default_block_size(self.settings.block_size, drafter is not None, self.settings.tree, lookup)
        if drafter is not None:
            shown = drafter.block_size if block_size is None else block_size
        else:  # prompt lookup alone: "auto" (the default) or the size given; plain decoding: 1
            shown = block_size if lookup else 1
        return {
            "status": "ok",
            "model": self.settings.model_id,
            "speculative": drafter is not None,
            "block_size": shown,
            "adaptive_block_size": (drafter is not None or lookup) and block_size == "auto",
            "prompt_lookup": lookup,
            "ngram_store_entries": (
                len(drafter.ngram_store) if lookup and drafter is not None and drafter.ngram_store is not None else None
            ),
            "context_length": self.generator.target.max_positions,
            "target_weights": self.generator.target.weights,
            "engine": self.generator.target.engine,
            "queued": self.scheduler.queued,
            "running": self.scheduler.running,
            "max_queue": self.settings.max_queue,
            "max_batch": self.settings.max_batch,
            "prefix_cache": self._prefix_cache_state(),
            "stored_responses": len(self.responses),
        }

    def _prefix_cache_state(self) -> dict[str, Any] | None:
        cache = self.prefix_cache
        if cache is None:
            return None
        return {
            "max_mib": cache.max_bytes / 2**20,
            "mib": round(cache.nbytes / 2**20, 3),
            "sequences": len(cache),
            "hits": cache.hits,
            "misses": cache.misses,
            "reused_tokens": cache.reused_tokens,
        }

    # ---- validation --------------------------------------------------------------------------------------

    async def plan(self, body: GenerationRequest, chat: bool, continues: Continuation | None = None) -> Plan:
        """The request checked and tokenised, off the event loop (a long prompt's tokenisation would hold up every
        other request, /health's too). ``continues``: the stored turn a chat request continues (its prompt's text
        and ids and its answer's ids): its tokens begin the prompt when the template renders it so."""
        arrived = asyncio.get_running_loop().time()
        return await asyncio.to_thread(self._plan, body, chat, continues, arrived)

    def _plan(self, body: GenerationRequest, chat: bool, continues: Continuation | None, arrived: float) -> Plan:
        self.check_model(body.model)
        body.check_supported()
        try:
            SamplingParams(body.temperature, body.effective_top_k, body.top_p)
        except InvalidInputError as e:
            raise bad_request(str(e)) from e
        logit_bias = body.token_logit_bias()
        try:
            Penalties(body.presence_penalty, body.frequency_penalty, body.repetition_penalty, logit_bias).check_vocab(
                self.generator.target.vocab_size
            )
        except InvalidInputError as e:
            raise bad_request(str(e), param="logit_bias") from e
        tools = body.tool_request() if isinstance(body, ChatCompletionRequest) else None
        prompts = self._encode(body, chat, tools, continues)
        generations = len(prompts) * body.candidates
        places = self.settings.max_queue + self.settings.max_batch
        if generations > places:
            param = "best_of" if body.candidates > body.n else "n" if len(prompts) == 1 else "prompt"
            raise bad_request(
                f"{generations} generations ({len(prompts)} prompt(s) x {body.candidates}) need as many "
                f"places in the queue, and this server holds {places} (--max-queue "
                f"{self.settings.max_queue} + --max-batch {self.settings.max_batch})",
                param=param,
            )
        max_new = [self._max_new_tokens(body, chat, ids) for ids in prompts]
        echoes = None
        if isinstance(body, CompletionRequest) and body.echo:
            echoes = [self._echo(prompt, ids) for prompt, ids in zip(body.prompts, prompts)]
        return Plan(body, chat, prompts, max_new, arrived, logit_bias=logit_bias, echoes=echoes, tools=tools)

    def _max_new_tokens(self, body: GenerationRequest, chat: bool, ids: list[int]) -> int:
        """The completion's token budget after `ids`: the request's, or the default within the context."""
        context = self.generator.target.max_positions
        param = "messages" if chat else "prompt"
        if len(ids) >= context:
            raise bad_request(
                f"This model's maximum context length is {context} tokens, and the prompt alone has {len(ids)} "
                "tokens: shorten it.",
                param=param,
                code="context_length_exceeded",
            )
        room = context - len(ids)
        requested = body.requested_max_tokens()
        if requested is not None and requested > room and self.settings.clamp_max_tokens:
            return room
        if requested is not None and requested > room:
            raise bad_request(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{len(ids) + requested} tokens ({len(ids)} in the prompt, {requested} for the completion). "
                f"Please reduce the prompt or max_tokens (at most {room} here).",
                param="max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens",
                code="context_length_exceeded",
            )
        return requested if requested is not None else min(self.settings.default_max_tokens, room)

    def _echo(self, prompt: str | list[int], ids: list[int]) -> Echo:
        """A completions prompt to echo: the text as sent (token ids: decoded), and each token's piece of it."""
        tokenizer = self.generator.tokenizer
        text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.push([t]) for t in ids]
        pieces[-1] += detok.flush()
        return Echo(text, list(ids), pieces)

    def _compile(self, grammar: Grammar, body: GenerationRequest) -> CompiledGrammar:
        """The request's grammar checked against the tokenizer; the first one builds the tokenizer's grammar view
        (~1 s): called off the event loop. A refused grammar is a 400 naming the field it came from."""
        try:
            return self.generator.compile_grammar(grammar)
        except InvalidInputError as e:
            field_name = next(
                n
                for n in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
                if getattr(body, n, None) is not None
            )
            raise bad_request(str(e), param=field_name) from e

    def _compile_tools(self, tools: ToolRequest) -> CompiledGrammar | None:
        try:
            return self.generator.tool_call_grammar(tools)
        except InvalidInputError as e:  # e.g. a parameters schema the grammar compiler refuses
            raise bad_request(str(e), param="tools") from e

    def _encode(
        self,
        body: GenerationRequest,
        chat: bool,
        tools: ToolRequest | None = None,
        continues: Continuation | None = None,
    ) -> list[list[int]]:
        """Token ids of the request's prompt(s) (chat: with the tools the template shows, if any)."""
        try:
            if isinstance(body, ChatCompletionRequest):
                messages = [m.as_template_message() for m in body.messages]
                # the turns templates show as they are (an assistant's may lose its reasoning)
                self._check_prompt_chars([m["content"] or "" for m in messages if m["role"] != "assistant"], "messages")
                ids = self.generator.encode_prompt(
                    messages, chat=True, tools=tools.template_tools() if tools is not None else None
                )
                text = self.chat_text(body, tools) if continues is not None else None
                continued = continued_prompt(self.generator.tokenizer, text, continues) if text is not None else None
                return [continued if continued is not None else ids]
            assert isinstance(body, CompletionRequest)
            out = []
            vocab = self.generator.target.vocab_size
            for prompt in body.prompts:
                if isinstance(prompt, list):
                    if min(prompt) < 0 or max(prompt) >= vocab:
                        raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
                    out.append(list(prompt))
                else:
                    self._check_prompt_chars([prompt], "prompt")
                    out.append(self.generator.encode_prompt(prompt, chat=False))
            return out
        except ToolError as e:
            raise bad_request(str(e), param=e.field) from e
        except InvalidInputError as e:
            raise bad_request(str(e), param="messages" if chat else "prompt") from e

    @functools.cached_property
    def _max_token_chars(self) -> int | None:
        """The most characters one token stands for, found once: the longest entry of the tokenizer's vocabulary
        (byte-level and SentencePiece entries are at least as long as the text they stand for; added and special
        tokens included). None: the tokenizer does not list its vocabulary."""
        get_vocab = getattr(self.generator.tokenizer, "get_vocab", None)
        return (max(map(len, get_vocab()), default=0) or None) if get_vocab is not None else None

    def _check_prompt_chars(self, texts: list[str], param: str) -> None:
        """Refuse, without tokenising it, a prompt whose `texts` could not fit the context whatever their tokens:
        more characters (but whitespace, which some tokenizers drop) than the context's tokens each standing for
        the most characters a token can."""
        longest = self._max_token_chars
        if longest is None:
            return
        context = self.generator.target.max_positions
        if sum(map(len, texts)) <= context * longest:  # the usual case, answered without a pass over the text
            return
        chars = sum(len(_WHITESPACE.sub("", text)) for text in texts)
        if chars > context * longest:
            raise bad_request(
                f"This model's maximum context length is {context} tokens, and the prompt alone has more than "
                f"that ({chars} characters, and no token stands for more than {longest}): shorten it.",
                param=param,
                code="context_length_exceeded",
            )

    def chat_text(self, body: ChatCompletionRequest, tools: ToolRequest | None) -> str | None:
        """The chat template's text of the request's prompt (None: the tokenizer has no template)."""
        messages = template_messages(m.as_template_message() for m in body.messages)
        return render_chat(self.generator.tokenizer, messages, tools.template_tools() if tools is not None else None)

    # ---- serving -----------------------------------------------------------------------------------------

    async def handle(self, request: Request, body: GenerationRequest, chat: bool) -> Response:
        plan = await self.plan(body, chat)
        jobs, event, deadline = await self._launch(request, plan)
        response = ResponseBuilder(plan, self.settings.model_id, self.generator.token_bytes)
        try:
            if plan.body.stream:  # from here on, the SSE generator owns the jobs
                return _event_stream(self._sse(jobs, event, response, deadline))
            results = []
            for index, job in enumerate(jobs):
                results.append(
                    await self._collect(
                        job,
                        event if index == 0 else None,
                        deadline,
                        request,
                        functools.partial(response.add, index=index),
                    )
                )
            per_prompt = body.candidates
            keep = [
                p * per_prompt + i
                for p in range(len(plan.prompts))
                for i in _best(results[p * per_prompt : (p + 1) * per_prompt], body.n)
            ]
            return JSONResponse(response.complete(results, keep=keep))
        except ClientGone:
            _cancel_all(jobs)
            return Response(status_code=499)  # nobody reads it
        except BaseException:
            _cancel_all(jobs)  # a no-op for jobs that already ended
            raise

    async def handle_responses(self, request: Request, body: ResponsesRequest) -> Response:
        """/v1/responses: the chat request it means, generated as chat is, answered as a response object or its
        event stream; stored (``store``) with its conversation for ``previous_response_id``."""
        try:
            previous = (
                self.responses.get(body.previous_response_id, param="previous_response_id", owner=tenant(request))
                if body.previous_response_id is not None
                else None
            )
            history = previous.messages if previous is not None else []
            plan, chat_body, messages = await self._responses_plan(body, history, previous)
            jobs, event, deadline = await self._launch(request, plan)
        except APIError as e:
            raise renamed(e) from e
        builder = ResponsesBuilder(plan, body, self.settings.model_id, self.generator.token_bytes)

        def keep(response: dict[str, Any], result: GenerationResult) -> None:
            """Store the response with its conversation and, for the next turn's prompt, its tokens."""
            if not body.store:
                return
            text = self.chat_text(chat_body, plan.tools)
            continuation = (
                completed_turn(text, plan.prompts[0], result, self.generator.eos_token_ids)
                if text is not None
                else None
            )
            self.responses.put(
                StoredResponse(
                    response,
                    stored_messages(messages, history, response),
                    continuation,
                    listed_items(body.input),
                    owner=plan.tenant,
                )
            )

        return await self._answer(
            request, jobs, event, deadline, builder, body.stream, lambda result: keep(builder.final, result)
        )

    async def _responses_plan(
        self, body: ResponsesRequest, history: list[dict[str, Any]], previous: StoredResponse | None
    ) -> tuple[Plan, ChatCompletionRequest, list[dict[str, Any]]]:
        """The plan of a Responses request after `history` (with the chat request and its input's messages); with
        truncation "auto", the conversation's earliest turns are left out until the prompt and its answer fit."""
        drop = 0
        while True:
            chat_body, messages = body.as_chat(history, drop)
            try:  # a continued turn's own tokens begin the prompt only while nothing is left out
                continues = previous.continuation if previous is not None and not drop else None
                return await self.plan(chat_body, chat=True, continues=continues), chat_body, messages
            except APIError as e:
                later = (
                    next_turn([*history, *messages], drop)
                    if body.truncation == "auto" and e.code == "context_length_exceeded"
                    else None
                )
                if later is None:
                    raise
                drop = later

    async def handle_messages(self, request: Request, body: messages_api.MessagesRequest) -> Response:
        """/v1/messages: the chat request it means, generated as chat is, answered as an Anthropic message or its
        event stream."""
        plan = await self.plan(body.as_chat(), chat=True)
        jobs, event, deadline = await self._launch(request, plan)
        builder = messages_api.MessageBuilder(plan, self.settings.model_id)
        return await self._answer(request, jobs, event, deadline, builder, body.stream)

    async def _answer(
        self,
        request: Request,
        jobs: list[Job],
        event: Event,
        deadline: float | None,
        builder: Any,
        stream: bool,
        on_done: Callable[[GenerationResult], None] | None = None,
    ) -> Response:
        """One generation answered through a typed-event builder (Responses, Messages): its event stream, or the
        whole object (``builder.complete``); ``on_done`` is called with the result once the builder's ``final``
        object is made."""
        try:
            if stream:
                return _event_stream(self._typed_sse(jobs[0], event, builder, deadline, on_done))
            result = await self._collect(jobs[0], event, deadline, request, builder.add)
            response = builder.complete(result)
            if on_done is not None:
                on_done(result)
            return JSONResponse(response)
        except ClientGone:
            _cancel_all(jobs)
            return Response(status_code=499)
        except BaseException:
            _cancel_all(jobs)
            raise

    async def count_tokens(self, body: messages_api.MessagesRequest) -> dict[str, int]:
        """/v1/messages/count_tokens: the prompt's tokens as /v1/messages would see them (tokenised off the event
        loop)."""
        self.check_model(body.model)
        chat_body = body.as_chat(generation=False)
        ids = await asyncio.to_thread(self._encode, chat_body, True, chat_body.tool_request())
        return {"input_tokens": len(ids[0])}

    async def _launch(self, request: Request, plan: Plan) -> tuple[list[Job], Event, float | None]:
        """Queue the plan's generations; return them with the first one's first event (a failure raised) and the
        request's deadline."""
        plan.tenant = tenant(request)  # its generations match and keep prefixes of this client's only
        body = plan.body
        grammar = body.grammar()
        if plan.tools is not None and plan.tools.forced:  # tool_choice required / a named function: its grammar
            if grammar is not None:
                raise bad_request(
                    f"tool_choice {body.tool_choice!r} makes the answer a tool call: it cannot also "
                    "follow response_format or guided_*",
                    param="tool_choice",
                )
            plan.grammar = await asyncio.to_thread(self._compile_tools, plan.tools)
        elif grammar is not None:  # compiled off the event loop
            plan.grammar = await asyncio.to_thread(self._compile, grammar, body)
        if body.requested_logprobs() is not None:  # the tokenizer's byte view (built once, ~1 s) off the event loop
            await asyncio.to_thread(self.generator.token_bytes, 0)
        loop = asyncio.get_running_loop()
        try:  # every prompt's n choices (or best_of candidates), queued together, run one after another
            jobs = self.scheduler.submit_all(
                [functools.partial(self._start, plan, i) for i in range(plan.generations)], loop
            )
        except ServerShuttingDown as e:  # arrived while the server drains
            raise from_exception(e) from e
        except QueueFullError as e:
            raise APIError(
                429,
                f"The server is busy ({self.scheduler.queued} requests waiting): retry after {e.retry_after} s",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(e.retry_after)},
            ) from e
        deadline = plan.arrived + self.settings.timeout if self.settings.timeout is not None else None
        try:
            event = await self._next(jobs[0], deadline, request)  # also waits out the queue
            if isinstance(event, Failed):
                raise from_exception(event.error)
        except ClientGone:
            _cancel_all(jobs)
            raise APIError(499, "the client went away") from None  # nobody reads it
        except BaseException:
            _cancel_all(jobs)
            raise
        return jobs, event, deadline

    async def _collect(
        self, job: Job, event: Event | None, deadline: float | None, request: Request, add: Callable[[TextDelta], None]
    ) -> GenerationResult:
        """The job's result, each delta given to `add` on the way (`event`: its first event, if already taken)."""
        if event is None:
            event = await self._next(job, deadline, request)
        while isinstance(event, Delta):
            add(event.delta)
            event = await self._next(job, deadline, request)
        if isinstance(event, Failed):
            raise from_exception(event.error)
        assert isinstance(event, Done)
        return event.result

    def _start(self, plan: Plan, job: int = 0, batch: BatchMember | None = None) -> GenerationStream:  # worker thread
        """Generation `job` of the request: choice i of prompt p for job = p * candidates + i; with a seed, choice
        i > 0 samples with seed + i (mod 2**64). ``batch``: it runs as that member of the server's batcher."""
        b = plan.body
        p, index = divmod(job, b.candidates)
        if plan.max_new_tokens[p] == 0:  # echo with max_tokens 0: the prompt scored, nothing generated
            return self.generator.score(plan.prompts[p], prompt_logprobs=b.requested_logprobs() or 0, batch=batch)
        seed = b.seed if b.seed is None or index == 0 else (b.seed + index) % 2**64
        logprobs = b.requested_logprobs()
        if b.candidates > b.n and logprobs is None:
            logprobs = 0  # best_of ranks the candidates by their log-probability per token
        # the client's own view of the cache: its prompts match only what its own generations kept
        cache = self.prefix_cache.scoped(plan.tenant) if self.prefix_cache is not None and b.cache_prompt else None
        return self.generator.stream(
            plan.prompts[p],
            max_new_tokens=plan.max_new_tokens[p],
            temperature=b.temperature,
            top_k=b.effective_top_k,
            top_p=b.top_p,
            seed=seed,
            stop=b.stop_strings,
            block_size=self.settings.block_size,
            proposal=self.settings.proposal,
            proposal_temperature=self.settings.proposal_temperature,
            sampler=b.sampler or self.settings.sampler,
            lookup=self.settings.lookup,
            tree=self.settings.tree,
            draft_window=self.settings.draft_window,
            grammar=plan.grammar,
            logprobs=logprobs,
            prompt_logprobs=b.requested_logprobs() if plan.echoes is not None else None,
            presence_penalty=b.presence_penalty,
            frequency_penalty=b.frequency_penalty,
            repetition_penalty=b.repetition_penalty,
            logit_bias=plan.logit_bias,
            batch=batch,
            prefix_cache=cache,
        )

    async def _next(self, job: Job, deadline: float | None, request: Request | None) -> Event:
        """The job's next event; raises APIError 504 past the deadline (cancelling the job), ClientGone when
        `request` is given and its client disconnected."""
        loop = asyncio.get_running_loop()
        getter = asyncio.ensure_future(job.next_event())
        try:
            while True:
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    job.cancel("timeout")
                    raise APIError(
                        504,
                        f"The request did not complete within {self.settings.timeout:g} s",
                        type="timeout_error",
                        code="timeout",
                    )
                wait = remaining
                if request is not None:  # poll for a disconnect now and then
                    wait = DISCONNECT_POLL_S if remaining is None else min(DISCONNECT_POLL_S, remaining)
                done, _ = await asyncio.wait({getter}, timeout=wait)
                # checked while events keep coming too (a running generation), at most every DISCONNECT_POLL_S
                if request is not None and (not done or loop.time() >= getattr(request.state, "gone_check", 0.0)):
                    request.state.gone_check = loop.time() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        raise ClientGone
                if done:
                    return getter.result()
        finally:
            if not getter.done():
                getter.cancel()

    async def _sse(
        self, jobs: list[Job], first: Event, response: ResponseBuilder, deadline: float | None
    ) -> AsyncIterator[str]:
        """Server-sent events: each choice's chunks in turn (its index on each), its finish_reason on its last
        chunk and, on the last choice's, the usage of all; then [DONE]. An error or a timeout (the server's shutdown
        too) is an error event, then [DONE]; a disconnect, an error or a timeout cancels the jobs not yet ended
        (Starlette cancels this generator when the client goes)."""
        results: list[GenerationResult] = []
        try:
            for index, job in enumerate(jobs):
                yield sse_event(response.first_chunk(index))
                event = first if index == 0 else None
                while True:
                    if event is None:
                        try:
                            event = await self._next(job, deadline, None)
                        except APIError as e:  # timeout
                            yield sse_event(e.body())
                            yield SSE_DONE
                            return
                    if isinstance(event, Delta):
                        yield sse_event(response.chunk(event.delta, index))
                    elif isinstance(event, Done):
                        results.append(event.result)
                        for chunk in response.tool_chunks(index):  # calls are known when the answer ends
                            yield sse_event(chunk)
                        last = index == len(jobs) - 1
                        yield sse_event(response.final_chunk(event.result, index, results if last else None))
                        break
                    else:
                        yield sse_event(from_exception(event.error).body())
                        yield SSE_DONE
                        return
                    event = None
            yield SSE_DONE
        finally:
            _cancel_all(jobs)

    async def _typed_sse(
        self,
        job: Job,
        event: Event | None,
        builder: Any,
        deadline: float | None,
        on_done: Callable[[GenerationResult], None] | None = None,
    ) -> AsyncIterator[str]:
        """Typed server-sent events of one generation (the Responses and Messages APIs): the builder's opening
        events, its events per delta, then its closing events (``on_done`` called with the result before they
        go out), or its events for an error or a timeout."""
        try:
            for chunk in builder.start_events():
                yield chunk
            while True:
                if event is None:
                    try:
                        event = await self._next(job, deadline, None)
                    except APIError as e:  # timeout
                        for chunk in builder.failed_events(e):
                            yield chunk
                        return
                if isinstance(event, Delta):
                    for chunk in builder.delta_events(event.delta):
                        yield chunk
                elif isinstance(event, Done):
                    chunks = builder.done_events(event.result)
                    if on_done is not None:
                        on_done(event.result)
                    for chunk in chunks:
                        yield chunk
                    return
                else:
                    for chunk in builder.failed_events(from_exception(event.error)):
                        yield chunk
                    return
                event = None
        finally:
            job.cancel("cancelled")
