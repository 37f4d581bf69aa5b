"""The Keras example's ``fit`` with a ``TensorBoard`` callback: train scalars read back as TensorBoard reads them."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
pytest.importorskip("tensorboardX")
pytest.importorskip("keras")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "keras" / "train.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras_fit_writes_train_scalars(tmp_path, read_scalars):
    logdir = tmp_path / "logs"
    epochs, steps_per_epoch, spx = 2, 160, 20
    result = subprocess.run(
        [sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "2", "--workers", "2", str(EXAMPLE), "--",
         "--epochs", str(epochs), "--steps-per-epoch", str(steps_per_epoch), "--steps-per-execution", str(spx),
         "--logdir", str(logdir)],
        capture_output=True, text=True, timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    train = read_scalars(logdir / "train")
    assert {"loss", "examples/sec", "epoch_loss", "epoch_examples/sec"} <= set(train), train
    every = spx * 4
    assert [s for s, _ in train["loss"]] == list(range(every, epochs * steps_per_epoch + 1, every))
    assert [s for s, _ in train["epoch_loss"]] == [steps_per_epoch * (e + 1) for e in range(epochs)]
    assert all(math.isfinite(v) and v > 0 for _, v in train["loss"] + train["examples/sec"])
    assert train["loss"][-1][1] < train["loss"][0][1]  # it learns


def test_update_freq_is_checked():
    from kubeps.runtime.errors import RuntimeConfigError
    from kubeps.runtime.models.keras_callbacks import TensorBoard

    with pytest.raises(RuntimeConfigError, match="update_freq"):
        TensorBoard("/tmp/x", update_freq=0)
    assert TensorBoard(None).logdir is None  # until training begins: then the chief's settings say it
