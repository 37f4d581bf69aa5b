"""docs/coming-from-tensorflow.md stays true: its TensorFlow program's two ports run as written under
``kubeps local --ps 2 --workers 2`` and learn the linear target; the mapping names only what ``kp`` exports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
pytest.importorskip("jax")
pytest.importorskip("keras")

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "coming-from-tensorflow.md"


def programs() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), re.M | re.S)


def test_the_readme_links_the_page_at_the_top_and_every_kp_name_exists():
    import kubeps.runtime as kp

    head = (ROOT / "README.md").read_text().split("## ", 1)[0]
    assert "docs/coming-from-tensorflow.md" in head
    names = set(re.findall(r"`kp\.([A-Za-z_]+)", DOC.read_text()))
    assert names and not sorted(n for n in names if not hasattr(kp, n))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("port", [1, 2], ids=["keras-fit", "custom-loop"])
def test_a_port_of_the_tensorflow_program_trains_under_kubeps_local(tmp_path, port):
    tf_program, *ports = programs()
    assert "import tensorflow as tf" in tf_program and len(ports) == 2
    script = tmp_path / "program.py"
    script.write_text(ports[port - 1])
    env = {**os.environ, "KUBEPS_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    done = subprocess.run([sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "2", "--workers", "2",
                           str(script)], capture_output=True, text=True, timeout=500, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^\[chief-0\] epoch \d: loss ([\d.]+)", done.stdout, re.M)]
    assert len(losses) == 5 and losses[-1] < 0.01 < losses[0], done.stdout[-3000:]
    assert (tmp_path / "ckpt").is_dir()
