"""A real uvicorn server on a free localhost port, in a thread, for tests of the HTTP server."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import torch
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from dflashkit import SpeculativeGenerator
from dflashkit.server.http import uvicorn_options
from tests.conftest import BYTE_VOCAB, byte_tokenizer, tiny_drafter, tiny_target, word_tokenizer


class LiveServer:
    """`with LiveServer(app) as server: server.url` — serves `app` until the block ends, over the HTTP protocol
    `dflashkit serve` runs (dflashkit.server.http.uvicorn_options of the app's settings). ``options``: more
    ``uvicorn.Config`` keyword arguments, or others in their place."""

    def __init__(self, app: FastAPI, **options: Any) -> None:
        self.app = app
        service = getattr(app.state, "service", None)
        if service is not None:
            options = {**uvicorn_options(service.settings), **options}
        # log_config=None: uvicorn's default dictConfig closes every existing logging handler, and a handler
        # made while pytest captured stderr (absl's, imported by mathematics_dataset in test_data) would close
        # pytest's capture stream with it ("I/O operation on closed file" at the end of the session).
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="on", log_config=None, **options)
        )
        self.thread: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> LiveServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        assert self.thread is not None
        self.thread.join(30)


def metric(url: str, name: str, **labels: str) -> float:
    """A sample's value from /metrics (0 when absent)."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def tiny_generator(block_size: int = 4, dtype: torch.dtype = torch.float32) -> SpeculativeGenerator:
    """The tiny llama target (fp32 unless told) with a random drafter: built deterministically, so two calls give
    two identical generators (one for the server, one for offline reference runs)."""
    model = tiny_target("llama", dtype=dtype)
    return SpeculativeGenerator(model, word_tokenizer(), tiny_drafter(model, block_size=block_size))


def tiny_byte_generator(block_size: int = 4) -> SpeculativeGenerator:
    """As tiny_generator, over the byte-level tokenizer: it can spell JSON (structured-output tests)."""
    model = tiny_target("llama", vocab_size=BYTE_VOCAB)
    return SpeculativeGenerator(model, byte_tokenizer(), tiny_drafter(model, block_size=block_size))


# A chat template in the Qwen2.5 / Hermes convention (tools shown in the system turn, calls as <tool_call> blocks,
# answers as tool turns), written for these tests.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>You can call these tools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    'Answer a call as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|tool|>{{ message.content }}\n"
    "{%- elif message.tool_calls %}<|assistant|>{% for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}\n"
    "{%- else %}<|{{ message.role }}|>{{ message.content }}\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tool_generator() -> SpeculativeGenerator:
    """The tiny byte-level target (its context long enough for two tools' schemas, one byte per token) with a
    random drafter and TOOLS_TEMPLATE."""
    model = tiny_target("llama", vocab_size=BYTE_VOCAB, max_position_embeddings=2048)
    gen = SpeculativeGenerator(model, byte_tokenizer(), tiny_drafter(model, block_size=4))
    gen.tokenizer.chat_template = TOOLS_TEMPLATE
    return gen


def offline_chat(
    gen: SpeculativeGenerator,
    messages: list[dict],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    **kw,
):
    """An offline run of chat `messages` as the server's endpoints run them ("sample" proposals)."""
    return gen.generate(
        gen.encode_prompt(messages, chat=True),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        proposal="sample",
        **kw,
    )


# an answer with text before its tool call, in the pieces a stream would deliver it
TEXT_THEN_CALL = [
    "Let me ",
    "pick. ",
    "<tool",
    "_call>\n",
    '{"name": "pick_color", ',
    '"arguments": {"color": "red"}}',
    "\n</tool_call>",
]


def scripted(app: FastAPI, pieces: list[str], finish_reason: str = "stop") -> None:
    """Make `app` answer every request with `pieces` (one delta each, one token per piece), as a generation that
    ended with `finish_reason`: for answers a random tiny target does not write (text, then a tool call)."""
    from dflashkit.decoding.stats import DecodeStats
    from dflashkit.generator import GenerationResult, GenerationStream, TextDelta

    def start(plan, job=0, batch=None) -> GenerationStream:
        ids = list(range(10, 10 + len(pieces)))
        stats = DecodeStats(
            block_size=1, prompt_tokens=len(plan.prompts[0]), new_tokens=len(ids), finish_reason=finish_reason
        )
        stream = GenerationStream(iter(()))

        def deltas():
            for i, piece in enumerate(pieces):
                yield TextDelta(piece, [ids[i]], [False], [piece])
            stream.result = GenerationResult(
                "".join(pieces), ids, [False] * len(ids), stats, finish_reason, len(plan.prompts[0])
            )

        stream._deltas = deltas()
        return stream

    app.state.service._start = start
