"""mypy on the operator (kubeps.operator), at the levels pyproject.toml's operator block sets: --strict for the API
and the pure core, complete signatures and checked bodies for the shell. Any error fails `make test`.

``hack/mypy.py`` runs it: the package-dir mapping (kubeps.operator -> operator/) is an import hook mypy cannot
follow, so the script first links build/mypy-path/kubeps/ to the source roots (pyproject's ``mypy_path``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_mypy_is_clean_on_the_operator():
    proc = subprocess.run([sys.executable, str(REPO / "hack" / "mypy.py"), "-p", "kubeps.operator",
                           "--no-error-summary"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mypy found errors in the operator:\n{proc.stdout}{proc.stderr}"


def test_every_type_ignore_in_the_operator_says_why():
    """A ``# type: ignore`` names its error code and, on its line or the one above, the reason it is right."""
    unexplained = []
    for path in sorted((REPO / "operator").rglob("*.py")):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if "type: ignore" not in line:
                continue
            coded = re.search(r"type: ignore\[[a-z-, ]+\]", line)
            reason = line.split("type: ignore", 1)[1].split("]", 1)[-1].strip(" #-") or (
                lines[number - 2].strip().startswith("#") if number > 1 else "")
            if not coded or not reason:
                unexplained.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not unexplained, "type: ignore without an error code or a reason:\n" + "\n".join(unexplained)
