"""The n-gram store of past answers: counting, chained proposals, files, and lossless decoding with it."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflashkit.cli.main import main
from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.stats import DecodeStats
from dflashkit.drafter.checkpoint import load_drafter, save_drafter
from dflashkit.drafter.ngram_store import FILENAME, NgramStore
from dflashkit.errors import CheckpointError
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_drafter, tiny_target


def brute_force_next(sequences: list[list[int]], key: tuple[int, ...], min_count: int) -> int | None:
    counts = Counter(
        seq[i] for seq in sequences for i in range(len(key), len(seq)) if tuple(seq[i - len(key) : i]) == key
    )
    if not counts or max(counts.values()) < min_count:
        return None
    top = max(counts.values())
    return min(t for t, c in counts.items() if c == top)


def corpus(seed: int, n_seqs: int = 40, vocab: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in range(n_seqs)]


@pytest.mark.parametrize("n,min_count", [(1, 1), (2, 2), (3, 2), (3, 4)])
def test_build_keeps_the_most_frequent_next_token_of_every_frequent_ngram(n, min_count):
    seqs = corpus(n * 10 + min_count)
    store = NgramStore.build(seqs, n=n, min_count=min_count)
    keys = {tuple(s[i - n : i]) for s in seqs for i in range(n, len(s))}
    for key in keys:
        assert store.table.get(key) == brute_force_next(seqs, key, min_count), key
    assert set(store.table) <= keys and len(store) == len(store.table)


def test_propose_chains_the_most_frequent_continuations():
    store = NgramStore({(1, 2): 3, (2, 3): 4, (3, 4): 1, (4, 1): 2}, n=2, max_draft=7)
    assert store.propose([9, 1, 2], 5) == [3, 4, 1, 2, 3]
    assert store.propose([1, 2], 20) == [3, 4, 1, 2, 3, 4, 1]  # capped at max_draft
    assert store.propose([2, 1], 5) == [] and store.propose([2], 5) == [] and store.propose([1, 2], 0) == []
    assert NgramStore({(1, 2): 3}, n=2).propose([1, 2], 4) == [3]  # (2, 3) unknown: the chain stops


def test_merged_is_the_union_and_the_counts_decide_where_the_followers_differ():
    a = NgramStore({(1, 2): 3, (2, 3): 4, (5, 5): 1}, n=2, counts={(1, 2): 5, (2, 3): 2, (5, 5): 3}, min_count=2)
    b = NgramStore(
        {(1, 2): 3, (2, 3): 7, (6, 6): 2, (5, 5): 0},
        n=2,
        counts={(1, 2): 1, (2, 3): 9, (6, 6): 4, (5, 5): 3},
        min_count=3,
    )
    m = a.merged(b)
    assert m.table == {(1, 2): 3, (2, 3): 7, (5, 5): 0, (6, 6): 2}
    assert m.counts == {(1, 2): 6, (2, 3): 9, (5, 5): 3, (6, 6): 4}  # same follower: summed; else the larger count
    assert m.min_count == 2 and m.n == 2 and a.table[(2, 3)] == 4  # a itself unchanged
    # exact where every corpus's top followers agree: merging the stores of two halves = the store of the whole
    seqs = [[1, 2, 3, 4] * 3, [1, 2, 3, 4, 1, 2] * 2, [4, 3, 2, 1] * 2]
    halves = NgramStore.build(seqs[:1], n=2, min_count=1).merged(NgramStore.build(seqs[1:], n=2, min_count=1))
    whole = NgramStore.build(seqs, n=2, min_count=1)
    assert halves.table == whole.table and halves.counts == whole.counts
    with pytest.raises(ValueError, match="3-grams into one of 2-grams"):
        a.merged(NgramStore({(1, 2, 3): 4}, n=3))


def test_pruned_keeps_the_ngrams_counted_most_often():
    store = NgramStore(
        {(1, 2): 3, (2, 3): 4, (3, 4): 5, (4, 5): 6},
        n=2,
        counts={(1, 2): 9, (2, 3): 2, (3, 4): 7, (4, 5): 2},
        min_count=2,
    )
    kept = store.pruned(3)
    assert kept.table == {(1, 2): 3, (3, 4): 5, (2, 3): 4}  # (4, 5) and (2, 3) tie at 2: the smaller n-gram stays
    assert kept.counts == {(1, 2): 9, (3, 4): 7, (2, 3): 2} and kept.min_count == 2 and kept.n == 2
    assert store.pruned(2).propose([1, 2], 3) == [3] and store.pruned(4) is store and len(store) == 4
    with pytest.raises(ValueError, match="max_entries"):
        store.pruned(0)


def test_save_and_load_round_trip_and_bad_files(tmp_path: Path):
    store = NgramStore.build(corpus(3), n=3, min_count=1, max_draft=5)
    store.save(tmp_path / FILENAME)
    loaded = NgramStore.load(tmp_path / FILENAME)
    assert loaded.table == store.table and loaded.n == 3 and loaded.max_draft == 5 and loaded.counts == store.counts
    assert loaded.min_count == store.min_count == 1
    assert not list(tmp_path.glob(".*"))  # written atomically: no temp file left
    (tmp_path / "bad.safetensors").write_bytes(b"not a store")
    with pytest.raises(CheckpointError, match="not a readable n-gram store"):
        NgramStore.load(tmp_path / "bad.safetensors")


@pytest.mark.parametrize(
    "top_token, top_count, token_width, count_width",
    [
        (49150, 33571, torch.uint16, torch.uint16),  # the shipped store's largest token id and count
        (65535, 65535, torch.uint16, torch.uint16),
        (70000, 3, torch.int32, torch.uint16),  # a vocabulary over 65,536
        (5, 70000, torch.uint16, torch.int32),
    ],
)
def test_saved_as_uint16_where_the_values_fit_and_read_back_the_same(
    tmp_path: Path, top_token, top_count, token_width, count_width
):
    table = {(1, 2, top_token): 3, (top_token, 0, 4): top_token}
    store = NgramStore(table, n=3, counts={(1, 2, top_token): top_count, (top_token, 0, 4): 2}, min_count=2)
    store.save(tmp_path / FILENAME)
    with safe_open(str(tmp_path / FILENAME), "pt") as f:
        assert f.get_tensor("contexts").dtype == f.get_tensor("next").dtype == token_width
        assert f.get_tensor("counts").dtype == count_width
    loaded = NgramStore.load(tmp_path / FILENAME)
    assert loaded.table == table and loaded.counts == store.counts and loaded.propose([1, 2, top_token], 1) == [3]


def test_stores_saved_with_int32_tensors_still_load(tmp_path: Path):
    """The format before uint16 tensors (every tensor int32), as the shipped v7-v12 stores were written."""
    save_file(
        {
            "contexts": torch.tensor([[1, 2], [2, 3]], dtype=torch.int32),
            "next": torch.tensor([3, 4], dtype=torch.int32),
            "counts": torch.tensor([5, 2], dtype=torch.int32),
        },
        str(tmp_path / FILENAME),
        metadata={"format": "dflashkit-ngram-store", "n": "2", "max_draft": "7"},
    )
    loaded = NgramStore.load(tmp_path / FILENAME)
    assert loaded.table == {(1, 2): 3, (2, 3): 4} and loaded.counts == {(1, 2): 5, (2, 3): 2}
    assert loaded.propose([1, 2], 4) == [3, 4]


def run(target, drafter, prompt, store, **kw):
    stats = DecodeStats(block_size=1)
    options = DecodeOptions(
        max_new_tokens=kw.pop("max_new_tokens", 40), lookup=store is not False, lookup_store=store or None, **kw
    )
    tokens = [t for step in decode(target, drafter, prompt, options, stats) for t in step.tokens]
    return tokens, stats


@pytest.mark.parametrize("with_drafter", [True, False])
def test_greedy_with_the_store_equals_plain_decoding(with_drafter):
    """Store drafts are verified like any other: greedy output is plain greedy output, token for token (fp32),
    whether the store's drafts are right (a store of the target's own answers) or wrong (a random store)."""
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=4) if with_drafter else None
    target = TargetAdapter(model, drafter.config.target_layer_ids if drafter else ())
    plain = TargetAdapter(model)
    prompts = [[5, 6, 7], [11, 3, 3, 40], [60]]
    answers = [run(plain, None, p, False, max_new_tokens=60)[0] for p in prompts]
    own = NgramStore.build([p[-3:] + a for p, a in zip(prompts, answers)], n=3, min_count=1)
    noise = NgramStore.build(corpus(7, vocab=VOCAB), n=1, min_count=1)
    for store in (own, noise):
        used = 0
        for prompt, answer in zip(prompts, answers):
            tokens, stats = run(target, drafter, prompt, store)
            assert tokens == answer[:40]
            used += sum(stats.store_steps)
            assert all(c for c, s in zip(stats.copied_steps, stats.store_steps) if s)  # store steps are copied steps
        assert used > 0
    lookup = stats.lookup_summary()
    assert lookup["store_steps"] == sum(stats.store_steps) and lookup["copied_steps"] >= lookup["store_steps"]


def test_a_store_for_another_vocabulary_is_refused():
    model = tiny_target("llama")
    store = NgramStore({(1, 2, 3): VOCAB + 5}, n=3)
    with pytest.raises(CheckpointError, match="another tokenizer"):
        run(TargetAdapter(model), None, [1, 2, 3], store)


def test_cli_builds_the_store_into_a_drafter_folder_that_loads_with_it(tmp_path: Path, capsys):
    model = tiny_target("llama")
    folder = tmp_path / "drafter"
    save_drafter(tiny_drafter(model, block_size=4), folder)
    data = tmp_path / "data"
    data.mkdir()
    records = [{"id": i, "prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7] * 2, "finished": True} for i in range(3)]
    (data / "meta.json").write_text(json.dumps({"num_shards": 1}))
    (data / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["ngram-store", "--data", str(data), "--out", str(folder), "--n", "2", "--min-count", "1"]) == 0
    assert "from 1 answers" in capsys.readouterr().err  # the same answer to the same prompt counts once
    drafter = load_drafter(folder, dtype=torch.float32)  # the store is not read as weights
    assert drafter.ngram_store is not None and drafter.ngram_store.propose([2, 3], 3) == [4, 5, 6]
    assert load_drafter(tmp_path / "drafter", dtype=torch.float32).ngram_store.n == 2
    with pytest.raises(SystemExit):
        main(["ngram-store", "--data", str(data)])  # --out is required
    alone = tmp_path / "store"  # not a drafter's folder: a store for prompt lookup alone (bench --lookup-store)
    assert main(["ngram-store", "--data", str(data), "--out", str(alone), "--n", "2", "--min-count", "1"]) == 0
    assert "--lookup-store" in capsys.readouterr().err
    assert NgramStore.load(alone / "ngram_store.safetensors").propose([2, 3], 3) == [4, 5, 6]
    (tmp_path / "file").write_text("x")
    assert main(["ngram-store", "--data", str(data), "--out", str(tmp_path / "file")]) == 2  # not a folder


def test_cli_merges_earlier_stores_into_the_new_one(tmp_path: Path, capsys):
    folder = tmp_path / "drafter"
    save_drafter(tiny_drafter(tiny_target("llama"), block_size=4), folder)

    def data_folder(name: str, response: list[int]) -> Path:
        data = tmp_path / name
        data.mkdir()
        (data / "meta.json").write_text(json.dumps({"num_shards": 1}))
        record = {"id": 0, "prompt_ids": [1, 2, 3], "response_ids": response, "finished": True}
        (data / "shard-00000.jsonl").write_text(json.dumps(record) + "\n")
        return data

    first, second = data_folder("a", [4, 5, 6, 7]), data_folder("b", [8, 9, 10, 11])
    args = ["ngram-store", "--out", str(folder), "--n", "2", "--min-count", "1"]
    assert main([*args, "--data", str(first)]) == 0
    assert main([*args, "--data", str(second), "--merge", str(folder)]) == 0  # the folder's own store grows
    assert "merged with 1 store(s)" in capsys.readouterr().err
    store = load_drafter(folder, dtype=torch.float32).ngram_store
    assert store.propose([4, 5], 3) == [6, 7] and store.propose([8, 9], 3) == [10, 11]
    assert main([*args, "--data", str(second), "--merge", str(tmp_path / "missing")]) == 2
    assert "no n-gram store there" in capsys.readouterr().err
    assert main([*args, "--n", "3", "--data", str(second), "--merge", str(folder / FILENAME)]) == 2
    assert "not 3-grams" in capsys.readouterr().err
    assert NgramStore.load(folder / FILENAME).propose([4, 5], 3) == [6, 7]  # a refused merge wrote nothing


def test_cli_max_entries_caps_the_store_at_the_ngrams_counted_most_often(tmp_path: Path, capsys):
    folder = tmp_path / "drafter"
    save_drafter(tiny_drafter(tiny_target("llama"), block_size=4), folder)
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"num_shards": 1}))
    records = [
        {"id": 0, "prompt_ids": [1], "response_ids": [4, 5, 6, 4, 5, 6, 4, 5, 6, 9], "finished": True},
        {"id": 1, "prompt_ids": [2], "response_ids": [7, 8, 10], "finished": True},
    ]
    (data / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = ["ngram-store", "--data", str(data), "--out", str(folder), "--n", "2", "--min-count", "1"]
    assert main(args) == 0
    full = NgramStore.load(folder / FILENAME)
    assert main([*args, "--max-entries", "2"]) == 0
    assert "the 2 counted most often kept of " + str(len(full)) in capsys.readouterr().err
    capped = NgramStore.load(folder / FILENAME)
    assert capped.table == {(4, 5): 6, (5, 6): 4}  # 3 and 2 times; (6, 4) -> 5 twice too, but after (5, 6)
    assert capped.counts == {(4, 5): 3, (5, 6): 2}
    assert main([*args, "--max-entries", "0"]) == 2 and "--max-entries" in capsys.readouterr().err
    assert NgramStore.load(folder / FILENAME).table == capped.table  # a refused run wrote nothing


def test_cli_refuses_answers_of_another_vocabulary(tmp_path: Path, capsys):
    folder = tmp_path / "drafter"
    save_drafter(tiny_drafter(tiny_target("llama"), block_size=4), folder)
    data = tmp_path / "data"
    data.mkdir()
    records = [{"id": 0, "prompt_ids": [1, 2, 3], "response_ids": [4, 999999, 6, 7] * 2, "finished": True}]
    (data / "meta.json").write_text(json.dumps({"num_shards": 1}))
    (data / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["ngram-store", "--data", str(data), "--out", str(folder), "--n", "2", "--min-count", "1"]) == 2
    assert "another tokenizer" in capsys.readouterr().err and not (folder / "ngram_store.safetensors").exists()
