"""The OpenAI-compatible server, live on localhost, driven by the official `openai` client (and httpx for raw
HTTP): outputs equal offline generation, usage carries consistent speculative stats, concurrent clients get
their own outputs, bad input gets OpenAI-style 4xx errors, queue limits, cancellation, timeouts, metrics."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from dflashkit import Grammar
from dflashkit.errors import InvalidInputError
from dflashkit.kernels import row_kernels
from dflashkit.server import create_app
from dflashkit.tool_calls import ToolRequest, parse_tool_calls
from tests.live_server import LiveServer, metric, tiny_byte_generator, tiny_generator, tool_generator, wait_until

MODEL = "tiny-llama"
SAMPLED = {"temperature": 1.0, "seed": 3, "max_tokens": 40}


@pytest.fixture(scope="module")
def offline():
    """A second, identical generator for reference runs (never used concurrently with the server's)."""
    return tiny_generator()


@pytest.fixture(scope="module")
def server():
    # "sample" proposals: the random drafter gets drafts accepted when sampling, so the stats are not trivial;
    # a fixed block and no prompt lookup, so the speculative stats equal the offline run's (not timing-dependent)
    with LiveServer(
        create_app(tiny_generator(), model_id=MODEL, proposal="sample", block_size=4, lookup=False)
    ) as live:
        yield live


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(offline, prompt: str, chat: bool, *, temperature: float, seed: int | None, max_tokens: int, **kw):
    messages = [{"role": "user", "content": prompt}]
    return offline.generate(
        messages if chat else prompt,
        chat=chat,
        temperature=temperature,
        seed=seed,
        max_new_tokens=max_tokens,
        proposal="sample",
        **{"block_size": 4, "lookup": False, **kw},
    )


def check_usage(usage: Any, expected) -> None:
    """usage = the offline run's token counts and speculative stats, and internally consistent."""
    spec = usage.model_extra["speculative"]
    s = expected.stats
    assert usage.prompt_tokens == expected.prompt_tokens
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert spec["drafting_steps"] == s.steps > 0
    assert spec["mean_acceptance_length"] == pytest.approx(s.tau)
    assert spec["accepted_per_position"] == s.accepted_per_position
    assert spec["drafted_per_position"] == s.drafted_per_position
    assert spec["block_size"] == 4 and len(spec["accepted_per_position"]) == 3
    assert spec["accepted_tokens"] == sum(spec["accepted_per_position"])
    assert spec["draft_tokens"] == sum(spec["drafted_per_position"]) >= spec["accepted_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(spec["accepted_tokens"] / spec["drafting_steps"] + 1)
    # every step emits its accepted drafts + the target's token; the prefill emits one (stop may cut the last)
    assert usage.completion_tokens <= 1 + spec["drafting_steps"] + spec["accepted_tokens"]
    if expected.finish_reason == "length":
        assert usage.completion_tokens == 1 + spec["drafting_steps"] + spec["accepted_tokens"]
    assert spec["tokens_per_s"] > 0


# ---- the OpenAI client: chat and completions, streaming and not ---------------------------------------------


def test_models_and_health(server, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(server.url + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["model"] == MODEL and health["speculative"] is True
    assert health["block_size"] == 4 and health["context_length"] == 512


@pytest.mark.parametrize("seed", [3, 8])
def test_chat_equals_offline(client, offline, seed) -> None:
    expected = reference(offline, "w5 w6 w7", True, **{**SAMPLED, "seed": seed})
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w5 w6 w7"}], **{**SAMPLED, "seed": seed}
    )
    assert resp.object == "chat.completion" and resp.model == MODEL
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text and expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    check_usage(resp.usage, expected)
    assert expected.stats.steps > 0 and sum(expected.stats.accepted_lengths) > 0  # drafts were accepted


def test_completion_equals_offline(client, offline) -> None:
    expected = reference(offline, "w9 w30 w31", False, **SAMPLED)
    resp = client.completions.create(model=MODEL, prompt="w9 w30 w31", **SAMPLED)
    assert resp.object == "text_completion"
    assert resp.choices[0].text == expected.text and resp.choices[0].finish_reason == expected.finish_reason
    check_usage(resp.usage, expected)
    # the prompt as token ids gives the same
    ids = offline.tokenizer.encode("w9 w30 w31")
    assert client.completions.create(model=MODEL, prompt=ids, **SAMPLED).choices[0].text == expected.text


def test_chat_stream(client, offline) -> None:
    expected = reference(offline, "w40 w41", True, **SAMPLED)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w40 w41"}], stream=True, **SAMPLED
        )
    )
    assert len(chunks) > 3 and len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected.text
    # usage (with the speculative stats) and finish_reason arrive on the final chunk only
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage is not None
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [expected.finish_reason]
    check_usage(chunks[-1].usage, expected)


def test_completion_stream(client, offline) -> None:
    expected = reference(offline, "w9 w30 w31", False, **SAMPLED)
    chunks = list(client.completions.create(model=MODEL, prompt="w9 w30 w31", stream=True, **SAMPLED))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert sum(bool(c.choices[0].text) for c in chunks) > 3  # it did stream in pieces
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    check_usage(chunks[-1].usage, expected)


def test_greedy_equals_offline(client, offline) -> None:
    expected = reference(offline, "w5 w6 w7", True, temperature=0.0, seed=None, max_tokens=12)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w5 w6 w7"}], temperature=0, max_tokens=12
    )
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.completion_tokens == 12 and resp.choices[0].finish_reason == "length"


def test_stop_and_sampling_options(client, offline) -> None:
    free = reference(offline, "w5 w6 w7", True, **SAMPLED)
    words = free.text.split(" ")
    # the first word from the fourth on whose text (with its space) occurs there first
    i = next(i for i in range(3, len(words)) if free.text.find(" " + words[i]) == len(" ".join(words[:i])))
    stop = " " + words[i]
    expected = reference(offline, "w5 w6 w7", True, **SAMPLED, stop=[stop])
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w5 w6 w7"}], stop=stop, **SAMPLED
    )
    assert resp.choices[0].message.content == expected.text == " ".join(words[:i])
    assert resp.choices[0].finish_reason == "stop"
    # top_k / top_p reach the sampler: the same as offline with the same settings
    expected = reference(offline, "w5 w6 w7", True, **SAMPLED, top_k=5, top_p=0.9)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w5 w6 w7"}], top_p=0.9, extra_body={"top_k": 5}, **SAMPLED
    )
    assert resp.choices[0].message.content == expected.text


def test_token_origins(client, offline) -> None:
    """The extension used by the playground: every token with its text and origin (drafter or target)."""
    expected = reference(offline, "w5 w6 w7", True, **SAMPLED)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w5 w6 w7"}], extra_body={"token_origins": True}, **SAMPLED
    )
    origins = resp.choices[0].model_extra["token_origins"]
    assert [t["id"] for t in origins] == expected.token_ids
    assert [t["from_draft"] for t in origins] == expected.from_draft and any(expected.from_draft)
    assert "".join(t["text"] for t in origins) == expected.text
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "w5 w6 w7"}],
            stream=True,
            extra_body={"token_origins": True},
            **SAMPLED,
        )
    )
    streamed = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_origins", [])]
    assert streamed == origins
    for c in chunks:
        pieces = (c.choices[0].model_extra or {}).get("token_origins", [])
        assert "".join(t["text"] for t in pieces) == (c.choices[0].delta.content or "")


def test_logprobs_equal_offline_in_chat_and_completions(client, offline) -> None:
    """Chat's logprobs.content and the legacy completions object carry the offline run's log-probabilities."""
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    expected = reference(offline, "w5 w6 w7", True, logprobs=3, **SAMPLED)

    def check_entry(entry, lp) -> None:
        raw = offline.token_bytes(lp.token_id)
        assert (entry.token, entry.bytes) == (raw.decode(), list(raw))
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-6)
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (offline.token_bytes(i).decode(), pytest.approx(v, abs=1e-6)) for i, v in lp.top
        ]

    resp = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=3, **SAMPLED)
    content = resp.choices[0].logprobs.content
    assert resp.choices[0].message.content == expected.text and len(content) == len(expected.token_ids)
    for entry, lp in zip(content, expected.logprobs):
        check_entry(entry, lp)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, logprobs=True, top_logprobs=3, stream=True, **SAMPLED
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, **SAMPLED)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[]] * len(content)
    assert client.chat.completions.create(model=MODEL, messages=messages, **SAMPLED).choices[0].logprobs is None

    expected = reference(offline, "w5 w6 w7", False, logprobs=2, **SAMPLED)
    resp = client.completions.create(model=MODEL, prompt="w5 w6 w7", logprobs=2, **SAMPLED)
    legacy = resp.choices[0].logprobs
    assert legacy.tokens == [offline.token_bytes(t).decode() for t in expected.token_ids]
    assert legacy.token_logprobs == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-6)
    assert [len(d) for d in legacy.top_logprobs] == [
        len({offline.token_bytes(i) for i, _ in lp.top}) for lp in expected.logprobs
    ]
    released = [len(piece) for piece in _token_texts(offline, "w5 w6 w7")]
    assert len(released) == len(expected.token_ids)
    assert legacy.text_offset == [sum(released[:i]) for i in range(len(released))]
    streamed = [
        t
        for c in client.completions.create(model=MODEL, prompt="w5 w6 w7", logprobs=2, stream=True, **SAMPLED)
        if c.choices[0].logprobs
        for t in c.choices[0].logprobs.text_offset
    ]
    assert streamed == legacy.text_offset


def test_echo_returns_the_prompt_and_its_logprobs_for_scoring(client, offline) -> None:
    """completions echo (as lm-evaluation-harness scores text: echo, logprobs 1, max_tokens 1): the prompt
    before the completion, its tokens' logprobs from one forward of the target (the first: null)."""
    import torch

    prompt = "w9 w30 w31 w5"
    ids = offline.tokenizer.encode(prompt)
    expected = reference(offline, prompt, False, temperature=0.0, seed=None, max_tokens=1, logprobs=1)
    resp = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    choice = resp.choices[0]
    assert choice.text == prompt + expected.text
    lp = choice.logprobs
    assert lp.tokens == [offline.token_bytes(t).decode() for t in ids + expected.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(offline.model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(
        [float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)], abs=1e-5
    )
    assert lp.token_logprobs[len(ids)] == pytest.approx(expected.logprobs[0].logprob, abs=1e-6)
    assert all(len(d) == 1 for d in lp.top_logprobs[1:])
    offsets = lp.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[len(ids)] == len(prompt)
    words = prompt.split()
    assert [choice.text[o:].lstrip()[: len(w)] for o, w in zip(offsets, words)] == words
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [
        t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs
    ] == lp.token_logprobs
    plain = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=3, temperature=0)
    assert plain.choices[0].text.startswith(offline.tokenizer.decode(ids)) and plain.choices[0].logprobs is None
    scored = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0  # nothing generated
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
    assert scored.choices[0].logprobs.text_offset == offsets[: len(ids)]
    r = httpx.post(
        f"{client.base_url}completions", timeout=30, json={"model": MODEL, "prompt": prompt, "max_tokens": 0}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def _token_texts(offline, prompt: str) -> list[str]:
    """The text each token of the offline completion released (the pieces of its stream)."""
    stream = offline.stream(
        prompt,
        chat=False,
        proposal="sample",
        max_new_tokens=SAMPLED["max_tokens"],
        temperature=SAMPLED["temperature"],
        seed=SAMPLED["seed"],
    )
    return [piece for delta in stream for piece in delta.token_text]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0, "seed": None}, {"temperature": 1.0, "seed": 5}])
def test_penalties_and_logit_bias_equal_offline(client, offline, sampling) -> None:
    adjust = {"presence_penalty": 0.5, "frequency_penalty": 1.5, "repetition_penalty": 1.3}
    expected = reference(offline, "w5 w6 w7", True, max_tokens=30, **sampling, **adjust, logit_bias={8: 2.0})
    plain = reference(offline, "w5 w6 w7", True, max_tokens=30, **sampling)
    assert expected.text != plain.text  # the adjustments change the output
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "w5 w6 w7"}],
        max_tokens=30,
        logit_bias={"8": 2.0},
        **sampling,
        presence_penalty=0.5,
        frequency_penalty=1.5,
        extra_body={"repetition_penalty": 1.3},
    )
    assert resp.choices[0].message.content == expected.text


def test_n_choices_are_generations_with_consecutive_seeds(client, offline) -> None:
    """n choices: choice i is the offline generation with seed + i (0: the request's own seed); usage counts
    the prompt once and every choice's tokens and steps; streamed, each choice in turn with its index."""
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    expected = [
        reference(offline, "w5 w6 w7", True, logprobs=1, **{**SAMPLED, "seed": SAMPLED["seed"] + i}) for i in range(3)
    ]
    assert len({e.text for e in expected}) == 3
    resp = client.chat.completions.create(model=MODEL, messages=messages, n=3, logprobs=True, top_logprobs=1, **SAMPLED)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.message.content for c in resp.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in resp.choices] == [e.finish_reason for e in expected]
    for choice, e in zip(resp.choices, expected):
        assert [x.logprob for x in choice.logprobs.content] == pytest.approx([lp.logprob for lp in e.logprobs])
    u, spec = resp.usage, resp.usage.model_extra["speculative"]
    assert u.prompt_tokens == expected[0].prompt_tokens
    assert u.completion_tokens == sum(len(e.token_ids) for e in expected)
    assert spec["drafting_steps"] == sum(e.stats.steps for e in expected)
    assert spec["accepted_tokens"] == sum(sum(e.stats.accepted_lengths) for e in expected)
    assert spec["accepted_per_position"] == [sum(c) for c in zip(*(e.stats.accepted_per_position for e in expected))]

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, n=3, stream=True, **SAMPLED))
    for i, e in enumerate(expected):
        mine = [c for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in mine) == e.text
        assert [c.choices[0].finish_reason for c in mine][-1] == e.finish_reason
    indices = [c.choices[0].index for c in chunks]
    assert indices == sorted(indices)  # one choice after another
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].usage.completion_tokens == u.completion_tokens

    texts = client.completions.create(model=MODEL, prompt="w9 w30", n=2, max_tokens=8, temperature=0)
    assert texts.choices[0].text == texts.choices[1].text  # greedy: the same choice twice
    assert texts.choices[0].text == reference(offline, "w9 w30", False, temperature=0, seed=None, max_tokens=8).text


def test_best_of_returns_the_candidates_of_highest_logprob_per_token(client, offline) -> None:
    candidates = [
        reference(offline, "w5 w6 w7", False, logprobs=0, **{**SAMPLED, "seed": SAMPLED["seed"] + i}) for i in range(4)
    ]
    scores = [sum(lp.logprob for lp in c.logprobs) / len(c.logprobs) for c in candidates]
    ranked = sorted(range(4), key=lambda i: -scores[i])
    assert len({c.text for c in candidates}) == 4 and ranked[0] != 0  # the best is not simply the first
    resp = client.completions.create(model=MODEL, prompt="w5 w6 w7", best_of=4, n=2, **SAMPLED)
    assert [c.text for c in resp.choices] == [candidates[i].text for i in ranked[:2]]
    assert [c.index for c in resp.choices] == [0, 1] and all(c.logprobs is None for c in resp.choices)
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for c in candidates)  # every candidate was run
    with_logprobs = client.completions.create(model=MODEL, prompt="w5 w6 w7", best_of=4, logprobs=1, **SAMPLED)
    assert with_logprobs.choices[0].text == candidates[ranked[0]].text
    assert len(with_logprobs.choices[0].logprobs.tokens) == len(candidates[ranked[0]].token_ids)


def test_several_prompts_in_one_completions_request(client, offline) -> None:
    """A list of prompts (texts or token-id lists): prompt p's choice i has index p * n + i, and equals the
    offline generation of that prompt with seed + i; usage counts every prompt once; echo puts each prompt first."""
    texts = ["w5 w6 w7", "w20 w21"]
    expected = [
        [reference(offline, t, False, **{**SAMPLED, "seed": SAMPLED["seed"] + i}) for i in range(2)] for t in texts
    ]
    for prompt in (texts, [offline.tokenizer.encode(t) for t in texts]):
        resp = client.completions.create(model=MODEL, prompt=prompt, n=2, **SAMPLED)
        assert [c.index for c in resp.choices] == [0, 1, 2, 3]
        assert [c.text for c in resp.choices] == [e.text for per_prompt in expected for e in per_prompt]
        assert resp.usage.prompt_tokens == sum(e[0].prompt_tokens for e in expected)
        assert resp.usage.completion_tokens == sum(len(e.token_ids) for per_prompt in expected for e in per_prompt)
    chunks = list(client.completions.create(model=MODEL, prompt=texts, stream=True, echo=True, **SAMPLED))
    for index, text in enumerate(texts):
        streamed = "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index)
        assert streamed == text + expected[index][0].text


def test_more_choices_than_the_queue_holds_are_refused() -> None:
    with LiveServer(create_app(tiny_generator(), model_id=MODEL, max_batch=1, max_queue=1)) as live:
        r = httpx.post(live.url + "/v1/chat/completions", json={**CHAT, "n": 3, "max_tokens": 2}, timeout=30)
        assert (
            r.status_code == 400 and r.json()["error"]["param"] == "n" and "max-queue" in r.json()["error"]["message"]
        )
        r = httpx.post(live.url + "/v1/chat/completions", json={**CHAT, "n": 2, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2


# ---- many clients at once -----------------------------------------------------------------------------------


def test_next_turn_restores_the_cached_prefix(offline) -> None:
    """A prompt that continues an earlier one (its prompt + answer + more, a chat's next turn) prefills only its new
    tokens: usage.prompt_tokens_details.cached_tokens counts the rest, /health and /metrics the reuse; the answer is
    the offline one; "cache_prompt": false opts a request out; a non-boolean is a 400."""
    with LiveServer(create_app(tiny_generator(), model_id=MODEL, max_batch=1)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        first = "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14"
        one = client.completions.create(model=MODEL, prompt=first, temperature=0, max_tokens=16)
        assert one.usage.prompt_tokens_details.cached_tokens == 0
        second = f"{first} {one.choices[0].text} w20 w21"
        expected = offline.generate(second, chat=False, max_new_tokens=16)
        two = client.completions.create(model=MODEL, prompt=second, temperature=0, max_tokens=16)
        cached = two.usage.prompt_tokens_details.cached_tokens
        ids1, ids2 = offline.tokenizer.encode(first), offline.tokenizer.encode(second)
        assert len(ids1) + len(offline.tokenizer.encode(one.choices[0].text)) - 1 <= cached < len(ids2)
        assert two.choices[0].text == expected.text
        health = httpx.get(live.url + "/health", timeout=30).json()["prefix_cache"]
        assert health["hits"] == 1 and health["reused_tokens"] == cached and health["sequences"] == 1
        off = client.completions.create(
            model=MODEL, prompt=second, temperature=0, max_tokens=16, extra_body={"cache_prompt": False}
        )
        assert off.usage.prompt_tokens_details.cached_tokens == 0 and off.choices[0].text == expected.text
        metrics = httpx.get(live.url + "/metrics", timeout=30).text
        assert f"dflashkit_prompt_tokens_cached_total {float(cached)}" in metrics
        bad = httpx.post(
            live.url + "/v1/completions", json={"model": MODEL, "prompt": "w5", "cache_prompt": "no"}, timeout=30
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_prompt"
    with LiveServer(create_app(tiny_generator(), model_id=MODEL, prefix_cache_mb=0)) as live:
        assert httpx.get(live.url + "/health", timeout=30).json()["prefix_cache"] is None
    with pytest.raises(InvalidInputError, match="MiB"):
        create_app(tiny_generator(), model_id=MODEL, prefix_cache_mb=-1)


def test_concurrent_clients_get_their_own_outputs(server, client, offline) -> None:
    cases = [("w5 w6 w7", s) for s in range(1, 4)] + [("w20 w21", s) for s in range(4, 7)]
    n = len(cases)
    expected = [reference(offline, p, True, temperature=1.0, seed=s, max_tokens=60) for p, s in cases]
    assert len({e.text for e in expected}) == n  # distinct answers: mixing would show
    barrier = threading.Barrier(n)
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * n

    def ask(i: int) -> str:
        prompt, seed = cases[i]
        barrier.wait()
        start = time.monotonic()
        kwargs = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 60,
        }
        if i % 2:
            text = "".join(
                c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
            )
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        spans[i] = (start, time.monotonic())
        return text

    with ThreadPoolExecutor(n) as pool:
        texts = list(pool.map(ask, range(n)))
    assert texts == [e.text for e in expected]
    assert max(s for s, _ in spans) < min(e for _, e in spans)  # all were in flight together


def test_batched_server_gives_every_client_its_own_output() -> None:
    """--max-batch 3: six clients at once (greedy and seeded sampling, streamed and not, one asking n=2) get the
    outputs of offline generation, while up to three generations run together, their target passes batched (bf16
    on the CPU row kernels where they run: one pass per round; elsewhere the calls of a round run in turn)."""
    dtype = torch.bfloat16 if row_kernels.kernel() is not None else torch.float32
    offline = tiny_generator(dtype=dtype)
    # the default adaptive block size and prompt lookup: an adaptive policy learns from every request (and from
    # timing), but seeded requests sample with the coupled sampler, whose output is the seed's whatever the blocks
    app = create_app(tiny_generator(dtype=dtype), model_id=MODEL, proposal="sample", max_batch=3)
    cases = [
        ("w5 w6 w7", 1.0, 1),
        ("w20 w21", 0.0, None),
        ("w9 w9 w10", 1.0, 2),
        ("w30", 0.7, 3),
        ("w40 w41 w42 w43", 0.0, None),
        ("w11 w12", 1.0, 4),
    ]
    lengths = [40, 25, 33, 50, 12, 44]
    expected = [
        reference(offline, p, True, temperature=t, seed=s, max_tokens=n, lookup=True)
        for (p, t, s), n in zip(cases, lengths)
    ]
    extra = reference(offline, "w5 w6", True, temperature=1.0, seed=8, max_tokens=20, lookup=True)
    with LiveServer(app) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert httpx.get(live.url + "/health", timeout=30).json()["max_batch"] == 3
        barrier = threading.Barrier(len(cases))
        seen_running: list[int] = []

        def ask(i: int) -> str:
            (prompt, temperature, seed), n = cases[i], lengths[i]
            kwargs = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": temperature,
                "seed": seed,
                "max_tokens": n,
            }
            barrier.wait()
            seen_running.append(app.state.scheduler.running)
            if i % 2:
                return "".join(
                    c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                )
            return client.chat.completions.create(**kwargs).choices[0].message.content

        with ThreadPoolExecutor(len(cases)) as pool:
            texts = list(pool.map(ask, range(len(cases))))
        assert texts == [e.text for e in expected]
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w5 w6"}], n=2, seed=8, temperature=1.0, max_tokens=20
        )
        assert r.choices[0].message.content == extra.text
        batcher = app.state.scheduler.batcher
        assert batcher.passes < batcher.calls  # rounds held several generations' calls
        assert max(seen_running) <= 3
    with pytest.raises(InvalidInputError, match="max_batch"):
        create_app(offline, model_id=MODEL, max_batch=0)


# ---- bad input ----------------------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}]}
LONG_PROMPT = " ".join(["w5"] * 600)  # 600 tokens > the tiny target's 512 positions
BAD = [
    ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": [', 400, None, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, None, None),
    # a lone surrogate escaped in the JSON (valid JSON, not valid Unicode text)
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "w5 \\ud800"}', 400, "prompt", None),
    (
        "/v1/chat/completions",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "messages",
        None,
    ),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "\\udc80", "stream": true}', 400, "prompt", None),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "w5"}', 404, "model", "model_not_found"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "ten"}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -5}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**12}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature", None),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature", None),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p", None),
    ("/v1/chat/completions", {**CHAT, "seed": 1.5}, 400, "seed", None),
    ("/v1/chat/completions", {**CHAT, "seed": 2**64}, 400, "seed", None),
    ("/v1/chat/completions", {**CHAT, "stop": 7}, 400, "stop", None),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),  # at most 4
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream", None),
    ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "n", None),
    ("/v1/chat/completions", {**CHAT, "n": 17}, 400, "n", None),  # at most 16
    ("/v1/chat/completions", {**CHAT, "best_of": 3}, 400, "best_of", "unsupported_parameter"),  # completions only
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "best_of": 2, "n": 3}, 400, "best_of", None),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "best_of": 3, "stream": True}, 400, "best_of", None),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "best_of": 17}, 400, "best_of", None),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 2.5}, 400, "presence_penalty", None),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": "high"}, 400, "frequency_penalty", None),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"w5": 3}}, 400, "logit_bias", None),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"96": 1}}, 400, "logit_bias", None),  # outside the vocabulary
    ("/v1/chat/completions", {**CHAT, "messages": "w5"}, 400, "messages", None),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "w5"}]}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": CHAT["messages"]}, 400, "model", "missing"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-7"}, 404, "model", "model_not_found"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": LONG_PROMPT}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 96]}, 400, "prompt", None),  # id outside the vocabulary
    ("/v1/completions", {"model": MODEL, "prompt": ["w5"] * 17}, 400, "prompt", None),  # at most 16 prompts
    ("/v1/completions", {"model": MODEL, "prompt": [[5], []]}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": [[5], [5, 96]]}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": [[5], "w6"]}, 400, "prompt", None),  # one kind per request
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "suffix": "w6"}, 400, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "echo": "yes"}, 400, "echo", None),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),  # needs logprobs: true
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {**CHAT, "logprobs": 3}, 400, "logprobs", None),  # chat: a boolean
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "logprobs": -1}, 400, "logprobs", None),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "logprobs": True}, 400, "logprobs", None),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "w5", "top_logprobs": 2},
        400,
        "top_logprobs",
        "unsupported_parameter",
    ),
    ("/v1/completions", {"model": "gpt-7", "prompt": "w5"}, 404, "model", "model_not_found"),
    # tools: this tiny target's tokenizer has no chat template that shows tools
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", None),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice", None),  # no tools
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"},
        400,
        "tool_choice",
        None,
    ),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "code_interpreter"}]}, 400, "tools", None),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, 400, "functions", "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "tool_call_id": "c1"}]}, 400, "messages", None),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_gets_openai_error(server, path, body, status, param, code) -> None:
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(server.url + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_server_keeps_serving_after_errors(server, client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-7", messages=[{"role": "user", "content": "w5"}])
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt=LONG_PROMPT)
    for path in ("/nowhere", "/v1/nowhere"):
        r = httpx.get(server.url + path, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["message"]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=3, temperature=0
    )  # greedy: a sampled reply may end within 3 tokens
    assert resp.usage.completion_tokens == 3


def test_null_fields_mean_defaults(server) -> None:
    body = {
        **CHAT,
        "max_tokens": 3,
        "temperature": None,
        "top_p": None,
        "n": None,
        "stop": None,
        "seed": None,
        "stream": None,
        "logprobs": None,
        "presence_penalty": None,
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    # temperature null = the default, 1: sampled, so the tiny target may end its turn within its 3 tokens (the end
    # token counts as a completion token: 3 tokens may still finish with "stop")
    reply = r.json()
    tokens, reason = reply["usage"]["completion_tokens"], reply["choices"][0]["finish_reason"]
    assert reply["object"] == "chat.completion" and 1 <= tokens <= 3 and reason in ("stop", "length")
    assert tokens == 3 or reason == "stop"


# ---- queue, cancellation, timeouts --------------------------------------------------------------------------


# Greedy, the tiny target repeats its last prompt token and never ends early: 500 one-token steps (~1 s)
LONG = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 500, "temperature": 0.0}


def test_full_queue_answers_429_and_disconnect_cancels() -> None:
    # one generation at a time (max_batch 1): which requests run and which wait is then known
    app = create_app(tiny_generator(), model_id=MODEL, max_batch=1, max_queue=1)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        scheduler = app.state.scheduler
        # A streams a long generation; read one chunk so that it is running
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as a:
            lines = a.iter_lines()  # kept: dropping the iterator closes the response
            next(lines)
            assert scheduler.running == 1
            # B waits in the queue (max_queue=1) ...
            b_result: dict[str, Any] = {}
            b = threading.Thread(
                target=lambda: b_result.update(
                    r=httpx.post(live.url + "/v1/completions", json={**LONG, "max_tokens": 5}, timeout=60)
                )
            )
            b.start()
            wait_until(lambda: scheduler.queued == 1)
            # ... so C is refused at once, with Retry-After
            c = http.post("/v1/completions", json={**LONG, "max_tokens": 5})
            assert c.status_code == 429 and int(c.headers["Retry-After"]) >= 1
            assert c.json()["error"]["type"] == "rate_limit_error" and c.json()["error"]["code"] == "queue_full"
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0).completions.create(
                    model=MODEL, prompt="w5", max_tokens=2
                )
        # A's client went away: its generation is cancelled long before its 500 tokens, and B is served
        b.join(60)
        assert b_result["r"].status_code == 200 and b_result["r"].json()["usage"]["completion_tokens"] == 5
        wait_until(lambda: metric(live.url, "dflashkit_generations_total", outcome="cancelled") == 1)
        assert metric(live.url, "dflashkit_completion_tokens_total") < 500 + 5
        assert metric(live.url, "dflashkit_requests_total", endpoint="/v1/completions", status="429") == 2


def test_choices_take_queue_places_together_and_a_disconnect_cancels_them_all() -> None:
    app = create_app(tiny_generator(), model_id=MODEL, max_batch=1, max_queue=2)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        scheduler = app.state.scheduler
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True, "n": 2}) as a:
            lines = a.iter_lines()
            next(lines)
            assert scheduler.running == 1 and scheduler.queued == 1  # choice 1 waits behind choice 0
            c = http.post("/v1/completions", json={**LONG, "max_tokens": 5, "n": 2})  # 2 + 2 > 3 places
            assert c.status_code == 429
            assert scheduler.queued == 1  # all or none: nothing of the refused request was queued
        wait_until(lambda: metric(live.url, "dflashkit_generations_total", outcome="cancelled") == 2)
        assert metric(live.url, "dflashkit_completion_tokens_total") < 500
        r = http.post("/v1/completions", json={**LONG, "max_tokens": 5, "n": 3})
        assert r.status_code == 200 and [len(c["text"].split()) for c in r.json()["choices"]] == [5, 5, 5]


def test_client_that_disconnects_while_queued_is_dropped() -> None:
    app = create_app(tiny_generator(), model_id=MODEL, max_batch=1, max_queue=4)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as a:
            lines = a.iter_lines()  # kept: dropping the iterator closes the response
            next(lines)
            # a non-streaming client gives up while queued
            with httpx.Client(base_url=live.url, timeout=0.3) as impatient, pytest.raises(httpx.ReadTimeout):
                impatient.post("/v1/completions", json=LONG)
            wait_until(lambda: app.state.scheduler.queued == 0)  # noticed while A still runs
            assert app.state.scheduler.running == 1
        wait_until(lambda: metric(live.url, "dflashkit_generations_total", outcome="cancelled") == 2)
        # neither ran to its end
        assert metric(live.url, "dflashkit_generations_total", outcome="length") == 0
        assert http.post("/v1/completions", json={**LONG, "max_tokens": 4}).json()["usage"]["completion_tokens"] == 4


def test_request_timeout() -> None:
    app = create_app(tiny_generator(), model_id=MODEL, timeout=0.1)
    with LiveServer(app) as live:
        r = httpx.post(live.url + "/v1/completions", json=LONG, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        stream = client.completions.create(model=MODEL, prompt="w5 w6 w7", max_tokens=500, temperature=0, stream=True)
        with pytest.raises(openai.APIError, match="did not complete within"):
            for _ in stream:
                pass
        wait_until(lambda: metric(live.url, "dflashkit_generations_total", outcome="timeout") == 2)
        for attempt in range(5):  # still serving (a busy machine may take a 3-token request past 0.1 s once)
            try:
                short = client.completions.create(model=MODEL, prompt="w5", max_tokens=3, temperature=0)
                break
            except openai.APIError:
                if attempt == 4:
                    raise
        assert short.usage.completion_tokens == 3


# ---- metrics ------------------------------------------------------------------------------------------------


def test_metrics_are_prometheus_text_and_add_up() -> None:
    app = create_app(tiny_generator(), model_id=MODEL, proposal="sample")
    with LiveServer(app) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        usages = [
            client.completions.create(model=MODEL, prompt="w5 w6 w7", **{**SAMPLED, "seed": s}).usage for s in (1, 2)
        ]
        httpx.post(live.url + "/v1/completions", json={"model": "nope", "prompt": "w5"}, timeout=30)
        r = httpx.get(live.url + "/metrics", timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert {
        "dflashkit_requests",
        "dflashkit_generations",
        "dflashkit_prompt_tokens",
        "dflashkit_completion_tokens",
        "dflashkit_accepted_tokens",
        "dflashkit_draft_tokens",
        "dflashkit_drafting_steps",
        "dflashkit_accepted_tokens_by_position",
        "dflashkit_draft_tokens_by_position",
        "dflashkit_request_latency_seconds",
        "dflashkit_time_to_first_token_seconds",
        "dflashkit_queue_wait_seconds",
        "dflashkit_queue_depth",
        "dflashkit_other_cpu_load_cores",
    } <= set(families)

    def total(name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in families[name].samples
            if s.name == name + "_total" and all(s.labels.get(k) == v for k, v in labels.items())
        )

    spec = [u.model_extra["speculative"] for u in usages]
    assert total("dflashkit_requests", endpoint="/v1/completions", status="200") == 2
    assert total("dflashkit_requests", endpoint="/v1/completions", status="404") == 1
    assert total("dflashkit_prompt_tokens") == sum(u.prompt_tokens for u in usages)
    assert total("dflashkit_completion_tokens") == sum(u.completion_tokens for u in usages)
    assert total("dflashkit_accepted_tokens") == sum(s["accepted_tokens"] for s in spec) > 0
    assert total("dflashkit_draft_tokens") == sum(s["draft_tokens"] for s in spec)
    assert total("dflashkit_drafting_steps") == sum(s["drafting_steps"] for s in spec)
    for k in (1, 2, 3):
        assert total("dflashkit_accepted_tokens_by_position", position=str(k)) == sum(
            s["accepted_per_position"][k - 1] for s in spec
        )
    latency = {s.name: s.value for s in families["dflashkit_request_latency_seconds"].samples if not s.labels.get("le")}
    assert (
        latency["dflashkit_request_latency_seconds_count"] == 2 and latency["dflashkit_request_latency_seconds_sum"] > 0
    )
    assert total("dflashkit_generations") == 2


def test_default_server_is_adaptive_with_lookup_and_gives_plain_outputs(offline):
    """The server's defaults (those of `dflashkit serve`): the adaptive block size and prompt lookup; greedy
    outputs are plain decoding's, and a seeded sampled request's (coupled sampling) is plain sampling's for that
    seed; an unseeded one uses rejection sampling."""
    with LiveServer(create_app(tiny_generator(), model_id=MODEL)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
        got = client.completions.create(model=MODEL, prompt="w5 w9 w11", max_tokens=24, temperature=0)
        sampled = client.completions.create(model=MODEL, prompt="w5 w9 w11", max_tokens=24, temperature=1, seed=5)
        unseeded = client.completions.create(model=MODEL, prompt="w5 w9 w11", max_tokens=24, temperature=1)
        forced = client.completions.create(
            model=MODEL, prompt="w5 w9 w11", max_tokens=8, temperature=1, seed=5, extra_body={"sampler": "rejection"}
        )
        with pytest.raises(openai.BadRequestError, match="sampler"):
            client.completions.create(model=MODEL, prompt="w5", max_tokens=4, extra_body={"sampler": "gumbel"})
        health = httpx.get(live.url + "/health", timeout=30).json()
    plain = offline.generate("w5 w9 w11", max_new_tokens=24, chat=False, use_drafter=False)
    plain_sampled = offline.generate(
        "w5 w9 w11", max_new_tokens=24, chat=False, use_drafter=False, temperature=1, seed=5
    )
    assert got.choices[0].text == plain.text
    assert sampled.choices[0].text == plain_sampled.text and plain_sampled.stats.sampler == "coupled"
    assert sampled.usage.model_extra["speculative"]["sampler"] == "coupled"
    assert unseeded.usage.model_extra["speculative"]["sampler"] == "rejection"
    assert forced.usage.model_extra["speculative"]["sampler"] == "rejection"  # the request's own choice
    assert health["adaptive_block_size"] is True and health["block_size"] == "auto"
    assert health["prompt_lookup"] is True
    with pytest.raises(Exception, match="block_size"):
        create_app(tiny_generator(), block_size="big")
    with pytest.raises(Exception, match="sampler"):
        create_app(tiny_generator(), sampler="gumbel")


# ---- structured output: response_format ------------------------------------------------------------------

COLOR_SCHEMA = {  # finite choices only: a random tiny target fills a free string or integer forever
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


def test_response_format_gives_json_and_equals_offline() -> None:
    offline = tiny_byte_generator()
    with LiveServer(create_app(tiny_byte_generator(), model_id=MODEL)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Pick a color."}]
        fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": COLOR_SCHEMA, "strict": True}}
        for temperature, seed in ((0.0, None), (1.0, 5)):
            resp = client.chat.completions.create(
                model=MODEL, messages=messages, response_format=fmt, temperature=temperature, seed=seed, max_tokens=300
            )
            expected = offline.generate(
                messages,
                grammar=Grammar.json_schema(COLOR_SCHEMA),
                temperature=temperature,
                seed=seed,
                max_new_tokens=300,
                proposal="sample",
            )
            text = resp.choices[0].message.content
            assert text == expected.text and resp.choices[0].finish_reason == "stop"
            value = json.loads(text)
            assert value["color"] in ("red", "green") and isinstance(value["ok"], bool) and len(value) == 2
        # streamed, any JSON object
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                stream=True,
                max_tokens=300,
                temperature=0,
                response_format={"type": "json_object"},
            )
        )
        assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), dict)
        # a schema the grammar compiler refuses, and a malformed response_format: 400 naming the field
        for bad in (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}},
            {"type": "json_schema"},
            {"type": "yaml"},
        ):
            r = httpx.post(
                live.url + "/v1/chat/completions",
                timeout=30,
                json={"model": MODEL, "messages": messages, "response_format": bad},
            )
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == "response_format"
        assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4).choices[0].message.content


def test_vllm_guided_fields_on_both_endpoints() -> None:
    """guided_choice / guided_regex / guided_json / guided_grammar (vLLM's names) constrain completions and chat
    alike, equal offline generation under the same grammar; at most one per request; bad ones name their field."""
    offline = tiny_byte_generator()
    with LiveServer(create_app(tiny_byte_generator(), model_id=MODEL)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
        choices = ["yes", "no", "maybe so"]
        for temperature, seed in ((0.0, None), (1.0, 3)):
            resp = client.completions.create(
                model=MODEL,
                prompt="Answer: ",
                max_tokens=20,
                temperature=temperature,
                seed=seed,
                extra_body={"guided_choice": choices},
            )
            expected = offline.generate(
                "Answer: ",
                chat=False,
                grammar=Grammar.choice(choices),
                max_new_tokens=20,
                temperature=temperature,
                seed=seed,
                proposal="sample",
            )
            assert resp.choices[0].text == expected.text and expected.text in choices
        messages = [{"role": "user", "content": "A number?"}]
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=20, temperature=0, extra_body={"guided_regex": "[0-9]{2,4}"}
        )
        assert re.fullmatch("[0-9]{2,4}", resp.choices[0].message.content)
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=300, temperature=0, extra_body={"guided_json": COLOR_SCHEMA}
        )
        assert json.loads(resp.choices[0].message.content)["color"] in ("red", "green")
        resp = client.completions.create(
            model=MODEL, prompt="x", max_tokens=20, temperature=0, extra_body={"guided_grammar": 'start: "ab" | "cd"'}
        )
        assert resp.choices[0].text in ("ab", "cd")
        for body, param in (
            ({"guided_regex": "(", "prompt": "x"}, "guided_regex"),
            ({"guided_choice": [], "prompt": "x"}, "guided_choice"),
            ({"guided_json": "{not json", "prompt": "x"}, "guided_json"),
            ({"guided_regex": "a", "guided_choice": ["a"], "prompt": "x"}, "guided_choice"),
        ):
            r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, **body}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = httpx.post(
            live.url + "/v1/chat/completions",
            timeout=30,
            json={
                "model": MODEL,
                "messages": messages,
                "response_format": {"type": "json_object"},
                "guided_regex": "a",
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"


# ---- tool calls -------------------------------------------------------------------------------------------------

PICK_TOOL = {
    "type": "function",
    "function": {  # finite arguments: a random tiny target fills free strings forever
        "name": "pick_color",
        "description": "Pick a color",
        "parameters": {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
    },
}
STOP_TOOL = {"type": "function", "function": {"name": "stop_now"}}


def test_tool_calls_forced_streamed_and_sent_back() -> None:
    """tool_choice required / named: the answer is OpenAI tool_calls (valid arguments, finish_reason tool_calls),
    equal to offline generation under the same grammar, streamed too; the call and the tool's answer go back
    through the template in the next request; auto and none answer with text."""
    offline = tool_generator()
    with LiveServer(create_app(tool_generator(), model_id=MODEL)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Pick a color."}]
        tools = [PICK_TOOL, STOP_TOOL]
        named = {"type": "function", "function": {"name": "pick_color"}}
        for choice, temperature, seed in (("required", 0.0, None), (named, 1.0, 4)):
            # one call: a random target, free to add calls, may write them until max_tokens
            resp = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                tools=tools,
                tool_choice=choice,
                parallel_tool_calls=False,
                temperature=temperature,
                seed=seed,
                max_tokens=800,
            )  # sampled: up to 33 spaces between JSON tokens
            request = ToolRequest.parse(tools, choice, parallel_tool_calls=False)
            expected = offline.generate(
                offline.encode_prompt(messages, tools=request.template_tools()),
                grammar=offline.tool_call_grammar(request),
                temperature=temperature,
                seed=seed,
                max_new_tokens=800,
                proposal="sample",
            )
            _, expected_calls = parse_tool_calls(expected.text, request.names)
            out = resp.choices[0]
            assert out.finish_reason == "tool_calls" and out.message.content is None
            assert [(c.function.name, c.function.arguments) for c in out.message.tool_calls] == [
                (c.name, c.arguments) for c in expected_calls
            ]
            for call in out.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
                if call.function.name == "pick_color":
                    assert json.loads(call.function.arguments)["color"] in ("red", "green")
            if choice == named:
                assert [c.function.name for c in out.message.tool_calls] == ["pick_color"]
        # streamed: no <tool_call> text in the content deltas, the calls in a tool_calls delta before the finish
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                tools=tools,
                tool_choice=named,
                temperature=0,
                max_tokens=200,
                stream=True,
            )
        )
        assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        assert [t.function.name for t in calls] == ["pick_color"] and calls[0].index == 0
        assert json.loads(calls[0].function.arguments)["color"] in ("red", "green")
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        # the call and the tool's answer sent back (content null in the assistant turn): a normal text answer
        sent = [
            *messages,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": calls[0].id,
                        "type": "function",
                        "function": {"name": "pick_color", "arguments": calls[0].function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": calls[0].id, "content": "done"},
        ]
        resp = client.chat.completions.create(model=MODEL, messages=sent, tools=tools, max_tokens=8, temperature=0)
        expected = offline.generate(offline.encode_prompt(sent, tools=tools), max_new_tokens=8)
        assert resp.usage.prompt_tokens == len(offline.encode_prompt(sent, tools=tools))
        assert resp.choices[0].message.content == expected.text and not resp.choices[0].message.tool_calls
        # "none": the template is not shown the tools (a shorter prompt); auto with a text answer: content as is
        without = client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, tool_choice="none", max_tokens=4, temperature=0
        )
        auto = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=4, temperature=0)
        assert without.usage.prompt_tokens == len(offline.encode_prompt(messages)) < auto.usage.prompt_tokens
        assert (
            auto.choices[0].message.content
            == offline.generate(offline.encode_prompt(messages, tools=tools), max_new_tokens=4).text
        )
        # a forced call cannot also follow a response_format
        r = httpx.post(
            live.url + "/v1/chat/completions",
            timeout=30,
            json={
                "model": MODEL,
                "messages": messages,
                "tools": tools,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_tool_calls_per_choice_with_n() -> None:
    """n=2 sampled choices of a forced call: each choice has its own calls and finish_reason, streamed or not,
    and the streamed calls equal the whole response's (same seeds)."""
    with LiveServer(create_app(tool_generator(), model_id=MODEL)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
        ask = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Pick."}],
            "tools": [PICK_TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "n": 2,
            "temperature": 1.0,
            "seed": 3,
            "max_tokens": 800,
        }
        whole = client.chat.completions.create(**ask)
        expected = {c.index: [t.function.arguments for t in c.message.tool_calls] for c in whole.choices}
        assert all(c.finish_reason == "tool_calls" for c in whole.choices) and len(expected) == 2
        streamed: dict[int, list[str]] = {}
        finish: dict[int, str] = {}
        for chunk in client.chat.completions.create(**ask, stream=True):
            for choice in chunk.choices:
                streamed.setdefault(choice.index, []).extend(
                    t.function.arguments for t in choice.delta.tool_calls or []
                )
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
        assert streamed == expected and finish == {0: "tool_calls", 1: "tool_calls"}
        for calls in expected.values():
            assert len(calls) == 1 and json.loads(calls[0])["color"] in ("red", "green")


# ---- API key, CORS --------------------------------------------------------------------------------------------


def test_api_key_guards_the_api_and_cors_answers_allowed_origins() -> None:
    """--api-key: /v1/* needs the key (OpenAI's bearer header or Anthropic's x-api-key; checked before the body),
    each API answering 401 in its own error shape; /health, /metrics and the page stay open. --allowed-origins:
    browsers' preflight requests from those origins (and only those) are allowed."""
    import anthropic

    app = create_app(tiny_generator(), model_id=MODEL, api_key="sekret", allowed_origins=["http://ui.example"])
    with LiveServer(app) as live:
        for path in ("/v1/models", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
            r = (
                httpx.post(live.url + path, json={"bad": 1}, timeout=30)
                if path != "/v1/models"
                else httpx.get(live.url + path, timeout=30)
            )
            assert r.status_code == 401, (path, r.text)
            error = r.json()["error"]
            assert error["type"] == ("authentication_error" if path == "/v1/messages" else "invalid_request_error")
            assert "API key" in error["message"]
        for path in ("/health", "/metrics", "/"):
            assert httpx.get(live.url + path, timeout=30).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=live.url + "/v1", api_key="sekret", max_retries=0)
        assert (
            good.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=3, temperature=0
            ).usage.completion_tokens
            == 3
        )
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "w5"}]
            )
        assert (
            anthropic.Anthropic(base_url=live.url, api_key="sekret", max_retries=0)
            .messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "w5"}])
            .usage.output_tokens
            == 3
        )
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        r = httpx.options(
            live.url + "/v1/chat/completions", headers={"Origin": "http://ui.example", **preflight}, timeout=30
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
        r = httpx.options(
            live.url + "/v1/chat/completions", headers={"Origin": "http://other.example", **preflight}, timeout=30
        )
        assert "access-control-allow-origin" not in r.headers
    with pytest.raises(InvalidInputError, match="api_key"):
        create_app(tiny_generator(), api_key=" ")


def test_tree_setting_takes_zero_for_chains() -> None:
    """`tree`: None (the default), 0 (chains in any case) or a node budget; anything else is refused up front."""
    from dflashkit.server import ServerSettings

    assert ServerSettings(tree=0).tree == 0 and ServerSettings(tree=5).tree == 5 and ServerSettings().tree is None
    for bad in (-1, True, 1.5):
        with pytest.raises(InvalidInputError, match="tree must be"):
            ServerSettings(tree=bad)


def test_proposal_temperature_setting_reaches_the_requests_drafts(proposal_temperatures: list) -> None:
    """`proposal_temperature` (None: the drafter's own) is handed to every generation; bad values are refused."""
    from dflashkit.server import ServerSettings

    app = create_app(tiny_generator(), model_id=MODEL, proposal_temperature=0.7, block_size=4, lookup=False)
    with LiveServer(app) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        # seeded, so that no sampled end-of-text cuts it short (the seed's text is fixed)
        done = client.completions.create(model=MODEL, prompt="w5 w6 w7", temperature=1.0, max_tokens=6, seed=1)
    assert done.usage.completion_tokens == 6
    assert proposal_temperatures and set(proposal_temperatures) == {0.7}
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(InvalidInputError, match="proposal temperature"):
            ServerSettings(proposal_temperature=bad)
