"""Benchmark questions: packaged sets with their templates, FastChat / Spec-Bench files, Hugging Face rows."""

from __future__ import annotations

import json
import sys
import types

import pytest

from dflashkit.bench.datasets import PACKAGED, available_packaged, hf_questions, load_questions, question_file
from dflashkit.errors import InvalidInputError
from dflashkit.training.evalsets import HUMANEVAL_PREFIX, MATH_SUFFIX, load_set


@pytest.mark.parametrize("name", sorted(PACKAGED))
def test_packaged_sets_match_evalsets(name: str) -> None:
    if name not in available_packaged():
        pytest.skip(f"{name} is not installed (scripts/setup.sh installs it)")
    set_name, questions = load_questions(name, limit=4, seed=3)
    assert set_name == name and len(questions) == 4
    assert [q.turns[0] for q in questions] == load_set(name, 4, 3)  # same subset, same templates
    assert len({q.question_id for q in load_questions(name)[1]}) == len(load_questions(name)[1])
    if name == "mt-bench":
        assert all(len(q.turns) == 2 and q.category for q in questions)
    elif name == "humaneval":
        assert all(q.turns[0].startswith(HUMANEVAL_PREFIX) for q in questions)
    else:
        assert all(q.turns[0].endswith(MATH_SUFFIX) for q in questions)


def write_questions(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return str(path)


def test_question_file_fastchat_format(tmp_path) -> None:
    path = write_questions(
        tmp_path / "spec_bench.jsonl",
        [
            {"question_id": 1, "category": "qa", "turns": ["Hi?", "And then?"]},
            {"question_id": "x2", "category": "math", "turns": ["2+2?"]},
        ],
    )
    name, qs = load_questions(path)
    assert name == "spec_bench" and [q.question_id for q in qs] == ["1", "x2"]
    assert qs[0].turns == ("Hi?", "And then?") and qs[1].category == "math"
    assert load_questions("jsonl:" + path)[1] == qs
    a = load_questions(path, limit=1, seed=5)[1]
    assert len(a) == 1 and a == load_questions(path, limit=1, seed=5)[1]


@pytest.mark.parametrize(
    "line, message", [('{"turns": []}', "turns"), ("{oops", "invalid JSON"), ('{"prompt": "x"}', "turns")]
)
def test_question_file_errors_name_the_line(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"turns": ["ok"]}\n' + line + "\n")
    with pytest.raises(InvalidInputError, match=f"line 2: .*{message}"):
        question_file(path)


def test_unknown_spec_missing_file_and_bad_limit(tmp_path) -> None:
    with pytest.raises(InvalidInputError, match="unknown data set"):
        load_questions("gsm8k")
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_questions(str(tmp_path / "none.jsonl"))
    path = write_questions(tmp_path / "q.jsonl", [{"turns": ["a"]}])
    with pytest.raises(InvalidInputError, match="limit"):
        load_questions(path, limit=-1)


def test_hf_rows_templates_and_fields() -> None:
    rows = [{"task_id": "HumanEval/0", "prompt": "def f():\n"}]
    (q,) = hf_questions("openai/openai_humaneval", rows)
    assert q.question_id == "HumanEval/0" and q.turns[0] == HUMANEVAL_PREFIX + "def f():\n" + "\n```"
    (m,) = hf_questions("HuggingFaceH4/MATH-500", [{"problem": "1+1?", "answer": "2"}])
    assert m.turns[0] == "1+1?" + MATH_SUFFIX
    (t,) = hf_questions("some/chat", [{"question_id": 7, "turns": ["a", "b"]}])
    assert t.turns == ("a", "b") and t.question_id == "7"
    (f,) = hf_questions("some/set", [{"body": "hello", "prompt": "not this"}], field="body")
    assert f.turns == ("hello",)
    with pytest.raises(InvalidInputError, match="row 0"):
        hf_questions("some/set", [{"nothing": 1}])


def test_hf_spec_uses_the_datasets_library(monkeypatch) -> None:
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return [{"question": f"q{i}"} for i in range(5)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    name, qs = load_questions("hf:org/gsm8k:train:question", limit=2)
    assert name == "org/gsm8k" and calls == [("org/gsm8k", "train")]
    assert len(qs) == 2 and all(q.turns[0].endswith(MATH_SUFFIX) for q in qs)
