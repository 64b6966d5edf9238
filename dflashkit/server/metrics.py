"""Prometheus metrics of one server: requests, tokens, acceptance per block position, latencies, queue.

Each app gets its own registry (several servers can live in one process, e.g. in tests). A request is counted by
how it ended: the status it was answered with, or 499 when its client went away before the answer was complete (a
dropped stream is not a 200); generations by their outcome (:data:`OUTCOMES`).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dflashkit.generator import GenerationResult
from dflashkit.server.scheduler import Job

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# How a generation ends (the scheduler's outcomes): shown at 0 from the start, so that a rate over any of them works
OUTCOMES = {
    "stop": "ended by an end-of-turn token or a stop string",
    "length": "ended at its token limit",
    "cancelled": "its client went away",
    "timeout": "past the request timeout",
    "error": "failed in the engine",
    "shutdown": "still running when a shutdown's drain time ran out",
    "drained": "still queued when the server began shutting down (answered 503)",
}
CLIENT_GONE = "499"  # the status label of a request whose client went away before its answer was complete


class ServerMetrics:
    """The server's counters, gauges and histograms; `job_started`/`job_finished` feed them (a JobObserver)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "dflashkit_requests",
            "HTTP requests by endpoint and the status they were answered with; 499: the client went away before "
            "the answer was complete (a dropped stream)",
            ["endpoint", "status"],
            registry=r,
        )
        self.shed = Counter(
            "dflashkit_requests_shed",
            "Requests refused with 429 because the queue was full (also counted in dflashkit_requests)",
            ["endpoint"],
            registry=r,
        )
        self.generations = Counter(
            "dflashkit_generations",
            "Generations by outcome: " + "; ".join(f"{name}: {meaning}" for name, meaning in OUTCOMES.items()),
            ["outcome"],
            registry=r,
        )
        for outcome in OUTCOMES:
            self.generations.labels(outcome)
        self.prompt_tokens = Counter("dflashkit_prompt_tokens", "Prompt tokens of generations run", registry=r)
        self.cached_prompt_tokens = Counter(
            "dflashkit_prompt_tokens_cached",
            "Prompt tokens restored from the prefix cache instead of prefilled",
            registry=r,
        )
        self.completion_tokens = Counter(
            "dflashkit_completion_tokens", "Tokens generated (cancelled runs included)", registry=r
        )
        self.steps = Counter(
            "dflashkit_drafting_steps", "Draft-and-verify steps (target passes after prefill)", registry=r
        )
        self.draft_tokens = Counter("dflashkit_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("dflashkit_accepted_tokens", "Draft tokens accepted", registry=r)
        self.drafted_by_position = Counter(
            "dflashkit_draft_tokens_by_position",
            "Draft tokens proposed at block position k (1 = first draft)",
            ["position"],
            registry=r,
        )
        self.accepted_by_position = Counter(
            "dflashkit_accepted_tokens_by_position",
            "Draft tokens accepted at block position k (1 = first draft)",
            ["position"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "dflashkit_queue_wait_seconds",
            "Time from arrival to the start of generation",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "dflashkit_time_to_first_token_seconds",
            "Time from arrival to the first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "dflashkit_request_latency_seconds",
            "Time from arrival to the end of generation",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queued = Gauge("dflashkit_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge(
            "dflashkit_requests_running", "Generations running now (at most the server's --max-batch)", registry=r
        )
        self.other_cpu_load = Gauge(
            "dflashkit_other_cpu_load_cores",
            "Cores other processes kept busy, sampled every 30 s (CPU servers on Linux; docs/performance.md)",
            registry=r,
        )

    def watch_scheduler(self, queued: Callable[[], float], running: Callable[[], float]) -> None:
        self.queued.set_function(queued)
        self.running.set_function(running)

    # ---- JobObserver ---------------------------------------------------------------------------------------

    def job_started(self, job: Job) -> None:
        assert job.started_at is not None
        self.queue_wait.observe(job.started_at - job.enqueued_at)

    def job_finished(self, job: Job, outcome: str, result: GenerationResult | None) -> None:
        self.generations.labels(outcome).inc()
        self.completion_tokens.inc(job.tokens)
        if job.first_token_at is not None:
            self.ttft.observe(job.first_token_at - job.enqueued_at)
        if result is None:
            return
        assert job.finished_at is not None
        self.latency.observe(job.finished_at - job.enqueued_at)
        s = result.stats
        self.prompt_tokens.inc(result.prompt_tokens)
        self.cached_prompt_tokens.inc(s.cached_prompt_tokens)
        self.steps.inc(s.steps)
        self.draft_tokens.inc(sum(s.drafted_lengths))
        self.accepted_tokens.inc(sum(s.accepted_lengths))
        for k, (drafted, accepted) in enumerate(zip(s.drafted_per_position, s.accepted_per_position), start=1):
            self.drafted_by_position.labels(str(k)).inc(drafted)
            self.accepted_by_position.labels(str(k)).inc(accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware counting HTTP requests by endpoint and how they ended (streaming-safe, unlike
    BaseHTTPMiddleware): the status sent once the last body message has gone out; 499 when the client went away
    before that (the server's ``http.disconnect`` message, or a send that failed); a response that broke off for
    another reason (the app raised) counts as 500. 429s are also counted as shed."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, endpoints: set[str]) -> None:
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"
        status: int | None = None  # as sent in http.response.start
        complete = gone = False

        async def receive_and_watch() -> Message:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                gone = True
            return message

        async def send_and_record(message: Message) -> None:
            nonlocal status, complete, gone
            try:
                await send(message)
            except OSError:  # servers of ASGI spec 2.4 raise it when the client has gone
                if not complete:
                    gone = True
                raise
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True

        try:
            await self.app(scope, receive_and_watch, send_and_record)
        finally:
            # gone before the end: 499 (a send to a gone client may pass silently); complete: its status; otherwise
            # the app raised (the server answers 500 if it still can)
            label = CLIENT_GONE if gone else str(status) if complete and status is not None else "500"
            route = getattr(scope.get("route"), "path", None)  # the matched route's template, set by the router
            if endpoint == "other" and isinstance(route, str):
                endpoint = route  # e.g. /v1/responses/{response_id}: one label per route, never per id
            self.metrics.requests.labels(endpoint, label).inc()
            if label == "429":
                self.metrics.shed.labels(endpoint).inc()
