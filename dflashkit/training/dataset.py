"""The training data on disk: regenerated shards (format, atomic partial writes, checks), and their loading as training
sequences and batches."""

from __future__ import annotations

import json
import os
import pathlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.errors import DataError, InvalidInputError

DATA_FORMAT = "dflashkit-data/1"


def shard_path(out_dir: str | os.PathLike, index: int) -> pathlib.Path:
    return pathlib.Path(out_dir) / f"shard-{index:05d}.jsonl"


def partial_shard_path(out_dir: str | os.PathLike, index: int) -> pathlib.Path:
    """Batches of shard ``index`` finished so far (one record per line), until the shard itself is written."""
    return pathlib.Path(out_dir) / f"shard-{index:05d}.partial.jsonl"


def write_records(f: Any, records: Iterable[dict[str, Any]]) -> None:
    """Records as JSON lines (the format of shards and partial shards)."""
    f.writelines(json.dumps(r) + "\n" for r in records)


def read_partial(path: pathlib.Path) -> list[dict[str, Any]]:
    """The complete records of a partial shard; a line torn by a kill (the last one) is dropped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and {"id", "prompt_ids", "response_ids", "finished"} <= set(record):
            records.append(record)
    return records


def canonical_prompt(prompt: Prompt) -> Prompt:
    """A prompt as stored in prompts.jsonl (JSON round trip: tuples become lists)."""
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, (list, tuple))
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
        and prompt
    ):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    raise InvalidInputError(f"a prompt must be text or a list of chat messages, got {prompt!r:.80}")


def _checked_ids(rec: Any) -> bool:
    ids = [rec.get(k) if isinstance(rec, dict) else None for k in ("prompt_ids", "response_ids")]
    return all(isinstance(x, list) and all(isinstance(t, int) and t >= 0 for t in x) for x in ids)


def read_shard(path: pathlib.Path) -> list[dict[str, Any]]:
    """A shard's records; a damaged line is an error naming the file and line (never a bare JSON traceback)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not a JSON record ({e.msg}); the shard is damaged: delete it "
                    "and run the same `dflashkit data` command again to regenerate it"
                ) from None
            if not _checked_ids(rec):
                raise DataError(f"{path}:{lineno}: prompt_ids and response_ids must be lists of token ids >= 0")
            records.append(rec)
    return records


def load_shards(
    out_dir: str | os.PathLike, *, require_complete: bool = False, include_partial: bool = False
) -> list[dict[str, Any]]:
    """The records of every shard written in ``out_dir``, in prompt order:
    ``{"id", "prompt_ids", "response_ids", "finished"}``. With ``require_complete``, a missing shard is an error;
    with ``include_partial``, a shard not yet complete gives the answers already finished in it (its
    ``.partial.jsonl``: what a run stopped mid-shard has answered; a line torn by a kill is left out)."""
    out = pathlib.Path(out_dir).expanduser()
    meta_file = out / "meta.json"
    if not meta_file.is_file():
        raise DataError(f"{out} holds no regenerated data (no meta.json)")
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    records: list[dict[str, Any]] = []
    missing = []
    for k in range(int(meta["num_shards"])):
        path = shard_path(out, k)
        if path.is_file():
            records.extend(read_shard(path))
        else:
            missing.append(k)
            if include_partial:
                partial = read_partial(partial_shard_path(out, k))
                if not all(map(_checked_ids, partial)):
                    raise DataError(
                        f"{partial_shard_path(out, k)}: prompt_ids and response_ids must be lists of token ids >= 0"
                    )
                records.extend(sorted(partial, key=lambda r: r["id"]))  # answered in length order
    if missing and require_complete:
        raise DataError(
            f"{out} is incomplete: {len(missing)} of {meta['num_shards']} shards missing "
            "(run the regeneration again to finish it)"
        )
    return records


@dataclass
class TrainingSequence:
    input_ids: list[int]
    num_prompt: int  # tokens before the response
    source: int = 0  # index of the data folder it came from


def data_folders(data_dir: str | os.PathLike) -> list[Path]:
    """One data folder, or several separated by commas."""
    return [Path(p).expanduser() for p in str(data_dir).split(",") if p.strip()]


def load_sequences(data_dir: str | os.PathLike, max_len: int) -> list[TrainingSequence]:
    """Prompt + regenerated response pairs from `dflashkit data` shards (one or comma-separated folders, in
    order; a shard still in progress gives the answers finished in it), cut to max_len tokens.

    A prompt may come with several responses (e.g. sampled regenerations at a temperature): each distinct one
    is kept. A response that repeats one already kept for the same prompt, or is a prefix of it (the same greedy
    answer with a shorter length limit), is used once; a longer one replaces the shorter it extends.
    """
    from dflashkit.training.dataset import load_shards

    kept: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}  # prompt -> [(response, source)]
    for source, folder in enumerate(data_folders(data_dir)):
        for rec in load_shards(folder, include_partial=True):  # a shard in progress gives its finished answers
            prompt, response = tuple(rec["prompt_ids"]), tuple(rec["response_ids"])
            answers = kept.setdefault(prompt, [])
            if any(old[: len(response)] == response for old, _ in answers):
                continue  # the same answer, or a prefix of one already kept
            extended = [i for i, (old, _) in enumerate(answers) if response[: len(old)] == old]
            if extended:
                answers[extended[0]] = (response, answers[extended[0]][1])
            else:
                answers.append((response, source))
    seqs = []
    for prompt, answers in kept.items():
        for response, source in answers:
            ids = list(prompt + response)[:max_len]
            if len(ids) - len(prompt) >= 2:
                seqs.append(TrainingSequence(ids, len(prompt), source))
    if not seqs:
        raise InvalidInputError(f"{data_dir}: no training sequences with at least 2 response tokens")
    return seqs


def batches(seqs: list[TrainingSequence], per_step: int, seed: int) -> Iterator[list[TrainingSequence]]:
    """Endless batches of similar-length sequences (length-bucketed, reshuffled every epoch)."""
    rng = random.Random(seed)
    while True:
        order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i].input_ids), rng.random()))
        groups = [order[i : i + per_step] for i in range(0, len(order), per_step)]
        rng.shuffle(groups)
        for g in groups:
            yield [seqs[i] for i in g]


GPU_PAD_MULTIPLE = 16  # see Trainer.pad_multiple


def padded_length(length: int, multiple: int) -> int:
    """`length` rounded up to a multiple of `multiple`."""
    return -(-length // multiple) * multiple


def collate(batch: list[TrainingSequence], pad_id: int, multiple: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """input_ids [S, L] (right-padded to a multiple of `multiple`), loss_mask [S, L] (response tokens), lengths [S]."""
    L = padded_length(max(len(s.input_ids) for s in batch), multiple)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), L), dtype=torch.bool)
    for i, s in enumerate(batch):
        ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
        mask[i, s.num_prompt : len(s.input_ids)] = True
    return ids, mask, torch.tensor([len(s.input_ids) for s in batch])


def draft_vocabulary(seqs: list[TrainingSequence], size: int) -> Tensor:
    """The `size` most frequent response tokens: the loss's vocabulary (cheaper LM head in training)."""
    counts = torch.zeros(max(max(s.input_ids) for s in seqs) + 1, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(torch.tensor(s.input_ids[s.num_prompt :]), minlength=counts.numel())
    return counts.argsort(descending=True)[:size].sort().values


Prompt = str | list[dict[str, str]]  # one user turn, or chat messages ending with a user turn
