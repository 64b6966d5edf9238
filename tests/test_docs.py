"""The README and the pages under docs/ say only what works: every command in them parses with today's CLI, every
script they name exists and takes the flags shown, every Python block compiles, every relative link resolves, and the
blocks marked ``<!-- runnable -->`` (on the line before the fence) run as written, with their small limits."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from dflashkit.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if "benchmarks" not in p.relative_to(ROOT / "docs").parts)
DOCS = [README, *PAGES]
MARK = "<!-- runnable -->"
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
SHELL = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    body: str
    runnable: bool

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        body = "\n".join(line[len(m["indent"]) :] for line in m["body"].splitlines())
        out.append(Block(path, text.count("\n", 0, m.start()) + 1, m["lang"].lower(), body, before == MARK))
    return out


ALL_BLOCKS = [b for doc in DOCS for b in blocks(doc)]


def commands(body: str) -> list[list[str]]:
    """Each simple command of a shell block, as words: continuation lines joined, comments dropped, split at
    ``&&``, ``||``, ``;`` and ``|``; a leading ``$ `` prompt and ``VAR=value`` assignments skipped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            words = list(lexer)
        except ValueError:
            continue  # a here-document or other shell syntax beyond simple commands
        current: list[str] = []
        for w in [*words, ";"]:
            if w and set(w) <= set(";&|"):
                if current:
                    out.append(current)
                current = []
            elif not current and re.fullmatch(r"\w+=.*", w):
                continue
            else:
                current.append(w)
    return out


def dflashkit_args(words: list[str]) -> list[str] | None:
    head = words[0]
    if head.endswith("dflashkit") and not head.endswith("/dflashkit/"):
        return words[1:]
    if len(words) > 2 and head.endswith("python") and words[1:3] == ["-m", "dflashkit"]:
        return words[3:]
    return None


SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in SHELL]
CLI_LINES = [
    pytest.param(args, id=f"{b}:{' '.join(args[:2])}")
    for b in SHELL_BLOCKS
    for words in commands(b.body)
    if (args := dflashkit_args(words)) is not None and args
]
SCRIPT_LINES = [
    pytest.param(words, id=f"{b}:{words[1]}")
    for b in SHELL_BLOCKS
    for words in commands(b.body)
    if len(words) > 1
    and words[0] in ("python", "python3", ".venv/bin/python", "bash")
    and words[1].startswith("scripts/")
]


def test_there_is_something_to_check() -> None:
    assert len(PAGES) >= 8 and CLI_LINES and SCRIPT_LINES


def test_the_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.parametrize("args", CLI_LINES)
def test_every_dflashkit_command_parses(args: list[str]) -> None:
    parser = build_parser()
    try:
        parser.parse_args(args)
    except SystemExit as e:
        assert e.code == 0, f"`dflashkit {shlex.join(args)}` does not parse with today's CLI"


@cache
def script_help(script: str) -> str:
    path = ROOT / script
    runner = ["bash"] if path.suffix == ".sh" else [sys.executable]
    done = subprocess.run([*runner, str(path), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, f"{script} --help failed: {done.stderr[-500:]}"
    return done.stdout


@pytest.mark.parametrize("words", SCRIPT_LINES)
def test_every_script_named_exists_and_takes_its_flags(words: list[str]) -> None:
    script = words[1]
    assert (ROOT / script).is_file(), f"{script} does not exist"
    help_text = script_help(script)
    for w in words[2:]:
        flag = w.split("=", 1)[0]
        if flag.startswith("--"):
            assert flag in help_text, f"{script} takes no {flag}"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang == "python"], ids=str)
def test_every_python_block_compiles(block: Block) -> None:
    ast.parse(block.body, filename=str(block))


LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    """README links may point anywhere in the repository; docs pages only at docs pages and files under docs/ (the
    site is built from docs/ alone: `mkdocs build --strict` fails on the rest too)."""
    text = FENCE.sub("", doc.read_text())
    for target in LINK.findall(text):
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"
        if doc != README:
            assert path.is_relative_to(ROOT / "docs"), f"{doc.relative_to(ROOT)} links outside docs/: {target}"


RUNNABLE = [b for b in ALL_BLOCKS if b.runnable]


@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_runnable_blocks_run_as_written(block: Block, tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if block.lang in SHELL:
        cmd = ["bash", "-euo", "pipefail", "-c", block.body]
    elif block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(block.body)
        cmd = [sys.executable, str(script)]
    else:
        pytest.fail(f"{block}: a runnable block must be bash or python, not {block.lang!r}")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{block} failed ({done.returncode}):\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
