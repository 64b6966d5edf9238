from pathlib import Path

import dflashkit.drafter.registry
from dflashkit.drafter.registry import drafter_folder, shipped_drafter


def test_drafter_folder_resolves_auto_to_the_shipped_drafter_and_passes_the_rest(monkeypatch, tmp_path: Path):
    shipped = shipped_drafter(None)
    assert shipped is not None and (shipped / "config.json").is_file()
    assert drafter_folder("auto", None) == str(shipped)
    assert drafter_folder(tmp_path, None) == str(tmp_path) and drafter_folder("some/folder", None) == "some/folder"
    assert drafter_folder(None, None) is None
    monkeypatch.setattr(dflashkit.drafter.registry, "DRAFTERS_DIR", tmp_path / "none-shipped")
    assert drafter_folder("auto", None) is None  # no drafter ships for it: none, not an error
