"""scripts/check_words.py: the rules catch the words of a work log and let the project's own words through."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_words", ROOT / "scripts" / "check_words.py")
check_words = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_words)


# The words the rules look for, so that sentences of a work log can be built around them below (this file is exempt
# from the check, and still states none of them as a finished phrase).
PERIOD, MACHINE, BORROWED = "session", "VM", "lent"


@pytest.mark.parametrize(
    "line",
    [
        f"measured in {PERIOD} 42 on the new kernels",
        f"{PERIOD}s 13-14 ran on AVX2",
        f"15 minutes of a GPU {PERIOD}'s data time",
        f"on the Zen 4 {MACHINE} the product takes 5 ms",
        f"speedup on this {MACHINE} moves with the machine",
        f"on 2-core {MACHINE}s, greedy",
        f"trained on a {BORROWED} H100 in 15 minutes",
        f"brought back from a {BORROWED} GPU machine",
        "see " + "/".join(["", "work", "jobs", "s46", "bench"]) + " for the table",
        "name_or_path: " + "/".join(["", "root", ".cache", "dflashkit", "smollm2"]),
        "--data " + "/".join(["", "tmp", "dk", "data", "gpu"]) + " --out THIS",
    ],
)
def test_work_log_words_are_caught(line: str) -> None:
    assert check_words.check_text(line), line


@pytest.mark.parametrize(
    "line",
    [
        "a chat session knows the tokens of its turns",
        "session = ChatSession(gen, system='terse')",
        "requests.Session() keeps the connection",
        "A cache is lent to one generation at a time",
        "measured on a 2-core AMD EPYC Zen 4 (AVX512-BF16), 2026-11-28, commit 9f6070c",
        "tmp=$(mktemp -d); dflashkit train --out $tmp/run",
        "KVM guests report the host's CPU model",
        "~/.cache/dflashkit/llama.cpp",
        "cache at $HOME/.cache/dflashkit/",
    ],
)
def test_the_projects_own_words_pass(line: str) -> None:
    assert check_words.check_text(line) == [], line


def test_a_file_with_a_hit_fails_and_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "notes.md"
    bad.write_text("fine line\nmeasured in session 7\n")
    assert check_words.main([str(bad)]) == 1
    assert ":2: a numbered work session" in capsys.readouterr().out
    bad.write_text("fine line\n")
    assert check_words.main([str(bad)]) == 0


def test_the_repository_is_clean() -> None:
    """The CI gate itself: every tracked file passes (scripts/check_words.py also runs in .ci/run)."""
    problems = check_words.check_files(check_words.tracked_files())
    assert problems == [], "\n".join(problems[:20])
