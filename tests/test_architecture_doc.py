"""docs/architecture.md stays true: its import graph is the one the code has now, and its table names every folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SCRIPT = ROOT / "scripts" / "layout_graph.py"


def test_the_import_graph_in_the_doc_is_current():
    """The graph is computed now, from the code as it is: the test fails only when the doc is stale."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check", str(DOC)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr + done.stdout


def test_the_table_names_every_package_folder():
    table = "\n".join(line for line in DOC.read_text().splitlines() if line.startswith("|"))
    folders = sorted(p.parent.name for p in (ROOT / "dflashkit").glob("*/__init__.py"))
    assert folders, "no package folders found"
    assert [f for f in folders if f"`{f}/`" not in table] == []


def test_the_check_fails_on_a_stale_diagram(tmp_path):
    stale = tmp_path / "doc.md"
    stale.write_text("<!-- layout-graph:start -->\n```mermaid\nflowchart TD\n```\n<!-- layout-graph:end -->\n")
    done = subprocess.run([sys.executable, str(SCRIPT), "--check", str(stale)], capture_output=True, text=True)
    assert done.returncode == 1 and "stale" in done.stderr
    subprocess.run([sys.executable, str(SCRIPT), "--write", str(stale)], check=True)
    assert subprocess.run([sys.executable, str(SCRIPT), "--check", str(stale)], capture_output=True).returncode == 0
