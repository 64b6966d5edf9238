"""`dflashkit serve`: the OpenAI-compatible HTTP server, its options and its start."""

from __future__ import annotations

import argparse
import os
import sys
import threading

from dflashkit.cli.common import (
    DRAFTER_HELP,
    TARGET_HELP,
    add_block_size_option,
    add_draft_window_option,
    add_dtype_device_options,
    add_eager_option,
    add_lookup_option,
    add_proposal_options,
    add_quantize_option,
    add_sampler_option,
    add_threads_option,
    add_tree_option,
    drafter_arg,
    load_generator,
    note_tree_without_drafter,
    port_arg,
)
from dflashkit.cpuload import apply_threads


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand."""
    s = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (streaming, speculative stats, /metrics) with a live playground",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics and a playground "
        "at /. Up to --max-batch generations run at once, their target passes batched (first come, first "
        "served); up to --max-queue requests wait, more are answered 429 with Retry-After.",
    )
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: %(default)s; 0.0.0.0 for all)")
    s.add_argument("--port", type=port_arg, default=8000, help="TCP port to listen on")
    s.add_argument("--target", default=None, help=TARGET_HELP)
    s.add_argument("--drafter", type=drafter_arg, default=None, help=DRAFTER_HELP)
    s.add_argument("--model-name", default=None, help="model id clients send (default: the target's name)")
    add_block_size_option(s)
    add_proposal_options(s)
    add_sampler_option(s)
    add_lookup_option(s)
    add_tree_option(s)
    add_draft_window_option(s)
    s.add_argument("--max-queue", type=int, default=16, help="requests that may wait while --max-batch run")
    s.add_argument(
        "--max-batch",
        type=int,
        default=4,
        help="generations that run at once, their target passes batched into one (1-16; default: "
        "%(default)s; 1: one at a time); each generation's output is unchanged",
    )
    s.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=256.0,
        help="MiB of finished generations kept so that a prompt that begins the same way (a chat's next "
        'turn) prefills only its new tokens (default: %(default)s; 0: off; a request\'s "cache_prompt": '
        "false opts out)",
    )
    s.add_argument(
        "--stored-responses",
        type=int,
        default=256,
        help="/v1/responses answers kept in memory, for previous_response_id and GET /v1/responses/{id} "
        "(default: %(default)s; 0: none)",
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("DFLASHKIT_API_KEY"),
        help="require this key on /v1/* ('Authorization: Bearer KEY' or 'x-api-key: KEY'; default: "
        "$DFLASHKIT_API_KEY, else none); /health, /metrics and the playground page stay open",
    )
    s.add_argument(
        "--clamp-max-tokens",
        action="store_true",
        help="lower a max_tokens that goes past the context to what fits (the answer then ends there, "
        "finish_reason length) instead of refusing the request; for clients that always send a large "
        "max_tokens, e.g. coding agents (llama-server's behaviour)",
    )
    s.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated browser origins allowed to call the API from other pages (CORS), e.g. "
        "http://localhost:3000, or '*' for any (default: none)",
    )
    s.add_argument("--timeout", type=float, default=600.0, help="seconds from arrival to the last token (0: no limit)")
    s.add_argument("--default-max-tokens", type=int, default=256, help="when a request gives no max_tokens")
    add_dtype_device_options(s)
    add_quantize_option(s)
    add_eager_option(s)
    add_threads_option(s)
    s.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="how much the HTTP server (uvicorn) logs: 'info' logs every request, 'warning' only problems",
    )
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from dflashkit.errors import InvalidInputError
    from dflashkit.target.loading import DEFAULT_TARGET

    try:
        import uvicorn

        from dflashkit.decoding.batching import ComputeThread
        from dflashkit.server import ServerSettings, create_app
    except ImportError as e:
        raise InvalidInputError(f"serving needs the 'serve' extra: pip install 'dflashkit[serve]' ({e})") from e
    settings = ServerSettings(  # checked before the (slow) model load
        model_id=args.model_name or (args.target or DEFAULT_TARGET),
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        timeout=args.timeout or None,
        default_max_tokens=args.default_max_tokens,
        block_size=args.block_size,
        lookup=args.lookup,
        proposal=args.proposal,
        proposal_temperature=args.proposal_temperature,
        sampler=args.sampler,
        tree=args.tree,
        draft_window=args.draft_window,
        prefix_cache_mb=args.prefix_cache_mb,
        stored_responses=args.stored_responses,
        api_key=args.api_key,
        clamp_max_tokens=args.clamp_max_tokens,
        allowed_origins=[o.strip() for o in args.allowed_origins.split(",") if o.strip()],
    )
    apply_threads(args.threads, args.device)
    gen = load_generator(args, False)
    note_tree_without_drafter(args, gen.drafter is not None)
    compute = ComputeThread()  # this thread, which loaded the model: every pass runs here (dflashkit.decoding.batching)
    app = create_app(gen, settings, compute=compute)
    gen.warmup()
    print(
        f"Serving {settings.model_id!r} at http://{args.host}:{args.port} (playground: /, API: /v1, "
        f"metrics: /metrics); up to {settings.max_batch} generations at once, {settings.max_queue} waiting"
        + ("; /v1 needs the API key" if settings.api_key is not None else ""),
        file=sys.stderr,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))

    def run_server() -> None:  # the HTTP side in a thread of its own; the main thread computes
        try:
            server.run()
        finally:
            compute.wake()

    thread = threading.Thread(target=run_server, name="dflashkit-http", daemon=True)
    thread.start()
    try:
        compute.serve(until=lambda: not thread.is_alive())
    except KeyboardInterrupt:
        print("Shutting down", file=sys.stderr)
    finally:
        server.should_exit = True
        thread.join(30)
    return 0
