"""Clients of one server, told apart by their API keys, live on localhost: a key's prompts restore only prefixes its
own requests left in the prefix cache (so its cached-token counts say nothing of another key's prompts), with the
outputs unchanged; a stored response is its key's (to another key, a 404 as for an id never stored); /health tells
a request without a valid key the status and the model only. Without keys the server is one client, as before."""

from __future__ import annotations

import json

import httpx
import pytest

from dflashkit.server import create_app
from tests.live_server import LiveServer, tiny_generator

MODEL = "tiny-llama"
KEY_A, KEY_B = "key-a", "key-b"
SETTINGS = {"proposal": "sample", "block_size": 4, "lookup": False}  # offline runs give the same tokens
UNKNOWN = "resp_" + "0" * 32  # the shape of a stored response's id, never stored


@pytest.fixture(scope="module")
def offline():
    return tiny_generator()


@pytest.fixture(scope="module")
def live():
    with LiveServer(create_app(tiny_generator(), model_id=MODEL, api_key=[KEY_A, KEY_B], **SETTINGS)) as server:
        yield server


def as_key(live: LiveServer, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.Client(base_url=live.url, headers=headers, timeout=60)


def complete(client: httpx.Client, prompt: str, max_tokens: int = 8) -> tuple[str, int]:
    """A greedy completion: its text and the prompt tokens the server restored from its prefix cache."""
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_key_restores_only_the_prefixes_of_its_own_requests(live, offline) -> None:
    """Two secret prompts sent with key A: key B sending the first again (a right guess) or the second with its last
    word changed (a wrong one) restores nothing either way, while A's own requests restore what they share with
    its earlier ones, and B's what it shares with B's. Every answer is the offline one, cached or not."""
    right = " ".join(f"w{i}" for i in range(60, 90))
    other = " ".join(f"w{i}" for i in range(100, 130))
    wrong = other.rsplit(" ", 1)[0] + " w131"
    a, b = as_key(live, KEY_A), as_key(live, KEY_B)
    expected = {p: offline.generate(p, chat=False, max_new_tokens=8, **SETTINGS).text for p in (right, other, wrong)}
    n = len(offline.encode_prompt(right, chat=False))
    assert len(offline.encode_prompt(wrong, chat=False)) == n

    assert complete(a, right) == (expected[right], 0)
    assert complete(a, other) == (expected[other], 0)
    assert complete(b, right) == (expected[right], 0)  # the right guess: nothing restored
    assert complete(b, wrong) == (expected[wrong], 0)  # the wrong one: nothing either
    assert complete(a, right) == (expected[right], n - 1)  # A's own: all but the last token restored
    assert complete(a, wrong) == (expected[wrong], n - 1)  # shares all but its last word with A's `other`
    assert complete(b, right) == (expected[right], n - 1)  # B's own earlier request: B's reuse works too


def test_a_stored_response_is_its_keys_alone(live) -> None:
    """Key B cannot read, list the input items of, continue or delete key A's stored response: each answer is the
    404 an unknown id gets (the same body but for the id), so B cannot even tell that it exists; A can do all of
    it."""
    a, b = as_key(live, KEY_A), as_key(live, KEY_B)
    created = a.post(
        "/v1/responses", json={"model": MODEL, "input": "w5 w6 w7 w8 w9 w10 w11 w12", "max_output_tokens": 4}
    )
    assert created.status_code == 200, created.text
    rid = created.json()["id"]
    assert len(rid) == len(UNKNOWN)

    def continued(client: httpx.Client, previous: str) -> httpx.Response:
        return client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "w8", "max_output_tokens": 2, "previous_response_id": previous},
        )

    calls = {
        "get": lambda client, i: client.get(f"/v1/responses/{i}"),
        "input_items": lambda client, i: client.get(f"/v1/responses/{i}/input_items"),
        "continue": continued,
        "delete": lambda client, i: client.delete(f"/v1/responses/{i}"),
    }
    for name, call in calls.items():
        foreign, unknown = call(b, rid), call(b, UNKNOWN)
        assert foreign.status_code == unknown.status_code == 404, name
        assert foreign.json() == json.loads(unknown.text.replace(UNKNOWN, rid)), name
        assert foreign.json()["error"]["code"] == "response_not_found", name

    assert a.get(f"/v1/responses/{rid}").json() == created.json()  # B's delete removed nothing
    (item,) = a.get(f"/v1/responses/{rid}/input_items").json()["data"]
    assert item["content"][0]["text"] == "w5 w6 w7 w8 w9 w10 w11 w12"
    follow = continued(a, rid)
    assert follow.status_code == 200 and follow.json()["previous_response_id"] == rid
    assert follow.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0  # A's turn restored for A
    assert a.delete(f"/v1/responses/{rid}").json() == {"id": rid, "object": "response", "deleted": True}
    assert a.get(f"/v1/responses/{rid}").status_code == 404


def test_health_without_a_valid_key_tells_only_status_and_model(live) -> None:
    """No key or a wrong one: {"status", "model"}, nothing of the queue, the prefix cache or the stored
    responses; either key: the full body."""
    for key in (None, "key-c"):
        r = as_key(live, key).get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok", "model": MODEL}, key
    for key in (KEY_A, KEY_B):
        full = as_key(live, key).get("/health").json()
        assert full["status"] == "ok" and full["model"] == MODEL and full["speculative"] is True
        assert {"queued", "running", "prefix_cache", "stored_responses"} <= full.keys()


def test_without_keys_every_client_is_one(offline) -> None:
    """A server without keys is one tenant, as a local server for one user should be: a prompt another
    connection sent restores its prefix, a response one stored another reads, and /health is the full one."""
    with LiveServer(create_app(tiny_generator(), model_id=MODEL, **SETTINGS)) as server:
        prompt = " ".join(f"w{i}" for i in range(20, 40))
        n = len(offline.encode_prompt(prompt, chat=False))
        expected = offline.generate(prompt, chat=False, max_new_tokens=8, **SETTINGS).text
        with as_key(server, None) as one, as_key(server, None) as two:
            assert complete(one, prompt) == (expected, 0)
            assert complete(two, prompt) == (expected, n - 1)
            rid = one.post("/v1/responses", json={"model": MODEL, "input": "w5", "max_output_tokens": 2}).json()["id"]
            assert two.get(f"/v1/responses/{rid}").status_code == 200
            health = two.get("/health").json()
            assert health["stored_responses"] == 1 and health["prefix_cache"]["hits"] == 1
