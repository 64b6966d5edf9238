"""The top level of the command line: its parser, `python -m dflashkit`, and the device check before any load."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dflashkit.cli.main import main


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
