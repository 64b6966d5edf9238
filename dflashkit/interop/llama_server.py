"""A `llama-server` process on loopback: started, health-checked, asked for completions, stopped.

Used by the benchmark's llama.cpp peers (plain decoding of a GGUF, and llama.cpp's own DFlash with a drafter
exported by dflashkit) and by `scripts/parity_llama_cpp.py`. Requests go to the server's native
``/completion`` endpoint with the prompt as token ids and ``return_tokens``: its OpenAI endpoints answer with
text only, while a token-for-token comparison with dflashkit needs the ids. Both kinds of endpoint report the
same ``timings`` (prompt and generation milliseconds, tokens, and for speculative decoding the drafted and
accepted token counts), measured inside the server; those are what the benchmark records, so HTTP and JSON
overheads stay out of llama.cpp's figures.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashkit.errors import DFlashError

LLAMA_SERVER_ENV = "DFLASHKIT_LLAMA_SERVER"


def _stop(proc: subprocess.Popen, log_file: Any) -> None:
    """Stop a llama-server process (SIGTERM, then SIGKILL after 10 s) and close its log file."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if log_file is not None:
        log_file.close()


class LlamaServerError(DFlashError, RuntimeError):
    """llama-server could not be found, did not start, or answered with an error."""


def find_llama_server(explicit: str | os.PathLike | None = None) -> Path | None:
    """The llama-server binary: `explicit`, else $DFLASHKIT_LLAMA_SERVER, else the one that
    `scripts/get_llama_cpp.sh --build` leaves in the llama.cpp checkout, else `llama-server` on PATH."""
    from dflashkit.target.loading import cache_dir

    given = explicit or os.environ.get(LLAMA_SERVER_ENV)
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise LlamaServerError(f"llama-server binary {path} does not exist")
        return path
    checkout = Path(os.environ.get("DFLASHKIT_LLAMA_CPP") or cache_dir() / "llama.cpp").expanduser()
    built = checkout / "build" / "bin" / "llama-server"
    if built.is_file():
        return built
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Completion:
    """One llama-server completion: the generated token ids (a stop token included, as dflashkit's are) and the
    server's own measurements."""

    tokens: list[int]
    prompt_ms: float  # prompt processing, the first token's sampling included
    predicted_ms: float  # generation of the remaining tokens
    predicted_n: int
    draft_n: int = 0  # tokens the drafter proposed (speculative decoding only)
    draft_n_accepted: int = 0  # of which the target accepted
    stop_type: str = ""
    timings: dict[str, Any] = field(default_factory=dict)

    @property
    def target_passes(self) -> int:
        """Verification passes: every pass yields its accepted drafts plus one token of the target's."""
        return self.predicted_n - self.draft_n_accepted

    @classmethod
    def from_response(cls, body: dict[str, Any]) -> Completion:
        try:
            t = body["timings"]
            return cls(
                tokens=[int(x) for x in body["tokens"]],
                prompt_ms=float(t["prompt_ms"]),
                predicted_ms=float(t["predicted_ms"]),
                predicted_n=int(t["predicted_n"]),
                draft_n=int(t.get("draft_n", 0)),
                draft_n_accepted=int(t.get("draft_n_accepted", 0)),
                stop_type=str(body.get("stop_type", "")),
                timings=dict(t),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise LlamaServerError(
                f"unexpected llama-server answer ({type(e).__name__}: {e}): {str(body)[:300]}"
            ) from None


class LlamaServer:
    """`llama-server -m MODEL [-md DRAFTER --spec-type SPEC]` on 127.0.0.1, `parallel` slots (1 by default;
    more: requests decoded together in continuous batches), `context` tokens each, for one process.

    Use as a context manager (or call `start()` / `close()`); the log goes to `log_path` (a temporary file
    by default) and its tail is quoted when the server fails.
    """

    def __init__(
        self,
        binary: str | os.PathLike,
        model: str | os.PathLike,
        *,
        drafter: str | os.PathLike | None = None,
        block_size: int | None = 16,
        spec_type: str = "draft-dflash",
        threads: int = 1,
        context: int = 4096,
        parallel: int = 1,
        log_path: str | os.PathLike | None = None,
        extra_args: tuple[str, ...] = (),
        start_timeout_s: float = 180.0,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.binary, self.model = Path(binary), Path(model)
        self.drafter = Path(drafter) if drafter is not None else None
        if self.drafter is not None and block_size is not None and block_size < 2:
            raise ValueError(f"block size must be at least 2, got {block_size}")
        self.spec_type = spec_type  # draft-dflash: a DFlash drafter; draft-simple: a small model of the same family
        self.block_size, self.threads, self.context, self.parallel = block_size, threads, context, parallel
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = tuple(extra_args)
        self.start_timeout_s, self.request_timeout_s = start_timeout_s, request_timeout_s
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._log_file: Any = None
        self._finalizer: weakref.finalize | None = None  # stops a forgotten server (GC or interpreter exit)

    def command(self, port: int) -> list[str]:
        cmd = [
            str(self.binary),
            "-m",
            str(self.model),
            "-t",
            str(self.threads),
            "-tb",
            str(self.threads),
            "-c",
            str(self.context * self.parallel),
            "-np",
            str(self.parallel),
            "-fa",
            "on",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        if self.drafter is not None:
            cmd += ["-md", str(self.drafter), "--spec-type", self.spec_type]
            if self.block_size is not None:  # None: llama.cpp's own default number of drafts
                cmd += ["--spec-draft-n-max", str(self.block_size - 1)]
        return cmd + list(self.extra_args)

    @property
    def url(self) -> str:
        if self.port is None:
            raise LlamaServerError("llama-server is not started")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LlamaServer:
        """Start the process and wait until /health answers 200 (the model is loaded)."""
        if self.proc is not None:
            return self
        for path in (self.binary, self.model, self.drafter):
            if path is not None and not path.is_file():
                raise LlamaServerError(f"{path} does not exist")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log_file = self.log_path.open("w")
        self.port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        self.proc = subprocess.Popen(
            self.command(self.port), stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        self._finalizer = weakref.finalize(self, _stop, self.proc, self._log_file)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.close()
                raise LlamaServerError(f"llama-server exited with code {code} while starting:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while loading
            if time.monotonic() > deadline:
                self.close()
                raise LlamaServerError(
                    f"llama-server did not become ready in {self.start_timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").strip().splitlines()[-lines:])

    def complete(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        *,
        temperature: float = 0.0,
        seed: int = 0,
        extra: dict[str, Any] | None = None,
    ) -> Completion:
        """Generate up to `max_tokens` after `prompt_ids`; greedy at temperature 0, else plain sampling at that
        temperature (top-k, top-p, min-p, typical-p and penalties off). The prompt is processed afresh. `extra`:
        more fields of llama-server's /completion request (e.g. {"json_schema": {...}} for structured output)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        body = {
            "prompt": list(prompt_ids),
            "n_predict": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "typical_p": 1.0,
            "repeat_penalty": 1.0,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
            **(extra or {}),
        }
        request = urllib.request.Request(
            self.url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as r:
                answer = json.load(r)
        except urllib.error.HTTPError as e:
            raise LlamaServerError(
                f"llama-server answered {e.code}: {e.read().decode(errors='replace')[:500]}"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            alive = self.proc is not None and self.proc.poll() is None
            raise LlamaServerError(
                f"llama-server request failed ({e}); {'still running' if alive else 'it exited'}:\n{self.log_tail()}"
            ) from None
        return Completion.from_response(answer)

    def close(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 10 s) and close its log."""
        if self._finalizer is not None:
            self._finalizer()  # runs _stop once; a later GC or exit does nothing more
            self._finalizer = None
        elif self._log_file is not None:
            self._log_file.close()
        self.proc, self._log_file = None, None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
