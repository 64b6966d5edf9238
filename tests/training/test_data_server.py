"""`dflashkit data --server`: training answers from an OpenAI-compatible server equal local regeneration."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dflashkit import SpeculativeGenerator
from dflashkit.server import create_app
from dflashkit.text import eos_token_ids
from dflashkit.training import dataset
from dflashkit.training import regenerate as regeneration
from dflashkit.training import sources as data
from dflashkit.training.data_server import ServerTarget
from tests.live_server import LiveServer
from tests.training.test_sources import EVAL, make_model, make_tokenizer, word_prompts

PROMPTS = word_prompts(14, seed=5)
SETTINGS = {"batch_size": 4, "max_new_tokens": 10, "shard_size": 4, "progress": False}


@pytest.fixture(scope="module")
def served():
    """The test target (fp32, with a random drafter: the server decodes speculatively) behind `dflashkit serve`."""
    from tests.conftest import tiny_drafter

    model = make_model()
    gen = SpeculativeGenerator(model, make_tokenizer(), tiny_drafter(model, block_size=4))
    with LiveServer(create_app(gen, model_id="tiny")) as live:
        yield live.url


def connect(url: str, **kw) -> ServerTarget:
    model, tok = make_model(), make_tokenizer()
    return ServerTarget.connect(url + "/v1", tok, model.config, eos_token_ids(model, tok), **kw)


def records(folder: Path) -> list[dict]:
    return dataset.load_shards(folder, require_complete=True)


def test_server_answers_are_the_local_regeneration(served, tmp_path):
    local = regeneration.regenerate(make_model(), make_tokenizer(), PROMPTS, tmp_path / "local", **SETTINGS)
    server = connect(served)
    assert server.model == "tiny"
    remote = regeneration.regenerate(None, make_tokenizer(), PROMPTS, tmp_path / "server", server=server, **SETTINGS)
    assert records(tmp_path / "server") == records(tmp_path / "local")  # the same prompt ids, answers, eos
    assert remote["written"] == local["written"] == len(PROMPTS) and 0 < local["finished"] < len(PROMPTS)
    meta = json.loads((tmp_path / "server" / "meta.json").read_text())
    assert meta["server"] == {"url": served + "/v1", "model": "tiny", "token_ids": "from the server"}
    assert meta["target"]["dtype"] == "server"
    with pytest.raises(data.DataError, match="dtype"):  # a server's folder is not continued by a local target
        regeneration.regenerate(make_model(), make_tokenizer(), PROMPTS, tmp_path / "server", **SETTINGS)


def test_sampled_answers_are_seeded_per_prompt(served, tmp_path):
    server = connect(served)
    for folder, batch in (("a", 4), ("b", 3)):  # other batches, the same draws
        regeneration.regenerate(
            None,
            make_tokenizer(),
            PROMPTS,
            tmp_path / folder,
            server=server,
            temperature=1.0,
            **{**SETTINGS, "batch_size": batch},
        )
    sampled = records(tmp_path / "a")
    assert sampled == records(tmp_path / "b")
    regeneration.regenerate(make_model(), make_tokenizer(), PROMPTS, tmp_path / "greedy", **SETTINGS)
    assert sampled != records(tmp_path / "greedy")  # sampled, not greedy


def test_a_server_without_token_ids_gets_its_texts_encoded(served, tmp_path):
    """A server that refuses the return_token_ids field (as OpenAI's own API does): the answers' texts are
    encoded with the target's tokenizer, and meta.json says so."""
    proxy = FastAPI()

    @proxy.get("/v1/models")
    def models() -> dict:
        return httpx.get(served + "/v1/models").json()

    @proxy.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        if "return_token_ids" in body:
            return JSONResponse(
                {
                    "error": {
                        "message": "Unrecognized request argument supplied: return_token_ids",
                        "type": "invalid_request_error",
                    }
                },
                status_code=400,
            )
        async with httpx.AsyncClient(timeout=60) as client:
            reply = await client.post(served + "/v1/completions", json=body)
        return JSONResponse(reply.json(), status_code=reply.status_code)

    tok = make_tokenizer()
    with LiveServer(proxy) as live:
        server = connect(live.url)
        regeneration.regenerate(None, tok, PROMPTS, tmp_path / "server", server=server, **SETTINGS)
    assert server.token_ids is False
    regeneration.regenerate(make_model(), tok, PROMPTS, tmp_path / "local", **SETTINGS)
    for got, want in zip(records(tmp_path / "server"), records(tmp_path / "local")):
        answer = want["response_ids"][:-1] if want["finished"] else want["response_ids"]
        text = tok.decode(answer, skip_special_tokens=True)
        assert got["response_ids"] == tok.encode(text, add_special_tokens=False) + ([2] if want["finished"] else [])
        assert got["prompt_ids"] == want["prompt_ids"] and got["finished"] == want["finished"]
    meta = json.loads((tmp_path / "server" / "meta.json").read_text())
    assert meta["server"]["token_ids"] == "text re-encoded"


def test_data_command_with_a_server(served, tmp_path, monkeypatch, capsys):
    from dflashkit.cli.main import main
    from tests.training.test_sources import write_jsonl

    target = tmp_path / "target"  # only its configuration and tokenizer are read: the weights are the server's
    make_model(torch.bfloat16).save_pretrained(target)
    make_tokenizer().save_pretrained(target)
    monkeypatch.setattr(data, "evaluation_prompts", lambda: EVAL)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    args = [
        "data",
        "--target",
        str(target),
        "--sources",
        f"jsonl:{src}",
        "--num-prompts",
        "14",
        "--max-new-tokens",
        "10",
        "--batch-size",
        "4",
        "--shard-size",
        "4",
        "--min-chars",
        "1",
        "--no-progress",
    ]
    assert main([*args, "--out", str(tmp_path / "d"), "--server", served + "/v1"]) == 0
    err = capsys.readouterr().err
    assert f"Answers from tiny at {served}/v1" in err and "14 of 14 prompts answered" in err
    assert len(records(tmp_path / "d")) == 14

    assert main([*args, "--out", str(tmp_path / "e"), "--server", "http://127.0.0.1:9/v1"]) == 2
    assert "cannot reach an OpenAI-compatible server at http://127.0.0.1:9/v1" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "e"), "--server", served + "/v1", "--server-model", "other"]) == 2
    assert "does not serve 'other'; it serves: tiny" in capsys.readouterr().err


def test_server_token_ids_extension(served):
    """return_token_ids (vLLM's field): the choice's generated ids, whole and streamed."""
    import openai

    client = openai.OpenAI(base_url=served + "/v1", api_key="x")
    prompt = make_tokenizer().apply_chat_template(
        [{"role": "user", "content": "the sea"}], add_generation_prompt=True, tokenize=False
    )
    whole = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    ids = whole.choices[0].model_extra["token_ids"]
    assert len(ids) == whole.usage.completion_tokens > 0
    assert make_tokenizer().decode(ids, skip_special_tokens=True) == whole.choices[0].text
    streamed = [
        t
        for chunk in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body={"return_token_ids": True}
        )
        for t in (chunk.choices[0].model_extra or {}).get("token_ids", [])
        if chunk.choices
    ]
    assert streamed == ids
