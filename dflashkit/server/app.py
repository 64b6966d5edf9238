"""The OpenAI-compatible HTTP app: `create_app(generator)` → a FastAPI app to run with uvicorn.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming with `"stream": true`),
/v1/responses (OpenAI's Responses API: see responses_api), /v1/messages (Anthropic's: see messages_api),
/health, /metrics (Prometheus), and the playground
at /. Requests are validated and tokenised on arrival
(errors answer at once, OpenAI-style), then queued for the single engine worker (see scheduler).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response

from dflashkit.cpuload import LoadWatcher, on_cpu, threads_hint
from dflashkit.decoding.batching import ComputeThread, ForwardBatcher
from dflashkit.generator import SpeculativeGenerator
from dflashkit.server import messages_api
from dflashkit.server.errors import install_error_handlers
from dflashkit.server.guards import BodyLimit, HostGuard, KeyGuard
from dflashkit.server.lifecycle import Lifecycle
from dflashkit.server.metrics import RequestCounter, ServerMetrics
from dflashkit.server.responses_api import ResponsesRequest
from dflashkit.server.scheduler import Scheduler
from dflashkit.server.schemas import ChatCompletionRequest, CompletionRequest
from dflashkit.server.service import ServerSettings, Service, authenticated, tenant

log = logging.getLogger("dflashkit.server")

ENDPOINTS = {
    "/",
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
}


def busy_load_reporter(metrics: ServerMetrics) -> Callable[[float | None], None]:
    """What a :class:`~dflashkit.cpuload.LoadWatcher` does with each sample: the ``dflashkit_other_cpu_load_cores``
    gauge, and a warning in the log when other processes start holding the cores the decoding threads need (again
    when they stop)."""
    import torch

    warned = False

    def report(busy: float | None) -> None:
        nonlocal warned
        if busy is None:
            return
        metrics.other_cpu_load.set(busy)
        hint = threads_hint(torch.get_num_threads(), busy)
        if hint and not warned:
            log.warning(hint + " (restart the server with it)")
        elif warned and not hint:
            log.info("other processes' CPU load has dropped to ~%.1f cores", busy)
        warned = hint is not None

    return report


def create_app(
    generator: SpeculativeGenerator,
    settings: ServerSettings | None = None,
    *,
    compute: ComputeThread | None = None,
    **kwargs: Any,
) -> FastAPI:
    """An app serving `generator`; `settings`, or ServerSettings fields as keyword arguments.

    Every pass of the target and the drafter runs in one thread (:class:`~dflashkit.decoding.batching.ComputeThread`):
    ``compute``, served by the caller (``dflashkit serve`` serves it in the main thread, where the model was loaded
    and warmed up), or by default one the app starts with itself."""
    settings = settings if settings is not None else ServerSettings(**kwargs)
    if settings.model_id is None:
        settings.model_id = getattr(generator.model.config, "name_or_path", "") or "dflashkit"
    metrics = ServerMetrics()
    owned = compute is None
    compute = compute if compute is not None else ComputeThread()
    batcher = ForwardBatcher(generator.target, compute)
    scheduler = Scheduler(settings.max_queue, observer=metrics, max_batch=settings.max_batch, batcher=batcher)
    metrics.watch_scheduler(lambda: scheduler.queued, lambda: scheduler.running)
    service = Service(generator, settings, scheduler)
    lifecycle = Lifecycle(scheduler, settings.shutdown_timeout)  # graceful shutdown (dflashkit.server.lifecycle)

    # a CPU server's machine may get busy after it started: other processes' load as a metric, and a warning
    watcher = LoadWatcher(busy_load_reporter(metrics)) if on_cpu(generator.target.device) else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if owned:
            compute.start()
        scheduler.start()
        lifecycle.attach(asyncio.get_running_loop())  # in the main thread: SIGTERM / SIGINT drain first
        if watcher is not None:
            watcher.start()
        try:
            yield
        finally:
            lifecycle.detach()
            if watcher is not None:
                watcher.stop()
            scheduler.stop()
            if owned:
                compute.stop()

    app = FastAPI(
        title="dflashkit",
        summary="OpenAI-compatible speculative decoding server",
        lifespan=lifespan,
    )
    app.state.service, app.state.scheduler, app.state.metrics = service, scheduler, metrics
    app.state.lifecycle = lifecycle
    renderers = {messages_api.PATH: messages_api.error_body}
    install_error_handlers(app, renderers)
    # from the outside in: CORS, the request counter, then the guards (Host / Origin, body, API key: see guards)
    app.add_middleware(KeyGuard, keys=settings.api_keys, renderers=renderers)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout, renderers=renderers)
    app.add_middleware(
        HostGuard,
        allowed_hosts=settings.allowed_hosts,
        allowed_origins=settings.allowed_origins,
        renderers=renderers,
    )
    app.add_middleware(RequestCounter, metrics=metrics, endpoints=ENDPOINTS)
    if settings.allowed_origins:  # answers browsers' preflight requests itself (before any key check)
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        card = service.model_card()  # the list in OpenAI's shape and Anthropic's at once (their keys differ)
        return {"object": "list", "data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        service.check_model(model)
        return service.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await service.handle(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await service.handle(request, body, chat=True)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await service.handle_responses(request, body)

    # a stored response is its client's (tenant's): to any other, as if it did not exist
    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        return service.responses.get(response_id, owner=tenant(request)).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str, request: Request, after: str | None = None, limit: int = 20, order: str = "desc"
    ) -> dict[str, Any]:
        return service.responses.input_items(response_id, after, limit, order, owner=tenant(request))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        service.responses.delete(response_id, owner=tenant(request))
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/messages")
    async def messages(body: messages_api.MessagesRequest, request: Request) -> Response:
        return await service.handle_messages(request, body)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: messages_api.MessagesRequest) -> dict[str, int]:
        return await service.count_tokens(body)

    @app.get("/health")
    async def health(request: Request) -> Response:
        body = service.health(full=authenticated(request))  # without a valid key: status and model only
        if lifecycle.draining:  # shutting down: load balancers stop sending here
            return JSONResponse({**body, "status": "draining"}, status_code=503)
        return JSONResponse(body)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> HTMLResponse:
        return HTMLResponse(_playground_html())

    return app


def _playground_html() -> str:
    return resources.files(__package__).joinpath("static/playground.html").read_text(encoding="utf-8")
