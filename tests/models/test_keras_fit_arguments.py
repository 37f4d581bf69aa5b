"""A Keras user who gives ``fit`` the optimizer, loss and metrics instead of calling ``compile``
(``programs/keras_fit_arguments.py`` under ``kubeps local``): ``model.evaluate`` works after ``fit`` and measures
what ``fit``'s validation measured; Keras's own ``model.fit`` is refused by name and leaves the model as it was,
saveable, predicting the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
pytest.importorskip("jax")
pytest.importorskip("keras")

PROGRAM = Path(__file__).resolve().parent / "programs" / "keras_fit_arguments.py"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_evaluate_after_fit_without_compile_and_a_refused_keras_fit_changes_nothing(tmp_path):
    env = {**os.environ, "FIT_ARGUMENTS_OUT": str(tmp_path), "KERAS_BACKEND": "jax"}
    done = subprocess.run([sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "1", "--workers", "1",
                           str(PROGRAM)], env=env, capture_output=True, text=True, timeout=380)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    chief = json.loads((tmp_path / "chief.json").read_text())
    # evaluate after fit, with fit's loss and metric, on the trained weights: what fit's last validation measured
    assert set(chief["evaluate"]) == {"loss", "accuracy"}, chief
    assert chief["evaluate"]["loss"] == pytest.approx(chief["history"]["val_loss"][-1], abs=1e-4), chief
    assert chief["evaluate"]["accuracy"] == pytest.approx(chief["history"]["val_accuracy"][-1], abs=1e-4), chief
    assert chief["evaluate"]["accuracy"] > 0.6, chief
    assert "Keras's own fit cannot update a table" in chief["refused"] and "keras_fit.fit" in chief["refused"], chief
    np.testing.assert_array_equal(np.load(tmp_path / "predicted_after.npy"), np.load(tmp_path / "predicted.npy"))
    assert (tmp_path / "model.keras").stat().st_size > 0
