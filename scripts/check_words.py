"""Fail when a tracked file speaks of how the project was made instead of what it is.

The repository describes dflashkit, its results and how to reproduce them. It does not name the periods of work it
was built in, folders on a developer's machine, that machine itself, or hardware borrowed to build it. Results are
stated as a user can reproduce them: the command, the CPU or GPU model, the date, the version or commit.

    python scripts/check_words.py            # every file git tracks; exit 1 and list each hit
    python scripts/check_words.py FILE ...   # only these files

Run by ``.ci/run``. A path inside a code example that creates it (``mktemp``, ``tmp_path``) is fine: the rules
match the words, not the examples, and this file and its test are the only ones exempt.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, pattern): case-insensitive unless the pattern says otherwise.
RULES: list[tuple[str, re.Pattern[str]]] = [
    ("a numbered work session", re.compile(r"\bsessions?\s+\d+", re.I)),
    (
        "a work session",
        re.compile(
            r"\b(work|gpu|h100|h200|device|training|\d+-minute|next|previous|earlier|later)\s+sessions?\b",
            re.I,
        ),
    ),
    ("the developer's machine", re.compile(r"\b(this|the|that|our)\s+([\w-]+\s+){0,3}VMs?\b")),
    ("a virtual machine as the subject", re.compile(r"\b\d-core\s+VMs?\b")),
    ("borrowed hardware", re.compile(r"\blent\s+(an?\s+)?(h100|h200|gpus?|machines?|devices?|accelerators?)\b", re.I)),
    ("an absolute path on a developer's machine", re.compile(r"(?<![\w.~])/(work|root|home/\w+|Users/\w+)/")),
    ("a temporary path from a work log", re.compile(r"(?<![\w.~$}])/tmp/[\w.-]+/")),
]

EXEMPT = {"scripts/check_words.py", "tests/test_check_words.py"}
BINARY = {".safetensors", ".pt", ".png", ".gguf", ".bin", ".ico", ".jpg", ".woff2"}


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def check_text(text: str) -> list[tuple[int, str, str]]:
    """(line number, rule name, the line) for every hit in ``text``."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for name, pattern in RULES:
            if pattern.search(line):
                hits.append((number, name, line.strip()))
    return hits


def check_files(paths: list[Path]) -> list[str]:
    problems = []
    for path in paths:
        rel = path.resolve().relative_to(ROOT).as_posix() if path.resolve().is_relative_to(ROOT) else str(path)
        if rel in EXEMPT or path.suffix in BINARY or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, name, line in check_text(text):
            problems.append(f"{rel}:{number}: {name}: {line[:160]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="files to check (default: every file git tracks)")
    args = parser.parse_args(argv)
    problems = check_files(args.files or tracked_files())
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} line(s) speak of the work rather than the project (scripts/check_words.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
