"""Token origins with prompt lookup on: a streamed request over a repetitive prompt reports each token as the
drafter's, a copy's (prompt lookup) or the target's, and the counts agree with the request's speculative usage.

The server runs a fixed block size (no adaptive policy deciding by timings), so its runs equal offline runs with
the same settings; the tiny random target falls into loops, which prompt lookup copies."""

from __future__ import annotations

from collections import Counter

import httpx
import openai
import pytest

from dflashkit.decoding.loop import ORIGINS
from dflashkit.server import create_app
from tests.live_server import LiveServer, tiny_generator

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "w5 w6 w7 w8 w9 w5 w6 w7 w8 w9 w5 w6 w7"}]  # repeats itself
SETTINGS = {"proposal": "sample", "block_size": 4, "lookup": True}


@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(tiny_generator(), model_id=MODEL, **SETTINGS)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def contains(sequence: list[int], run: list[int]) -> bool:
    return any(sequence[i : i + len(run)] == run for i in range(len(sequence) - len(run) + 1))


def streamed_steps(client: openai.OpenAI, **kw) -> tuple[list[list[dict]], dict, str]:
    """The token_origins of each chunk that carries tokens (one per target pass), the usage, the finish reason."""
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body={"token_origins": True}, max_tokens=40, **kw
        )
    )
    steps = [o for c in chunks if c.choices and (o := (c.choices[0].model_extra or {}).get("token_origins"))]
    finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    return steps, chunks[-1].usage.model_extra["speculative"], finish


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 1.0, "seed": 0}],
    ids=["greedy", "sampled"],
)
def test_streamed_origins_tell_drafter_copy_and_target_apart(server, client, sampling) -> None:
    health = httpx.get(server.url + "/health").json()
    assert health["prompt_lookup"] and not health.get("ngram_store_entries")  # copies come from the text only
    steps, spec, finish = streamed_steps(client, **sampling)
    assert finish == "length"  # no stop token cut a step short: every step ends with the target's token
    tokens = [t for step in steps for t in step]
    assert all(t["origin"] in ORIGINS and t["from_draft"] == (t["origin"] != "target") for t in tokens)

    # one chunk per target pass: the prefill's token, then each step's accepted drafts and the target's token
    assert [t["origin"] for t in steps[0]] == ["target"]
    accepted = []
    for step in steps[1:]:
        *drafts, last = [t["origin"] for t in step]
        assert last == "target"
        assert set(drafts) <= {"drafter"} or set(drafts) <= {"copy"}  # a chain: all copied or all drafted
        accepted.append(len(drafts))
    # consistent with the usage: drafter + copy tokens = accepted tokens, per block position too
    counts = Counter(t["origin"] for t in tokens)
    assert counts["drafter"] + counts["copy"] == spec["accepted_tokens"] == sum(accepted)
    assert len(accepted) == spec["drafting_steps"]
    assert spec["accepted_per_position"] == [sum(a > i for a in accepted) for i in range(3)]
    assert counts["copy"] > 0  # prompt lookup fired and its copies were accepted

    # a copy is a run of earlier text (the prompt's tokens and the reply before its step)
    offline = tiny_generator()
    context = offline.encode_prompt(MESSAGES)
    for step in steps:
        copied = [t["id"] for t in step if t["origin"] == "copy"]
        assert not copied or contains(context, copied)
        context += [t["id"] for t in step]

    expected = offline.generate(MESSAGES, max_new_tokens=40, **SETTINGS, **sampling)
    assert [t["id"] for t in tokens] == expected.token_ids
    assert [t["origin"] for t in tokens] == expected.origins  # the library's result carries the same origins
    if sampling["temperature"] == 0:  # lossless: the copies changed nothing of the greedy answer
        plain = offline.generate(MESSAGES, max_new_tokens=40, lookup=False, use_drafter=False)
        assert [t["id"] for t in tokens] == plain.token_ids
    else:  # the random drafter's sampled drafts get accepted too: all three origins show
        assert counts["drafter"] > 0 and counts["target"] > 0


def test_origins_in_a_whole_response_match_the_stream(client) -> None:
    """Not streamed, the choice lists the same tokens with the same origins."""
    steps, _, _ = streamed_steps(client, temperature=0.0)
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body={"token_origins": True}, max_tokens=40, temperature=0.0
    )
    assert resp.choices[0].model_extra["token_origins"] == [t for step in steps for t in step]


@pytest.mark.parametrize("seed", [0, 4])
def test_a_tree_holding_a_copy_and_drafts_splits_its_step_by_origin(seed: int) -> None:
    """Where the library streams the origins from: a coupled token tree holds the copy and the drafter's
    candidates, and one step can accept a copied prefix, then the drafter's tokens under it; such a step reads
    copy..., drafter..., target, and only steps that had a copy have copied tokens."""
    generator = tiny_generator()
    options = {"temperature": 1.0, "sampler": "coupled", "tree": 8, "tree_copies": True, "block_size": 4}
    stream = generator.stream(MESSAGES, max_new_tokens=40, lookup=True, seed=seed, **options)
    steps = [(d.origins, d.token_ids) for d in stream]
    stats = stream.result.stats
    assert stream.result.finish_reason == "length" and len(steps) == stats.steps + 1
    assert stream.result.origins == [o for origins, _ in steps for o in origins]
    context = generator.encode_prompt(MESSAGES) + steps[0][1]
    mixed = 0
    for (origins, ids), copied_step, accepted in zip(steps[1:], stats.copied_steps, stats.accepted_lengths):
        copies = origins.count("copy")
        assert origins == ["copy"] * copies + ["drafter"] * (accepted - copies) + ["target"]
        assert copies == 0 or (copied_step and contains(context, ids[:copies]))
        mixed += 0 < copies < accepted
        context += ids
    assert mixed > 0  # the case this test is about happened
