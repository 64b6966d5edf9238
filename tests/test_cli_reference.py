"""docs/cli.md is the page scripts/cli_reference.py writes from today's parser: current, with every subcommand and
every option string of the CLI in it, and the same whatever the environment holds."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from dflashkit.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli_reference = _script()


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_the_page_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_reference.main(["--check", str(PAGE)])
    assert code == 0, capsys.readouterr().err


def test_a_stale_page_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "cli.md"
    stale.write_text(PAGE.read_text().replace("## dflashkit serve", "## dflashkit serve (old)"))
    assert cli_reference.main(["--check", str(stale)]) == 1
    assert f"run python scripts/cli_reference.py --write {stale}" in capsys.readouterr().err


def test_the_page_does_not_depend_on_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A default read from the environment (serve's --api-key) never reaches the page."""
    monkeypatch.setenv("DFLASHKIT_API_KEY", "a-key-that-must-not-appear")
    monkeypatch.setenv("DFLASHKIT_LLAMA_CPP", "/opt/llama.cpp")
    page = cli_reference.render(cli_reference.build_parser_without_environment())
    assert page == PAGE.read_text()
    assert "a-key-that-must-not-appear" not in page


@pytest.mark.parametrize("name", list(_subparsers()))
def test_every_subcommand_and_option_is_on_the_page(name: str) -> None:
    page = PAGE.read_text()
    assert f"\n## dflashkit {name}\n" in page
    section = page.split(f"\n## dflashkit {name}\n", 1)[1].split("\n## ", 1)[0]
    for action in _subparsers()[name]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings or [action.dest.upper()]:
            assert f"`{option}`" in section, f"dflashkit {name} {option} is missing from docs/cli.md"


def test_table_cells_are_escaped() -> None:
    assert cli_reference.cell("a | b <c>\n  d") == "a \\| b &lt;c> d"
    assert cli_reference.cell("x `a|b <c>` y|z") == "x `a|b <c>` y\\|z"  # code spans are literal already
