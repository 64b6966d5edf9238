"""Evaluation prompts and their templates."""

from __future__ import annotations

import pytest

from dflashkit.errors import InvalidInputError
from dflashkit.training.evalsets import HUMANEVAL_PREFIX, MATH_SUFFIX, available_sets, load_set

EXPECTED = {"mt-bench": 80, "humaneval": 164, "math500": 311}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sets_load_with_their_templates(name):
    if name not in available_sets():
        pytest.skip(f"{name} is not installed (scripts/setup.sh installs it)")
    prompts = load_set(name)
    assert len(prompts) == EXPECTED[name] and len(set(prompts)) == len(prompts)
    if name == "humaneval":
        assert all(p.startswith(HUMANEVAL_PREFIX) and p.endswith("```") for p in prompts)
    if name == "math500":
        assert all(p.endswith(MATH_SUFFIX) for p in prompts)
    subset = load_set(name, limit=5, seed=1)
    assert len(subset) == 5 and set(subset) <= set(prompts) and subset == load_set(name, limit=5, seed=1)


def test_unknown_set_is_refused():
    with pytest.raises(InvalidInputError, match="unknown evaluation set"):
        load_set("gsm8k")
