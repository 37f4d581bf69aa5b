"""Every code block of docs/keras.md runs: the install line names the extra pyproject declares, the command is the
one this test runs, and the program trains, checkpoints and is evaluated under it (the Kubernetes block: the kind
e2e)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
pytest.importorskip("jax")
pytest.importorskip("keras")

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "keras.md"


def blocks() -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```$", DOC.read_text(), re.M | re.S)


def test_the_doc_has_an_install_line_a_command_and_a_program():
    kinds = [(lang, code.splitlines()[0]) for lang, code in blocks()]
    assert kinds == [("", "pip install 'kubeps[keras]'        # keras>=3.15, jax>=0.10.2 (the versions tested); "
                          "KERAS_BACKEND=jax"),
                     ("", "kubeps local --ps 2 --workers 2 --evaluator --restart train.py"),
                     ("python", "import os"),
                     ("", "kubeps export /tmp/keras-doc-ckpt --model train.py:build_model --output "
                          "/tmp/keras-doc-serving"),
                     ("python", "import os"),  # Optimizers and learning rates: run below
                     # On Kubernetes: run by tests/e2e/test_kind.py (the image and examples/keras/job.yaml)
                     ("sh", "docker build --target runtime-keras -t kubeps-runtime-keras:latest .")]
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["keras"]
    assert extra == ["keras>=3.15", "jax>=0.10.2"]


def test_the_doc_optimizer_example_maps_keras_adamw_and_its_schedule(tmp_path):
    """The block of "Optimizers and learning rates": Keras's AdamW with a warmup CosineDecay becomes kubeps's AdamW
    with kubeps's CosineDecay, whose first update uses schedule(0) and update 101 schedule(100)."""
    (code,) = [code for lang, code in blocks() if lang == "python" and "kubeps_optimizer" in code]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KERAS_BACKEND": "jax"})
    assert done.returncode == 0, done.stderr[-3000:]
    described, rates = done.stdout.splitlines()
    assert described.startswith("AdamW(learning_rate={'class_name': 'CosineDecay', 'config': {'initial_learning_rate"
                                "': 0.0, 'decay_steps': 1000,") and described.endswith("weight_decay=0.01)")
    assert rates == "0.0 0.01"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_doc_program_trains_checkpoints_and_is_evaluated_under_kubeps_local(tmp_path):
    """The program trains with validation and a metric, the evaluator's `model.evaluate` of the final checkpoint is
    the chief's `model.evaluate` after `fit`, and `kubeps export` imports the (guarded) program and exports it."""
    (_, _), (_, command), (_, program), (_, export), *_ = blocks()
    (tmp_path / "train.py").write_text(program)
    args = command.split()
    assert args[:1] == ["kubeps"] and args[-1] == "train.py"
    env = {**os.environ, "KUBEPS_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    done = subprocess.run([sys.executable, "-m", "kubeps.runtime.cli", *args[1:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=280)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert f"[chief-0] no checkpoint in {tmp_path / 'ckpt'}: starting from step 0" in out
    losses = [float(x) for x in re.findall(r"^\[chief-0\] epoch \d: loss ([\d.]+)", out, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0] < 0.7, out[-3000:]
    evaluated = re.search(r"^\[evaluator-0\] evaluated (\[.*\])$", out, re.M)
    assert evaluated and "(120, " in evaluated.group(1), out[-3000:]
    val_auc = [float(x) for x in re.findall(r"^\[chief-0\] epoch \d: loss [\d.]+, val_auc ([\d.]+)", out, re.M)]
    assert len(val_auc) == 3 and val_auc[-1] > 0.6, out[-3000:]
    chief = re.search(r"^\[chief-0\] chief evaluates \{.*'loss': ([\d.]+)", out, re.M)
    final = re.search(r"\(120, ([\d.]+)\)", evaluated.group(1))
    assert chief and final and float(chief.group(1)) == pytest.approx(float(final.group(1)), abs=1e-4), out[-3000:]
    args = export.replace("/tmp/keras-doc-ckpt", str(tmp_path / "ckpt")).replace(
        "/tmp/keras-doc-serving", str(tmp_path / "serving")).split()
    done = subprocess.run([sys.executable, "-m", "kubeps.runtime.cli", *args[1:]], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "serving" / "model.keras").is_file() and (tmp_path / "serving" / "model.onnx").is_file(), \
        done.stdout
    assert not (tmp_path / "serving" / "model.onnx.data").exists()  # one file: the weights inside
