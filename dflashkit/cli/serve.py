"""`dflashkit serve`: the OpenAI-compatible HTTP server, its options and its start."""

from __future__ import annotations

import argparse
import ipaddress
import os
import pathlib
import sys

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
    int_at_least,
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
        action="append",
        default=None,
        metavar="KEY",
        help="require this key on /v1/*, /docs and /openapi.json ('Authorization: Bearer KEY' or 'x-api-key: "
        "KEY'); repeat it for several keys, each client its own (default: $DFLASHKIT_API_KEY, else none); "
        "/health, /metrics and the playground page stay open",
    )
    s.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help="a file of API keys, one a line (blank lines and # comments skipped), accepted as --api-key's are "
        "(default: none)",
    )
    s.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="HOSTS",
        help="comma-separated host names the server answers to in a request's Host header, '*' for any, "
        "'*.example.com' for its subdomains (default: localhost, 127.0.0.1 and ::1, so that no other site's page "
        "can reach it by DNS rebinding; with a --host that is not a loopback address: any)",
    )
    s.add_argument(
        "--max-body-bytes",
        type=int_at_least(1),
        default=4 * 2**20,
        metavar="BYTES",
        help="a larger request body is refused (413) before it is read",
    )
    s.add_argument(
        "--header-timeout",
        type=float,
        metavar="SECONDS",
        default=10.0,
        help="seconds a request's line and headers may take to arrive (then 408 and the connection closes)",
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        metavar="SECONDS",
        default=30.0,
        help="seconds a request's body may take to arrive after its headers (then 408)",
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
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running generations may go on after SIGTERM or Ctrl-C (queued requests are answered 503 at "
        "once); then they are cut off, each ending with an error; a second signal cuts off at once",
    )
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
        import uvicorn  # noqa: F401  (the serve extra's)

        from dflashkit.decoding.batching import ComputeThread
        from dflashkit.server import ServerSettings, create_app
        from dflashkit.server.http import uvicorn_options
        from dflashkit.server.lifecycle import serve
    except ImportError as e:
        raise InvalidInputError(f"serving needs the 'serve' extra: pip install 'dflashkit[serve]' ({e})") from e
    settings = ServerSettings(  # checked before the (slow) model load
        model_id=args.model_name or (args.target or DEFAULT_TARGET),
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        timeout=args.timeout or None,
        shutdown_timeout=args.shutdown_timeout,
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
        api_key=api_keys(args),
        clamp_max_tokens=args.clamp_max_tokens,
        allowed_origins=[o.strip() for o in args.allowed_origins.split(",") if o.strip()],
        allowed_hosts=allowed_hosts(args),
        max_body_bytes=args.max_body_bytes,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
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
    # HTTP in a thread, the passes in this one; SIGTERM / Ctrl-C drain (dflashkit.server.lifecycle)
    return serve(app, compute, args.host, args.port, args.log_level, **uvicorn_options(settings))


def api_keys(args: argparse.Namespace) -> list[str] | None:
    """The keys of --api-key (else $DFLASHKIT_API_KEY) and --api-keys-file; None: no key, the API is open."""
    from dflashkit.errors import InvalidInputError

    keys = list(args.api_key) if args.api_key else []
    if not keys and os.environ.get("DFLASHKIT_API_KEY") is not None:
        keys.append(os.environ["DFLASHKIT_API_KEY"])
    if args.api_keys_file is not None:
        try:
            lines = pathlib.Path(args.api_keys_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidInputError(f"--api-keys-file: cannot read {args.api_keys_file!r}: {e}") from None
        found = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not found:
            raise InvalidInputError(f"--api-keys-file: {args.api_keys_file!r} holds no keys (one a line)")
        keys += found
    return keys or None


def allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    """The host names of --allowed-hosts; without it, None (loopback names only) when --host is a loopback
    address, else any host (``["*"]``), said in a note: a server listening on other interfaces is reached by
    names this one cannot know."""
    if args.allowed_hosts is not None:
        return [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    if is_loopback(args.host):
        return None
    print(
        f"note: the Host check is off: --host {args.host} is not a loopback address (--allowed-hosts NAME,... "
        "turns it on)",
        file=sys.stderr,
    )
    return ["*"]


def is_loopback(host: str) -> bool:
    """Whether `host` (--host) is a loopback address or localhost."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"
