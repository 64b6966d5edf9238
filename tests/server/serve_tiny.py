"""A server process on the tiny test models, for tests that signal a real process (tests/server/test_shutdown.py).

    python -m tests.server.serve_tiny --port N [--max-batch 4] [--max-queue 8] [--shutdown-timeout 30]
        [--token-seconds 0.05] [--uvicorn]

By default it serves the way ``dflashkit serve`` does (:func:`dflashkit.server.lifecycle.serve`: HTTP in a thread,
the passes in the main thread, which handles SIGTERM and SIGINT); ``--uvicorn`` runs the ASGI app with a plain
``uvicorn.run(app)`` instead (the app's lifespan then chains uvicorn's signal handlers). ``--token-seconds`` makes
the model slow: each streamed piece of a generation takes that long, so that generations are still running when a
test sends its signal (the scheduler checks for cancellation between pieces, as between decode steps).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator

from dflashkit.generator import GenerationStream, TextDelta
from dflashkit.server import ServerSettings, create_app
from tests.live_server import tiny_generator

MODEL = "tiny-llama"


def slowed(stream: GenerationStream, seconds: float) -> GenerationStream:
    """``stream`` with each of its deltas taking ``seconds`` more (closing it closes the generation)."""
    inner = stream._deltas

    def paced() -> Iterator[TextDelta]:
        try:
            for delta in inner:
                time.sleep(seconds)
                yield delta
        finally:
            close = getattr(inner, "close", None)
            if close is not None:
                close()

    stream._deltas = paced()
    return stream


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=8)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument("--token-seconds", type=float, default=0.0)
    p.add_argument("--uvicorn", action="store_true", help="plain uvicorn.run(app)")
    args = p.parse_args(argv)

    from dflashkit.decoding.batching import ComputeThread

    settings = ServerSettings(
        model_id=MODEL,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        shutdown_timeout=args.shutdown_timeout,
        prefix_cache_mb=0,
    )
    compute = None if args.uvicorn else ComputeThread()
    app = create_app(tiny_generator(), settings, compute=compute)
    if args.token_seconds:
        service = app.state.service
        start = service._start
        service._start = lambda plan, job=0, batch=None: slowed(start(plan, job, batch), args.token_seconds)
    if args.uvicorn:
        import uvicorn

        # the drain's progress and summary are logged (dflashkit.server, INFO); uvicorn's own config leaves them out
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
        logging.getLogger("dflashkit.server").setLevel(logging.INFO)
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
        return 0
    from dflashkit.server.lifecycle import serve

    assert compute is not None
    print(f"serving at http://127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    return serve(app, compute, "127.0.0.1", args.port, "warning")


if __name__ == "__main__":
    sys.exit(main())
