"""/metrics tells how requests and generations ended, live on localhost: a dropped stream is a 499 (not a 200),
a request refused because the queue is full is counted as shed, and each generation outcome has its own label."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflashkit.server import create_app
from dflashkit.server.metrics import OUTCOMES
from tests.live_server import LiveServer, metric, tiny_generator, wait_until

MODEL = "tiny-llama"
# Greedy, the tiny target repeats its last prompt token and never ends early: 500 one-token steps (~1 s)
LONG = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 500, "temperature": 0.0}
LONG_MESSAGE = {
    "model": MODEL,
    "max_tokens": 500,
    "temperature": 0.0,
    "messages": [{"role": "user", "content": "w5 w6 w7"}],
}


def requests(url: str, endpoint: str, status: str) -> float:
    return metric(url, "dflashkit_requests_total", endpoint=endpoint, status=status)


@pytest.fixture
def live():
    """One generation at a time, none waiting: a running stream holds the only place."""
    app = create_app(tiny_generator(), model_id=MODEL, max_batch=1, max_queue=0)
    with LiveServer(app) as server:
        yield server


def test_dropped_streams_count_as_499_and_finished_ones_by_status(live) -> None:
    with httpx.Client(base_url=live.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 3, "stream": True}) as whole:
            assert whole.status_code == 200 and list(whole.iter_lines())[-2:] == ["data: [DONE]", ""]
        for path, body in (("/v1/completions", LONG), ("/v1/messages", LONG_MESSAGE)):
            with http.stream("POST", path, json={**body, "stream": True}) as dropped:
                lines = dropped.iter_lines()  # kept: dropping the iterator closes the response
                assert dropped.status_code == 200 and next(lines)
            # the client closed the connection mid-answer: the request is the client's 499, its generation cancelled
            wait_until(lambda path=path: requests(live.url, path, "499") == 1)
        wait_until(lambda: metric(live.url, "dflashkit_generations_total", outcome="cancelled") == 2)
        # a client that gives up waiting for a whole (non-streamed) answer is a 499 too
        with httpx.Client(base_url=live.url, timeout=0.3) as impatient, pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json=LONG)
        wait_until(lambda: requests(live.url, "/v1/completions", "499") == 2)
        wait_until(lambda: metric(live.url, "dflashkit_generations_total", outcome="cancelled") == 3)
    assert requests(live.url, "/v1/completions", "200") == 1  # the stream read to its end, only
    assert requests(live.url, "/v1/messages", "200") == 0
    assert metric(live.url, "dflashkit_generations_total", outcome="length") == 1


def test_a_full_queue_counts_as_shed(live) -> None:
    with httpx.Client(base_url=live.url, timeout=60) as http:
        assert metric(live.url, "dflashkit_requests_shed_total", endpoint="/v1/completions") == 0
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
            lines = running.iter_lines()
            next(lines)
            for path, body in (("/v1/completions", LONG), ("/v1/messages", LONG_MESSAGE), ("/v1/completions", LONG)):
                refused = http.post(path, json=body)
                assert refused.status_code == 429, refused.text
            assert metric(live.url, "dflashkit_requests_shed_total", endpoint="/v1/completions") == 2
            assert metric(live.url, "dflashkit_requests_shed_total", endpoint="/v1/messages") == 1
            assert requests(live.url, "/v1/completions", "429") == 2
        # a refusal of another kind is not shedding
        assert http.post("/v1/completions", json={**LONG, "model": "nope"}).status_code == 404
        assert metric(live.url, "dflashkit_requests_shed_total", endpoint="/v1/completions") == 2


def test_every_generation_outcome_has_its_label_from_the_start() -> None:
    app = create_app(tiny_generator(), model_id=MODEL, timeout=0.5)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
        generations = families["dflashkit_generations"]
        shown = {s.labels["outcome"]: s.value for s in generations.samples if s.name == "dflashkit_generations_total"}
        assert shown == dict.fromkeys(OUTCOMES, 0.0)
        assert {"cancelled", "timeout", "error", "shutdown", "drained"} <= set(OUTCOMES)
        assert all(f"{outcome}: " in generations.documentation for outcome in OUTCOMES)
        assert "max-batch" in families["dflashkit_requests_running"].documentation

        # each way a generation ends lands on its own label (the long one first: it also warms the engine up)
        assert http.post("/v1/completions", json={**LONG, "max_tokens": 509}).status_code == 504  # ~1 s > 0.5 s
        assert http.post("/v1/completions", json={**LONG, "max_tokens": 2}).status_code == 200
        stopped = http.post("/v1/completions", json={**LONG, "stop": ["w7"]})  # greedy: it repeats w7 at once
        assert stopped.status_code == 200 and stopped.json()["choices"][0]["finish_reason"] == "stop"

        def fail(plan, job=0, batch=None):
            raise RuntimeError("the engine broke")

        app.state.service._start = fail
        failed = http.post("/v1/completions", json=LONG)
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        expected = {"length": 1, "stop": 1, "timeout": 1, "error": 1}
        wait_until(
            lambda: all(metric(live.url, "dflashkit_generations_total", outcome=o) == n for o, n in expected.items())
        )
        assert metric(live.url, "dflashkit_generations_total", outcome="cancelled") == 0
        assert requests(live.url, "/v1/completions", "504") == 1
        assert requests(live.url, "/v1/completions", "500") == 1


def test_parameterised_routes_are_counted_by_their_template(live) -> None:
    """One label per route, never per id: a request for a stored response counts under the route's template;
    a path no route serves under `other`."""
    assert httpx.get(live.url + "/v1/responses/resp_nothing").status_code == 404
    assert httpx.get(live.url + "/v1/responses/resp_other").status_code == 404
    assert httpx.get(live.url + "/no/such/path").status_code == 404
    assert requests(live.url, "/v1/responses/{response_id}", "404") == 2
    assert requests(live.url, "other", "404") == 1
