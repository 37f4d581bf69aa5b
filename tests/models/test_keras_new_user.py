"""A Keras program written from docs/keras.md alone (``programs/keras_new_user.py``, not one of the project's
examples) runs under ``kubeps local`` as a Keras user expects: ``compile(metrics=["accuracy"])``,
``fit(validation_data=...)``, Keras's ``EarlyStopping``, ``ReduceLROnPlateau``, ``CSVLogger`` and
``LambdaCallback``; then ``model.summary()``, ``model.save()``, ``model.predict()`` and ``model.evaluate()`` on the
chief; the sidecar evaluator's Keras ``evaluate`` of every checkpoint agrees with the chief's numbers at the same
step, and the saved file predicts the same in a fresh process."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
pytest.importorskip("jax")
pytest.importorskip("keras")

PROGRAM = Path(__file__).resolve().parent / "programs" / "keras_new_user.py"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_keras_program_from_the_docs_validates_stops_early_saves_predicts_and_evaluates(tmp_path):
    env = {**os.environ, "NEW_USER_OUT": str(tmp_path), "KERAS_BACKEND": "jax"}
    done = subprocess.run([sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "2", "--workers", "2",
                           "--evaluator", str(PROGRAM)], env=env, capture_output=True, text=True, timeout=380)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "too_many_pings" not in out and "GOAWAY" not in out, out[-4000:]
    chief = json.loads((tmp_path / "chief.json").read_text())
    history = chief["history"]
    # EarlyStopping stopped after the third of six epochs; the History has Keras's keys
    assert chief["stopped_epoch"] == 2 and history["step"] == [20, 40, 60], history
    assert {"loss", "accuracy", "val_loss", "val_accuracy", "learning_rate"} <= set(history), history
    assert history["learning_rate"] == pytest.approx([0.01, 0.01, 0.005]), history  # ReduceLROnPlateau, each epoch
    assert history["val_loss"][-1] < history["val_loss"][0] and history["val_accuracy"][-1] > 0.6, history
    # a callback's model holds the weights of the step it reports (not the initial ones)
    assert chief["seen_by_callback"] == pytest.approx(history["val_loss"], abs=1e-4), chief
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["val_loss"]) for r in rows] == pytest.approx(history["val_loss"])
    # stopping early saved a final checkpoint, and the evaluator finished after it
    assert re.search(r"^\[chief-0\] step 60: saved \S+ \(final\)$", out, re.M), out[-4000:]
    evaluated = json.loads((tmp_path / "evaluator.json").read_text())
    # (a loaded machine may let the evaluator see the step-60 checkpoint before it was saved again as final, or
    # skip one: it evaluates the latest it finds)
    assert evaluated[-1]["step"] == 60 and evaluated[-1]["final"], evaluated
    assert {r["step"] for r in evaluated} <= {20, 40, 60}, evaluated
    for record in evaluated:
        epoch = history["step"].index(record["step"])
        assert record["loss"] == pytest.approx(history["val_loss"][epoch], abs=1e-4), (evaluated, history)
        assert record["accuracy"] == pytest.approx(history["val_accuracy"][epoch], abs=1e-4), (evaluated, history)
    # model.evaluate on the chief after fit: the trained table rows and weights, as the final checkpoint
    assert chief["evaluate"]["loss"] == pytest.approx(evaluated[-1]["loss"], abs=1e-4), chief
    assert chief["evaluate"]["accuracy"] == pytest.approx(evaluated[-1]["accuracy"], abs=1e-4), chief
    assert "Total params: 40,515" in out, out[-4000:]  # the 5000 x 8 table counted
    # the saved file holds the trained table: loaded in a fresh process it predicts as the chief did
    assert (tmp_path / "model.keras").stat().st_size > 5000 * 8 * 4
    load = textwrap.dedent(f"""
        import os
        os.environ["KERAS_BACKEND"] = "jax"
        import keras, numpy as np
        import kubeps.runtime.models.keras_layers  # registers KubepsEmbedding
        rng = np.random.default_rng(99)
        ids, dense = rng.integers(0, 5000, size=(2000, 3)), rng.normal(size=(2000, 4)).astype(np.float32)
        model = keras.saving.load_model({str(tmp_path / "model.keras")!r})
        np.save({str(tmp_path / "reloaded.npy")!r}, model.predict((ids, dense), verbose=0))
    """)
    loaded = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "KERAS_BACKEND": "jax"})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "reloaded.npy"), np.load(tmp_path / "predictions.npy"),
                               rtol=1e-5, atol=1e-6)
