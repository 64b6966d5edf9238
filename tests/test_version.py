"""One version: pyproject.toml, ``dflashkit.__version__`` and a CHANGELOG.md section name the same one."""

from __future__ import annotations

import re
from pathlib import Path

import dflashkit

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_is_the_same_everywhere() -> None:
    version = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert dflashkit.__version__ == version
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.M), (
        f"CHANGELOG.md has no section for {version}"
    )
    assert "## [Unreleased]" in changelog
