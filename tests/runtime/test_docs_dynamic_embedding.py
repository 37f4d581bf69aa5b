"""docs/dynamic-embedding.md stays true: its program runs as written and prints what the doc says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "dynamic-embedding.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", DOC, flags=re.S)


def test_the_doc_has_the_blocks_run_here():
    assert [lang for lang, _ in BLOCKS] == ["python", "python"]


def test_the_program_runs_and_prints_what_the_doc_says(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(BLOCKS[0][1])
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "3"
    assert lines[1] == f"{sorted([3, 42, 2**40 + 7])} (3, 4)"
    assert lines[2] == "[[0. 0. 0. 0.]]"
    assert lines[3] == "(3, 2)"


def test_the_checkpoint_program_prints_what_the_doc_says(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(BLOCKS[1][1])
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["['model/user']", "2 [0. 0. 0. 0.]", "True"]
    assert (tmp_path / "ckpt" / "ckpt-0" / "manifest.json").exists()


def test_the_readme_links_the_doc():
    assert "(docs/dynamic-embedding.md)" in (REPO / "README.md").read_text()
