"""The shipped drafters: found by target, by short name (a path wins), and described without loading anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dflashkit.drafter.registry
from dflashkit.drafter.registry import (
    check_drafter,
    drafter_folder,
    drafter_name_or_path,
    named_drafter,
    shipped_drafter,
    shipped_drafters,
    shipped_names,
)
from dflashkit.errors import InvalidInputError


def test_drafter_folder_resolves_auto_to_the_shipped_drafter_and_passes_the_rest(monkeypatch, tmp_path: Path):
    shipped = shipped_drafter(None)
    assert shipped is not None and (shipped / "config.json").is_file()
    assert drafter_folder("auto", None) == str(shipped)
    assert drafter_folder(tmp_path, None) == str(tmp_path) and drafter_folder("some/folder", None) == "some/folder"
    assert drafter_folder(None, None) is None
    monkeypatch.setattr(dflashkit.drafter.registry, "DRAFTERS_DIR", tmp_path / "none-shipped")
    assert drafter_folder("auto", None) is None  # no drafter ships for it: none, not an error


def _drafter_folder(parent: Path, name: str, layers: int = 2, block: int = 8) -> Path:
    folder = parent / name
    folder.mkdir(parents=True)
    config = {"num_hidden_layers": layers, "block_size": block, "dflashkit": {"target": {"name_or_path": "t"}}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    return folder


def test_shipped_drafters_are_described_from_their_config(monkeypatch, tmp_path: Path):
    shipped = tmp_path / "shipped"
    _drafter_folder(shipped, "b-drafter", layers=3, block=16)
    _drafter_folder(shipped, "a-drafter")
    (shipped / "not-a-drafter").mkdir()  # no config.json: not listed
    monkeypatch.setattr(dflashkit.drafter.registry, "DRAFTERS_DIR", shipped)
    found = shipped_drafters()
    assert [d.name for d in found] == ["a-drafter", "b-drafter"] == shipped_names()
    b = found[1]
    assert (b.target, b.layers, b.block_size, b.path) == ("t", 3, 16, shipped / "b-drafter")
    assert b.size_bytes == 1000 + (shipped / "b-drafter" / "config.json").stat().st_size


def test_a_short_name_names_a_shipped_drafter_unless_a_path_exists(monkeypatch, tmp_path: Path):
    shipped = tmp_path / "shipped"
    folder = _drafter_folder(shipped, "tiny")
    monkeypatch.setattr(dflashkit.drafter.registry, "DRAFTERS_DIR", shipped)
    monkeypatch.chdir(tmp_path)
    assert named_drafter("tiny") == folder and named_drafter("TINY") == folder
    assert drafter_name_or_path("tiny") == check_drafter("tiny") == drafter_folder("tiny", None) == str(folder)
    for word in ("none", "untrained", "auto"):
        assert named_drafter(word) is None and drafter_name_or_path(word) == check_drafter(word) == word
    assert named_drafter("other") is None and named_drafter("some/tiny") is None
    assert drafter_name_or_path("other") == "other"  # parsing never refuses: check_drafter does, before a load
    (tmp_path / "tiny").mkdir()  # a folder of that name here: the path wins
    assert named_drafter("tiny") is None and drafter_folder("tiny", None) == "tiny"
    assert drafter_name_or_path("tiny") == check_drafter("tiny") == "tiny"
    with pytest.raises(InvalidInputError, match=r"no drafter folder 'tinny', and no shipped drafter .*shipped: tiny;"):
        check_drafter("tinny")
    with pytest.raises(InvalidInputError, match="no drafter folder 'none'"):
        check_drafter("none", keywords=())  # export: keywords are not drafters


def test_the_registry_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys\nfrom dflashkit.drafter.registry import shipped_drafters, check_drafter\n"
        "assert shipped_drafters() and check_drafter('smollm2-135m-instruct')\n"
        "assert 'torch' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
