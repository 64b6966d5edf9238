"""Regeneration (dflashkit.training.regenerate): answers equal unbatched greedy; resumes after kills."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflashkit.errors import InvalidInputError
from dflashkit.text import encode_chat
from dflashkit.training import answerer as answering
from dflashkit.training import dataset
from dflashkit.training import regenerate as regeneration
from dflashkit.training import sources as data
from tests.conftest import VOCAB, tiny_target
from tests.training.test_sources import (
    EOS,
    CountingContinuous,
    CountingGenerate,
    Killed,
    check_records,
    make_model,
    make_tokenizer,
    word_prompts,
)


@pytest.mark.parametrize("engine", ["continuous", "static", "batches"])
def test_regenerate_matches_unbatched_greedy(tmp_path: Path, engine: str) -> None:
    model, tok = make_model(), make_tokenizer()
    prompts = word_prompts(12) + [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]]
    summary = regeneration.regenerate(
        model,
        tok,
        prompts,
        tmp_path / "out",
        batch_size=5,
        max_new_tokens=12,
        shard_size=8,
        progress=False,
        engine=engine,
    )
    records = dataset.load_shards(tmp_path / "out", require_complete=True)
    assert [r["id"] for r in records] == list(range(len(prompts)))
    check_records(records, 12)
    assert any(r["finished"] for r in records) and not all(r["finished"] for r in records)
    assert summary["written"] == len(prompts) and summary["num_shards"] == 2 and summary["shards_generated"] == 2
    assert summary["response_tokens"] == sum(len(r["response_ids"]) for r in records) == summary["run_response_tokens"]
    # Left padding + attention mask: each batched response equals the prompt generated on its own.
    for r, p in zip(records, prompts):
        ids = encode_chat(tok, p)  # one prompt at a time (the data path tokenizes a shard at once)
        assert r["prompt_ids"] == ids
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )
        alone = out[0, len(ids) :].tolist()
        assert r["response_ids"] == (alone[: alone.index(EOS) + 1] if EOS in alone else alone)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["settings"]["max_new_tokens"] == 12 and meta["target"]["vocab_size"] == VOCAB
    assert {shard["engine"] for shard in meta["shards"].values()} == {engine}
    assert meta["totals"]["written"] == len(prompts)
    lines = (tmp_path / "out" / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(line)["prompt"] for line in lines] == prompts


@pytest.mark.parametrize("engine", ["continuous", "static", "batches"])
def test_regenerate_resume_after_kill_and_refusals(tmp_path: Path, monkeypatch, engine: str) -> None:
    model, tok = make_model(), make_tokenizer()
    out = tmp_path / "out"
    prompts = word_prompts(10, seed=1)
    kwargs = dict(batch_size=3, max_new_tokens=6, shard_size=4, progress=False, engine=engine)
    counter = (
        CountingContinuous(monkeypatch)
        if engine == "continuous"
        else CountingGenerate(monkeypatch, "generate_static" if engine == "static" else "generate_batch")
    )
    regeneration.regenerate(model, tok, prompts, out, **kwargs)
    # shards of 4, 4, 2 prompts: in batches of 3, or each in one run of 3 slots refilled as answers end
    assert counter.calls == ([3, 1, 3, 1, 2] if engine == "batches" else [4, 4, 2])
    first = dataset.load_shards(out)
    last = dataset.shard_path(out, 2)
    kept = dataset.shard_path(out, 0).stat().st_mtime_ns

    # A kill during shard 2: its file never appeared, a temp file was left behind, and one of its answers had
    # reached its partial file (with a line torn by the kill after it).
    last.unlink()
    (out / ".shard-00002.jsonl.tmp-dead").write_text("partial")
    finished = max(first, key=lambda r: r["id"])
    dataset.partial_shard_path(out, 2).write_text(json.dumps(finished) + '\n{"id": 9, "prompt_ids": [1, 2')
    with pytest.raises(data.DataError, match="incomplete"):
        dataset.load_shards(out, require_complete=True)
    assert dataset.load_shards(out) == [r for r in first if r["id"] < 8]
    assert dataset.load_shards(out, include_partial=True) == [r for r in first if r["id"] < 8] + [finished]
    counter.calls.clear()
    summary = regeneration.regenerate(model, tok, prompts, out, **kwargs)
    assert counter.calls == [1]  # only the missing shard, less the answer its partial file kept
    assert summary["shards_generated"] == 1 and summary["shards_resumed"] == 2 and summary["written"] == 10
    assert dataset.load_shards(out) == first
    assert dataset.shard_path(out, 0).stat().st_mtime_ns == kept
    assert not list(out.glob(".*tmp*"))

    # Nothing left to do; prompts=None resumes from the stored list; a different batch size is allowed.
    counter.calls.clear()
    assert regeneration.regenerate(model, tok, None, out, **{**kwargs, "batch_size": 8})["shards_generated"] == 0
    assert counter.calls == []

    with pytest.raises(data.DataError, match="max_new_tokens"):
        regeneration.regenerate(model, tok, prompts, out, **{**kwargs, "max_new_tokens": 7})
    with pytest.raises(data.DataError, match="temperature"):
        regeneration.regenerate(model, tok, prompts, out, **kwargs, temperature=0.7)
    with pytest.raises(data.DataError, match="another prompt list"):
        regeneration.regenerate(model, tok, prompts[:-1], out, **kwargs)
    with pytest.raises(data.DataError, match="target"):
        regeneration.regenerate(tiny_target("llama", seed=5), tok, prompts, out, **kwargs)
    assert counter.calls == []


def test_a_kill_mid_shard_loses_at_most_the_batch_in_progress(tmp_path: Path, monkeypatch) -> None:
    """Finished batches are on disk before the shard is: a run killed in its 2nd batch resumes with the 1st
    batch's records as they were and generates only the rest; a torn last line is dropped."""
    model, tok = make_model(), make_tokenizer()
    prompts = word_prompts(7, seed=6)
    kwargs = dict(
        batch_size=3, max_new_tokens=6, shard_size=7, temperature=1.0, seed=2, progress=False, engine="batches"
    )
    reference = regeneration.regenerate(model, tok, prompts, tmp_path / "ref", **kwargs)
    counter = CountingGenerate(monkeypatch)

    def dies_on_second_batch(model_, prompts_, **kw):
        if len(counter.calls) == 1:
            raise Killed
        return counter(model_, prompts_, **kw)

    monkeypatch.setattr(answering, "generate_batch", dies_on_second_batch)
    out = tmp_path / "out"
    with pytest.raises(Killed):
        regeneration.regenerate(model, tok, prompts, out, **kwargs)
    partial = dataset.partial_shard_path(out, 0)
    first_batch = [json.loads(line) for line in partial.read_text().splitlines()]
    assert len(first_batch) == 3 and not dataset.shard_path(out, 0).exists()
    with partial.open("a") as f:
        f.write('{"id": 6, "prompt_ids": [1, 2')  # torn by the kill

    monkeypatch.setattr(answering, "generate_batch", counter)
    counter.calls.clear()
    summary = regeneration.regenerate(model, tok, prompts, out, **kwargs)
    assert counter.calls == [3, 1]  # the 4 prompts left, in batches of 3
    assert summary["written"] == 7 == reference["written"] and not partial.exists()
    records = dataset.load_shards(out, require_complete=True)
    assert [r["id"] for r in records] == list(range(7))
    assert all(r in records for r in first_batch)
    check_records(records, 6)
    # batches are seeded by their own content, so the resumed run sampled what an uninterrupted one did
    assert records == dataset.load_shards(tmp_path / "ref")


def test_a_kill_mid_shard_loses_no_finished_answer_of_continuous_batching(tmp_path: Path, monkeypatch) -> None:
    """Continuous batching writes each answer as it ends (SYNC_SECONDS 0: flushed at once): a run killed after 4
    answers resumes with those records as they were, answers only the other 5 prompts, and samples what an
    uninterrupted run with other slots does (a seed per prompt)."""
    model, tok = make_model(), make_tokenizer()
    prompts = word_prompts(9, seed=7)
    kwargs = dict(max_new_tokens=6, shard_size=9, temperature=1.0, seed=2, progress=False, engine="continuous")
    reference = regeneration.regenerate(model, tok, prompts, tmp_path / "ref", batch_size=4, **kwargs)
    monkeypatch.setattr(regeneration, "SYNC_SECONDS", 0.0)
    counter = CountingContinuous(monkeypatch, die_after=4)
    out = tmp_path / "out"
    with pytest.raises(Killed):
        regeneration.regenerate(model, tok, prompts, out, batch_size=3, **kwargs)
    partial = dataset.partial_shard_path(out, 0)
    written = [json.loads(line) for line in partial.read_text().splitlines()]
    assert len(written) == 4 and not dataset.shard_path(out, 0).exists()

    counter.calls, counter.answers, counter.die_after = [], 0, None
    summary = regeneration.regenerate(model, tok, prompts, out, batch_size=2, **kwargs)
    assert counter.calls == [5] and counter.answers == 5
    assert summary["written"] == 9 == reference["written"] and not partial.exists()
    records = dataset.load_shards(out, require_complete=True)
    assert all(r in records for r in written)
    check_records(records, 6)
    assert records == dataset.load_shards(tmp_path / "ref")


@pytest.mark.parametrize("engine", ["continuous", "static", "batches"])
def test_regenerate_sampling_is_seeded_and_skips_long_prompts(tmp_path: Path, engine: str) -> None:
    model, tok = make_model(), make_tokenizer()
    prompts = word_prompts(6, seed=2) + [" ".join(["sea"] * 40)]
    kwargs = dict(
        batch_size=4,
        max_new_tokens=8,
        temperature=1.0,
        top_p=0.9,
        shard_size=4,
        seed=3,
        max_prompt_tokens=30,
        progress=False,
        engine=engine,
    )
    s1 = regeneration.regenerate(model, tok, prompts, tmp_path / "a", **kwargs)
    regeneration.regenerate(model, tok, prompts, tmp_path / "b", **kwargs)
    assert s1["skipped_too_long"] == 1 and s1["written"] == 6
    r1, r2 = dataset.load_shards(tmp_path / "a"), dataset.load_shards(tmp_path / "b")
    assert r1 == r2 and 6 not in [r["id"] for r in r1]
    check_records(r1, 8)
    greedy = regeneration.regenerate(model, tok, prompts, tmp_path / "c", **{**kwargs, "temperature": 0.0})
    assert greedy["written"] == 6 and dataset.load_shards(tmp_path / "c") != r1


def test_regenerate_uses_the_answerer_it_is_given(tmp_path: Path, monkeypatch) -> None:
    model, tok = make_model(), make_tokenizer()
    answerer = answering.Answerer.for_target(model, tok, engine="continuous", batch_size=3)
    built = []
    monkeypatch.setattr(answering, "FastTargetForward", lambda m: built.append(m))  # a second fused copy: not wanted
    summary = regeneration.regenerate(
        model, tok, word_prompts(4), tmp_path / "a", batch_size=3, max_new_tokens=4, progress=False, answerer=answerer
    )
    assert summary["written"] == 4 and built == []
    for kwargs in ({"batch_size": 4}, {"engine": "batches"}):
        with pytest.raises(InvalidInputError, match="answerer was made for another"):
            regeneration.regenerate(
                model, tok, ["hi"], tmp_path / "b", progress=False, answerer=answerer, **{"batch_size": 3, **kwargs}
            )
    with pytest.raises(InvalidInputError, match="answerer was made for another"):
        regeneration.regenerate(
            make_model(), tok, ["hi"], tmp_path / "b", batch_size=3, progress=False, answerer=answerer
        )


def test_a_damaged_shard_is_named_with_its_line(tmp_path: Path) -> None:
    model, tok = make_model(), make_tokenizer()
    regeneration.regenerate(
        model, tok, word_prompts(6), tmp_path / "out", batch_size=3, max_new_tokens=4, shard_size=8, progress=False
    )
    shard = dataset.shard_path(tmp_path / "out", 0)
    lines = shard.read_text().splitlines()
    shard.write_text("\n".join(lines[:2] + [lines[2][:20]] + lines[3:]) + "\n")  # a truncated record
    with pytest.raises(data.DataError, match=rf"{shard.name}:3: not a JSON record"):
        dataset.load_shards(tmp_path / "out")
    bad = json.loads(lines[2])
    bad["response_ids"] = [5, -4]
    shard.write_text("\n".join(lines[:2] + [json.dumps(bad)] + lines[3:]) + "\n")
    with pytest.raises(data.DataError, match=rf"{shard.name}:3: .*token ids >= 0"):
        dataset.load_shards(tmp_path / "out")


def test_regenerate_engine_choice_is_checked_before_anything_is_written(tmp_path: Path) -> None:
    tok = make_tokenizer()
    with pytest.raises(InvalidInputError, match="engine must be"):
        regeneration.regenerate(make_model(), tok, ["hi"], tmp_path / "a", engine="fast", progress=False)
    for engine in ("continuous", "static"):
        with pytest.raises(InvalidInputError, match="activation"):  # a model the fast forward does not cover
            regeneration.regenerate(
                tiny_target("llama", hidden_act="gelu"), tok, ["hi"], tmp_path / "b", engine=engine, progress=False
            )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    summary = regeneration.regenerate(
        tiny_target("llama", hidden_act="gelu"), tok, ["hi"], tmp_path / "c", max_new_tokens=3, progress=False
    )  # auto: static batches for it
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    assert summary["written"] == 1 and meta["shards"]["00000"]["engine"] == "batches"
