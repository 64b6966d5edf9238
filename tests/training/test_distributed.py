"""Data-parallel training and data generation: two processes (gloo, on the CPU) do what one does.

The processes are started the way torchrun starts them (its environment variables); `torchrun --nproc-per-node 2
-m dflashkit data|train ...` itself was run by hand (docs/training.md)."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest
import torch

from dflashkit.training.distributed import Parallel

# 14 sequences: 1 held out, 13 train in steps of 3 (the fifth step has 1: one process idles at loss weight 0)
RUN = {
    "num_layers": 2,
    "block_size": 4,
    "gamma": 4.0,
    "anchors_per_seq": 8,
    "seqs_per_step": 3,
    "grad_accum": 2,
    "steps": 6,
    "lr": 3e-3,
    "eval_every": 0,
    "checkpoint_every": 100,
    "draft_vocab_size": None,
    "eval_prompts": 4,
    "max_seq_len": 64,
    "distill_topk": 4,
    "precision": "fp32",
}  # fp32: the comparisons below are tight


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shares_cover_every_row_once(world):
    for count in range(12):
        shares = [list(Parallel(rank=r, world_size=world).share(count)) for r in range(world)]
        assert [row for share in shares for row in share] == list(range(count))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def _trainer(folder, parallel=None, **overrides):
    from dflashkit.training.distributed import SINGLE
    from dflashkit.training.trainer import TrainConfig, Trainer
    from tests.conftest import tiny_target
    from tests.training.test_trainer import FakeTokenizer, tiny_corpus

    model = tiny_target("llama")
    seqs = tiny_corpus(model, 14, seed=4, new_tokens=14)
    cfg = TrainConfig(data_dir="", out_dir=str(folder), **{**RUN, **overrides})
    return Trainer(cfg, model, FakeTokenizer(), sequences=seqs, log=lambda *_: None, parallel=parallel or SINGLE)


def _worker(rank: int, world: int, port: int, root: str) -> None:
    """One of `world` processes, with the environment torchrun gives it: trainer runs (a: uninterrupted; b: killed
    after step 4, resumed; c: the last process alone gets SIGTERM during step 3), then the `data` and `train`
    commands as `torchrun -m dflashkit` runs them (their output kept in ROOT/out-RANK.txt)."""
    import contextlib

    from tests.training.test_trainer import before_step, process_dies

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )  # what torchrun sets
    torch.set_num_threads(1)
    from dflashkit.training.distributed import from_environment

    parallel, device = from_environment("cpu")
    assert parallel.world_size == world and device == "cpu" and parallel.owns_group
    root = Path(root)
    _trainer(root / "a", parallel).run(resume=False, progress=False)

    killed = _trainer(root / "b", parallel, checkpoint_every=2)
    before_step(killed, 4, process_dies)  # every process dies between checkpoints
    try:
        killed.run(resume=False, progress=False)
    except KeyboardInterrupt:
        pass
    _trainer(root / "b", parallel, checkpoint_every=2).run(resume=True, progress=False)

    stopped = _trainer(root / "c", parallel)
    if parallel.rank == world - 1:  # this process only, during step 3
        before_step(stopped, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        stopped.run(resume=False, progress=False)
        raise AssertionError("the stop request was not seen")
    except KeyboardInterrupt:
        pass

    from dflashkit.cli.main import main
    from dflashkit.training import sources as data
    from tests.training.test_sources import EVAL

    data.evaluation_prompts = lambda: EVAL
    with open(root / f"out-{rank}.txt", "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        codes = [
            main(["data", "--out", str(root / "data"), *_data_args(root.parent)]),
            main(["train", *_train_args(root.parent), "--data", str(root / "data"), "--out", str(root / "run")]),
        ]
    assert codes == [0, 0], codes
    parallel.close()


def _data_args(tmp: Path) -> list[str]:
    return [
        "--target",
        str(tmp / "target"),
        "--sources",
        f"jsonl:{tmp / 'p.jsonl'}",
        "--num-prompts",
        "30",
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


def _train_args(tmp: Path) -> list[str]:
    return [
        "--target",
        str(tmp / "target"),
        "--layers",
        "1",
        "--block-size",
        "4",
        "--steps",
        "3",
        "--anchors",
        "4",
        "--seqs-per-step",
        "4",
        "--eval-every",
        "3",
        "--draft-vocab",
        "0",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "checkpoint" / "model.safetensors")


TOLERANCE = 1e-5


def _assert_same_drafter(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=TOLERANCE, rtol=1e-4, msg=f"{name}: {a} vs {b}")


def _log(folder: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (folder / "train_log.jsonl").read_text().splitlines()]


def test_two_processes_train_what_one_does_and_resume_and_stop_together(tmp_path, monkeypatch):
    from dflashkit.cli.main import main
    from dflashkit.training import sources as data
    from tests.training.test_sources import EVAL, make_model, make_tokenizer, word_prompts, write_jsonl

    make_model(torch.bfloat16).save_pretrained(tmp_path / "target")  # a local target for the commands
    make_tokenizer().save_pretrained(tmp_path / "target")
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in word_prompts(30, seed=2)])
    torch.multiprocessing.spawn(_worker, args=(2, _free_port(), str(tmp_path / "two")), nprocs=2, join=True)
    two = tmp_path / "two"
    one = _trainer(tmp_path / "one")
    one.run(resume=False, progress=False)

    # the same steps: the processes' loss parts add up to the one-process loss, the averaged gradient is the
    # one-process gradient (its norm too: Adam would hide a wrong scale), and the weights agree
    for key in ("loss", "hard_loss", "soft_loss", "grad_norm"):
        assert _log(two / "a", key) == pytest.approx(_log(tmp_path / "one", key), rel=1e-5), key
    assert [a[0] for a in _log(two / "a", "acc")] == pytest.approx([a[0] for a in _log(tmp_path / "one", "acc")])
    _assert_same_drafter(two / "a", tmp_path / "one")
    untrained = _trainer(tmp_path / "untrained").drafter.state_dict()
    moved = max(float((w - untrained[n].float()).abs().max()) for n, w in _weights(tmp_path / "one").items())
    assert moved > 1000 * TOLERANCE  # the tolerance is far below what training changed

    # killed after step 4 (checkpoint at 4), resumed: the uninterrupted run's weights, a log without repeats
    _assert_same_drafter(two / "b", two / "a")
    assert [json.loads(x)["step"] for x in (two / "b" / "train_log.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]

    # one process signalled during step 3: both stopped after it, the checkpoint is step 3
    state = torch.load(two / "c" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 3
    # ... and one process resumes what two began
    resumed = _trainer(two / "c")
    resumed.run(resume=True, progress=False)
    assert resumed.step == 6
    _assert_same_drafter(two / "c", tmp_path / "one")
    assert not (two / "a" / "features").exists() and (two / "a" / "features-rank1").is_dir()  # a cache per process

    # `dflashkit data` over two processes writes the shards one process writes, byte for byte
    monkeypatch.setattr(data, "evaluation_prompts", lambda: EVAL)
    torch.set_num_threads(1)
    assert main(["data", "--out", str(tmp_path / "data-one"), *_data_args(tmp_path)]) == 0
    shards = sorted(p.name for p in (tmp_path / "data-one").glob("shard-*.jsonl"))
    assert len(shards) == 8 and shards == sorted(p.name for p in (two / "data").glob("shard-*.jsonl"))
    for name in shards:  # each batch is seeded by its shard: the same records, whichever process made them
        assert (tmp_path / "data-one" / name).read_text() == (two / "data" / name).read_text()
    meta = json.loads((two / "data" / "meta.json").read_text())
    assert len(meta["shards"]) == 8 and meta["totals"]["written"] == 30  # both processes' statistics
    printed = [(two / f"out-{rank}.txt").read_text() for rank in (0, 1)]
    assert "over 2 processes" in printed[0] and printed[1] == ""  # the first process speaks for both
    assert f"{two / 'data'}\n" in printed[0] and f"{two / 'run' / 'drafter'}\n" in printed[0]

    # `dflashkit train` over two processes: one log, the τ estimate, the drafter
    assert "(2 processes" in printed[0]
    log = [json.loads(x) for x in (two / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and "tau" in log[-1]
    assert json.loads((two / "run" / "run_config.json").read_text())["processes"] == 2
    assert (two / "run" / "drafter" / "model.safetensors").is_file()
