"""The README and the pages under docs/ say only what works: every command in them parses with today's CLI, every
script they name exists and takes the flags shown, every Python block compiles, every relative link resolves, and the
blocks marked ``<!-- runnable -->`` (on the line before the fence) run as written, with their small limits:
``<!-- runnable: stdin=TEXT -->`` with TEXT as their input, ``<!-- runnable: server -->`` a server that the next
block marked ``<!-- runnable: client -->`` calls; a page whose first line after the title is
``<!-- python blocks run in order -->`` runs all its Python blocks as one script, in order (each later block reuses
what the earlier ones made), except those marked ``<!-- not run: WHY -->``."""

from __future__ import annotations

import ast
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx
import pytest

from dflashkit.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if "benchmarks" not in p.relative_to(ROOT / "docs").parts)
DOCS = [README, *PAGES]
MARK = re.compile(r"<!-- runnable(?::\s*(?P<how>.*?))?\s*-->")
NOT_RUN = re.compile(r"<!-- not run: .+ -->")
IN_ORDER = "<!-- python blocks run in order -->"
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
SHELL = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    body: str
    runnable: bool
    how: str = ""  # the runnable mark's detail: "", "stdin=TEXT", "server" or "client"
    skipped: bool = False  # marked <!-- not run: WHY -->

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        body = "\n".join(line[len(m["indent"]) :] for line in m["body"].splitlines())
        mark = MARK.fullmatch(before)
        line = text.count("\n", 0, m.start()) + 1
        how = (mark["how"] or "") if mark else ""
        out.append(
            Block(path, line, m["lang"].lower(), body, mark is not None, how, NOT_RUN.fullmatch(before) is not None)
        )
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


RUNNABLE = [b for b in ALL_BLOCKS if b.runnable and (b.how == "" or b.how.startswith("stdin="))]
SERVED = [
    (b, next(c for c in ALL_BLOCKS[i + 1 :] if c.how == "client"))
    for i, b in enumerate(ALL_BLOCKS)
    if b.how == "server"
]
IN_ORDER_PAGES = [doc for doc in DOCS if IN_ORDER in doc.read_text().split("\n", 3)[:3]]


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def _command(block: Block, tmp_path: Path) -> list[str]:
    if block.lang in SHELL:
        return ["bash", "-euo", "pipefail", "-c", block.body]
    if block.lang == "python":
        script = tmp_path / f"block{block.line}.py"
        script.write_text(block.body)
        return [sys.executable, str(script)]
    pytest.fail(f"{block}: a runnable block must be bash or python, not {block.lang!r}")


def _check(block: object, done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"{block} failed ({done.returncode}):\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"


def test_every_runnable_mark_is_known() -> None:
    for b in ALL_BLOCKS:
        assert not b.runnable or b.how in ("", "server", "client") or b.how.startswith("stdin="), f"{b}: {b.how!r}"
    assert all(client.lang == "python" for _, client in SERVED), "a client block is Python"


@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_runnable_blocks_run_as_written(block: Block, tmp_path: Path) -> None:
    stdin = block.how[len("stdin=") :].replace("\\n", "\n") + "\n" if block.how.startswith("stdin=") else None
    done = subprocess.run(
        _command(block, tmp_path), cwd=ROOT, env=_env(), input=stdin, capture_output=True, text=True, timeout=600
    )
    _check(block, done)
    if stdin is not None:
        assert done.stdout.strip(), f"{block} answered nothing to its input"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("server", "client"), SERVED, ids=lambda b: str(b))
def test_served_blocks_answer_their_client(server: Block, client: Block, tmp_path: Path) -> None:
    """The server block runs in the background (on a free port in place of the one written, which may be taken
    here), the client block calls it, then the server is stopped with SIGTERM and exits cleanly."""
    written = re.search(r"--port (\d+)", server.body)
    assert written is not None and written[1] in client.body, f"{server}: the client must call the server's port"
    port = str(_free_port())
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", "exec " + server.body.strip().replace(written[1], port)],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"{server} exited: {proc.communicate()[1][-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{server} did not come up"
            time.sleep(0.2)
        moved = Block(client.path, client.line, client.lang, client.body.replace(written[1], port), True)
        done = subprocess.run(
            _command(moved, tmp_path), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
        )
        _check(client, done)
        assert done.stdout.strip(), f"{client} printed nothing"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    assert proc.returncode == 0, f"{server} did not shut down cleanly ({proc.returncode}):\n{err[-3000:]}"


@pytest.mark.parametrize("doc", IN_ORDER_PAGES, ids=lambda d: str(d.relative_to(ROOT)))
def test_pages_python_blocks_run_in_order(doc: Path, tmp_path: Path) -> None:
    """One script of the page's Python blocks, in order, each announced so that a failure names its block; run in
    an empty folder, where the examples write what they make."""
    parts = []
    for b in blocks(doc):
        if b.lang == "python" and not b.skipped:
            parts.append(f"print({str(b)!r} + ' ...', file=__import__('sys').stderr, flush=True)\n{b.body}\n")
    assert parts, f"{doc} runs no Python block"
    script = tmp_path / "page.py"
    script.write_text("\n".join(parts))
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, str(script)], cwd=work, env=_env(), capture_output=True, text=True, timeout=900
    )
    _check(doc.relative_to(ROOT), done)


def test_every_page_runs_its_python_examples() -> None:
    """The pages whose Python examples are the API's documentation run them (the rest hold records and recipes)."""
    names = {d.relative_to(ROOT).as_posix() for d in IN_ORDER_PAGES}
    assert {"docs/python-api.md"} <= names
