"""mypy on ``kubeps.runtime`` and ``kubeps.operator`` at the levels pyproject.toml's ``[tool.mypy]`` documents
(``check_untyped_defs`` everywhere; strict on the pod contract, the RPC protocol and wire format, the errors, the
cluster spec, and the operator's API and pure core).
hack/mypy.sh builds the import tree mypy needs (setuptools maps the source roots) and runs it: one definition,
shared with ``make lint``. mypy comes with the test extra, so this never skips; its cache (under
``~/.cache/kubeps/mypy``) makes a rerun take a few seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_mypy_clean(tmp_path: Path):
    mypy = Path(sys.executable).parent / "mypy"
    assert mypy.exists(), "mypy is missing: install the test extra (pip install -e '.[operator,test]')"
    env = {**os.environ, "MYPY": str(mypy), "KUBEPS_MYPY_ROOT": str(tmp_path / "root")}
    proc = subprocess.run(["bash", str(REPO / "hack" / "mypy.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"mypy found errors (paths kubeps/runtime/... are runtime/...):\n{proc.stdout}{proc.stderr}"
