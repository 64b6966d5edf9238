"""Property-based fuzz of the app's OpenAPI schema (schemathesis over ASGI): every operation gets a bounded number of
generated requests, valid and invalid; none may get a 5xx, and every 4xx must be an error in its API's shape
(OpenAI's ``{"error": {"message", "type", "param", "code"}}``; Anthropic's ``{"type": "error", "error": {"type",
"message"}}`` on /v1/messages*).

Derandomized, so CI runs the same cases each time. The served model is the tiny test target with a 64-token context
and at most 4 generations per request (--max-queue 2 + --max-batch 2), so that the longest answer any case can ask
for stays short; most generated bodies are sent naming the served model, some with a well-formed prompt too, so
that requests get past the model check into validation and generation."""

from __future__ import annotations

import collections
import re
from typing import Any

import pytest
import schemathesis  # the dev extra's: a missing one fails the run rather than skipping the fuzz unseen
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.pytest.lazy import get_all_tests

from dflashkit import SpeculativeGenerator
from dflashkit.server import create_app
from tests.conftest import tiny_drafter, tiny_target, word_tokenizer

MODEL = "tiny-llama"
# a well-formed prompt of each API
CONVERSATION = {"messages": [{"role": "user", "content": "w5 w6"}], "input": "w5 w6", "prompt": "w5 w6"}
# a well-formed request of each endpoint that takes a body
WELL_FORMED = {
    "/v1/completions": {"model": MODEL, "prompt": CONVERSATION["prompt"]},
    "/v1/chat/completions": {"model": MODEL, "messages": CONVERSATION["messages"]},
    "/v1/responses": {"model": MODEL, "input": CONVERSATION["input"]},
    "/v1/messages": {"model": MODEL, "max_tokens": 8, "messages": CONVERSATION["messages"]},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": CONVERSATION["messages"]},
}
MAX_EXAMPLES = 25  # generated cases per operation (the coverage phase adds its own: each field's edge values)
CONTEXT = 64  # tokens: bounds every generation a case can ask for

# what the run saw, by operation: cases, status classes (printed at the end of the module: `pytest -s`)
SEEN: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def served_app() -> Any:
    model = tiny_target("llama", max_position_embeddings=CONTEXT)
    generator = SpeculativeGenerator(model, word_tokenizer(), tiny_drafter(model, block_size=4))
    return create_app(generator, model_id=MODEL, default_max_tokens=8, max_queue=2, max_batch=2, timeout=60)


# The schema the app serves at /openapi.json, read without starting the app (it starts with its first case, and
# stops after each operation's test).
APP = served_app()
schema = schemathesis.openapi.from_dict(APP.openapi())
schema.app = APP


@schema.hook
def flatmap_body(context: Any, body: Any) -> st.SearchStrategy:
    """A body as generated, or naming the served model (past the 404), or that and a well-formed conversation
    (so that the other fields it was generated with reach validation and generation)."""
    if not isinstance(body, dict) or "model" not in body:
        return st.just(body)
    served = {**body, "model": MODEL}
    fixed = {key: CONVERSATION[key] for key in ("messages", "input", "prompt") if key in body}
    return st.sampled_from([body, served, {**served, **fixed}] if fixed else [body, served])


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    lines = [
        f"  {label}: " + ", ".join(f"{k} {v}" for k, v in sorted(seen.items())) for label, seen in sorted(SEEN.items())
    ]
    total = sum(seen["cases"] for seen in SEEN.values())
    errors = sum(seen["5xx"] for seen in SEEN.values())
    print(f"\nfuzz: {total} cases over {len(SEEN)} operations, {errors} answered 5xx\n" + "\n".join(lines))


def check_error_shape(path: str, body: Any) -> None:
    """A 4xx body in the error shape of the API the path belongs to."""
    assert isinstance(body, dict), body
    if path.startswith("/v1/messages"):
        assert body.get("type") == "error" and set(body) == {"type", "error"}, body
        error = body["error"]
        assert isinstance(error, dict) and set(error) == {"type", "message"}, body
        assert isinstance(error["type"], str) and isinstance(error["message"], str) and error["message"], body
        return
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body


def check(case: Any) -> None:
    """Send one generated case: no 5xx, and a 4xx in its API's error shape."""
    phase = case.meta.phase.name.value if case.meta is not None else "?"
    mode = case.meta.generation.mode.value if case.meta is not None else "?"
    if phase == "coverage" and mode == "positive" and case.operation.path in WELL_FORMED:
        # the coverage phase's valid bodies try one field's edge values each (the others at their own edges, which
        # clash: max_tokens 0 without echo, a message without content): that field, in a well-formed request
        varied = re.match(r"Object with valid '([^']+)' value", case.meta.phase.data.description)
        field = {varied[1]: case.body[varied[1]]} if varied and isinstance(case.body, dict) else {}
        case.body = {**WELL_FORMED[case.operation.path], **field}
    response = case.call(headers={"Host": "localhost"})  # the ASGI client's own Host is "testserver"
    seen = SEEN[case.operation.label]
    seen["cases"] += 1
    seen[f"{phase} {mode}"] += 1
    seen[f"{response.status_code // 100}xx"] += 1
    assert response.status_code < 500, f"{case.operation.label} answered {response.status_code}: {response.text}"
    if 400 <= response.status_code < 500:
        check_error_shape(case.operation.path, response.json())


SETTINGS = settings(
    max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
OPERATIONS = sorted(result.ok().label for result in schema.get_all_operations())


# One test per operation, with the phases schemathesis's own pytest integration runs (its explicit examples, the
# coverage of each field's edge values, then fuzzing). Its `schema.parametrize()` is not used: under pytest 9 its
# items share one node id, and pytest-xdist then runs one operation of them all.
@pytest.mark.parametrize("label", OPERATIONS)
def test_no_5xx_and_errors_in_their_api_shape(label: str) -> None:
    method, path = label.split(" ", 1)
    (built,) = get_all_tests(
        schema=schema.include(method=method, path=path), test_func=check, settings=SETTINGS, given_kwargs=None
    )
    operation, run = built.ok()
    assert operation.label == label
    run()
    assert SEEN[label]["cases"] > 0
