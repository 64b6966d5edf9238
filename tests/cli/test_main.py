"""The top level of the command line: its parser, `python -m dflashkit`, and the device check before any load."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from dflashkit.cli.main import build_parser, main


def test_argparse_errors_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--proposal", "beam"])
    assert info.value.code == 2
    capsys.readouterr()


def test_module_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "dflashkit", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: dflashkit" in proc.stdout and "generate" in proc.stdout


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["train"], ["data"], ["bench", "--limit", "1"]])
def test_an_absent_device_fails_before_loading(loads, capsys, monkeypatch: pytest.MonkeyPatch, command) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = main([*command, "--device", "cuda"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: device 'cuda'") and "CUDA" in err
    assert loads == []


# ---- a light command line: no torch while parsers are built --------------------------------------------------------

OWN_COMMANDS = ("generate", "chat", "serve", "export", "drafters")  # parsers built from dflashkit.cli's own modules
LIGHT_PARSERS = """
import sys
from dflashkit.cli import drafters, export, generate, serve
from dflashkit.cli.common import CommandParser
parser = CommandParser(prog="dflashkit")
sub = parser.add_subparsers(dest="command", parser_class=CommandParser)
for module in (generate, serve, export, drafters):
    module.add_parsers(sub)
for name, sp in sub.choices.items():
    sp.format_help()
parser.parse_args(["generate", "hi", "--drafter", "smollm2-135m-instruct", "--block-size", "auto", "--dtype", "bf16"])
parser.parse_args(["chat", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5"])
parser.parse_args(["serve", "--port", "8001", "--tree", "0", "--draft-window", "0"])
parser.parse_args(["export", "smollm2-135m-instruct", "--format", "hf"])
heavy = sorted(m for m in ("torch", "transformers", "numpy", "safetensors") if m in sys.modules)
assert not heavy, heavy
"""


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_the_command_line_loads_no_torch() -> None:
    """`import dflashkit` and `import dflashkit.cli.main` import no model code (dflashkit/__init__.py is lazy)."""
    proc = _python(
        "import sys, dflashkit, dflashkit.cli.main\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    assert proc.returncode == 0, proc.stderr


def test_building_and_using_the_own_parsers_loads_no_torch() -> None:
    """The parsers of generate, chat, serve, export and drafters, their --help text and their argument types
    (shipped drafter names included) need neither torch nor transformers."""
    proc = _python(LIGHT_PARSERS)
    assert proc.returncode == 0, proc.stderr


def test_the_whole_parser_loads_no_torch() -> None:
    """Every command's parser, train's and bench's included: `dflashkit --help` imports no model code (dflashkit and
    dflashkit.bench export their names lazily)."""
    proc = _python(
        "import sys\nfrom dflashkit.cli.main import build_parser\nbuild_parser()\nassert 'torch' not in sys.modules"
    )
    assert proc.returncode == 0, proc.stderr


def test_the_package_exports_resolve_lazily() -> None:
    """Every name in dflashkit.__all__ resolves (imported on first use), dir() lists them, unknown names raise."""
    import dflashkit

    assert sorted(dflashkit.__all__) == sorted(dflashkit._EXPORTS)
    for name in dflashkit.__all__:
        assert getattr(dflashkit, name) is not None, name
    assert set(dflashkit.__all__) <= set(dir(dflashkit)) and "__version__" in dir(dflashkit)
    from dflashkit import SpeculativeGenerator
    from dflashkit.generator import SpeculativeGenerator as defined

    assert SpeculativeGenerator is defined
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        dflashkit.NoSuchThing  # noqa: B018


def test_quantize_choices_match_the_kernels() -> None:
    """The --quantize choices are spelled out for a light parser; they must be the kernels' methods."""
    from dflashkit.bench.command import QUANT_METHODS
    from dflashkit.cli.common import QUANTIZE_METHODS
    from dflashkit.kernels.quantize import METHODS

    assert tuple(QUANTIZE_METHODS) == tuple(QUANT_METHODS) == tuple(METHODS)


# ---- --help: every option explained, every default shown --------------------------------------------------------


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("name", list(_subparsers()))
def test_help_shows_defaults_without_noise(name: str) -> None:
    """Every subcommand's --help appends each option's default once, and never a default that means nothing."""
    parser = _subparsers()[name]
    text = " ".join(parser.format_help().split())
    for noise in ("(default: None)", "(default: False)", "(default: True)", "(default: [])", "(default: )"):
        assert noise not in text, (name, noise)
    for action in parser._actions:
        help_text = " ".join(parser._get_formatter()._expand_help(action).split()) if action.help else ""
        assert help_text.count("default:") <= 1 and help_text.count("(default") <= 1, (name, action.option_strings)


@pytest.mark.parametrize("name", [*OWN_COMMANDS, "bench"])
def test_every_option_is_explained(name: str) -> None:
    """Every option of these commands has a help text; one whose default is None says what happens without it."""
    parser = _subparsers()[name]
    for group in parser._action_groups:
        for action in group._group_actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            assert action.help, (name, action.option_strings or action.dest)
            if action.option_strings and action.nargs != 0 and action.default is None and not action.required:
                said = "default" in action.help.lower() or "without" in (group.description or "").lower()
                assert said, (name, action.option_strings)


def test_help_text_examples() -> None:
    parsers = _subparsers()
    generate = " ".join(parsers["generate"].format_help().split())
    assert "--max-new-tokens N the most tokens to generate; the text may end sooner (default: 128)" in generate
    assert "--temperature T sampling temperature; 0: greedy" in generate and "(default: 0.0)" in generate
    assert "--dtype {bf16,bfloat16,float32,fp32}" in generate and "(default: bfloat16)" in generate
    assert "--ngram-store, --no-ngram-store" in generate and "(default: on)" in generate
    assert generate.count("(default: auto)") == 1  # --block-size says it itself: not appended again
    serve = " ".join(parsers["serve"].format_help().split())
    assert "--port PORT TCP port to listen on (default: 8000)" in serve
    assert "(default: info)" in serve
    assert "$DFLASHKIT_API_KEY" in serve  # the key itself is never printed: its help names where it comes from


def test_top_level_help_lists_every_command_and_first_steps(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for name in _subparsers():
        assert f"\n    {name}" in out, name
    assert "first steps:" in out and 'dflashkit generate "Name three oceans." --compare-ar' in out


def test_an_empty_prompt_is_refused_before_torch_loads() -> None:
    """A prompt of only whitespace is answered at once (exit 2), with no model code imported."""
    proc = _python(
        "import sys\nfrom dflashkit.cli.main import main\nrc = main(['generate', '   '])\n"
        "assert 'torch' not in sys.modules\nsys.exit(rc)"
    )
    assert proc.returncode == 2, proc.stderr
    assert "the prompt is empty" in proc.stderr
