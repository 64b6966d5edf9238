"""The tools in scripts/ answer --help: each parses its arguments before it loads anything heavy, and its docstring
(the help text) says how to run it. The shell scripts parse, and those with a --help print it without side effects."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
PYTHON_SCRIPTS = sorted(SCRIPTS.glob("*.py"))
SHELL_SCRIPTS = sorted(SCRIPTS.glob("*.sh"))
SHELL_HELP = ("get_llama_cpp.sh", "gpu_train.sh")  # setup.sh has no --help: it installs


@pytest.mark.parametrize("script", PYTHON_SCRIPTS, ids=lambda p: p.name)
def test_python_script_help(script: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]


@pytest.mark.parametrize("script", PYTHON_SCRIPTS, ids=lambda p: p.name)
def test_python_script_says_how_to_run_it(script: Path) -> None:
    doc = ast.get_docstring(ast.parse(script.read_text()))
    assert doc, f"{script.name} has no module docstring"
    assert f"scripts/{script.name}" in doc, f"{script.name}'s docstring shows no command line"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("name", SHELL_HELP)
def test_shell_script_help(name: str) -> None:
    done = subprocess.run(["bash", str(SCRIPTS / name), "--help"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert f"scripts/{name}" in done.stdout, done.stdout[:500]
