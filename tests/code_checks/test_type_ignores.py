"""Every ``# type: ignore`` in both source roots says which error it silences and why (mypy itself runs in
test_mypy.py, over the runtime and the operator)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_type_ignore_says_why():
    """A ``# type: ignore`` names its error code and, on its line or the one above, the reason it is right."""
    unexplained = []
    for path in sorted(p for root in ("runtime", "operator") for p in (REPO / root).rglob("*.py")):
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
