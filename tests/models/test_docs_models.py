"""docs/models.md stays true: its program runs as written under ``kubeps local`` and learns."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

DOC = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_custom_training_loop_program_trains_under_kubeps_local(tmp_path):
    blocks = re.findall(r"```(\w*)\n(.*?)```", DOC, flags=re.S)
    assert [lang for lang, _ in blocks] == ["python"], "docs/models.md has one code block, run here"
    script = tmp_path / "program.py"
    script.write_text(blocks[0][1])
    result = subprocess.run(
        [sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "2", "--workers", "2", str(script)],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first, last = map(float, re.search(r"\[chief-0\] train log-loss ([\d.]+) -> ([\d.]+)", result.stdout).groups())
    assert first > 0.6 and last < 0.2, result.stdout[-2000:]  # the label is one id's parity: learnable
