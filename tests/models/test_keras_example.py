"""The Keras example run as a user runs it (``kubeps local --ps 2 --workers 2 examples/keras/train.py``): its eval
log-loss against the numpy example's, measured the same way (the numpy example's ``evaluate``), and the seed's
``model.fit`` flow with a checkpoint callback, a parameter server killed mid-training and the job resumed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
pytest.importorskip("jax")
pytest.importorskip("keras")

ROOT = Path(__file__).resolve().parents[2]
KERAS_EXAMPLE = ROOT / "examples" / "keras" / "train.py"


def kubeps_local(example: Path, *args: str, flags: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "2", "--workers", "2", *flags,
            str(example), "--", *args]


def result_of(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("[chief-0] RESULT ")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1].split(" RESULT ", 1)[1])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_keras_fit_matches_the_numpy_example_log_loss_within_half_a_percent(ctr_default_run):
    """Same data, model, optimizer (Keras's Adagrad mapped to kubeps's) and steps (2400 of 512): eval log-loss
    within 0.5% of the hand-written numpy path's (``kubeps local --ps 2 --workers 2 examples/ctr/train.py``, the
    session's shared run)."""
    done = subprocess.run(kubeps_local(KERAS_EXAMPLE), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = {"keras": result_of(done.stdout), "numpy": ctr_default_run[1]}
    keras_run, numpy_run = runs["keras"], runs["numpy"]
    print("LOGLOSS", {k: round(v["logloss"], 5) for k, v in runs.items()},
          "EXAMPLES/S", {k: round(v["examples_per_s"]) for k, v in runs.items()})
    assert keras_run["embedding_shards"] == 2 and keras_run["epochs_run"] == 5
    assert keras_run["teacher_logloss"] == numpy_run["teacher_logloss"]  # the same held-out set
    assert abs(keras_run["logloss"] / numpy_run["logloss"] - 1) <= 0.005, runs
    assert keras_run["logloss"] <= 1.02 * keras_run["teacher_logloss"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fit_with_backup_and_restore_survives_a_killed_ps_and_the_evaluator_follows(tmp_path):
    """The seed's model.fit flow: dataset function, steps_per_execution, a checkpoint callback; ps-0 is killed
    after the second checkpoint; `kubeps local --restart` restarts it and the chief, which restores the latest
    checkpoint and goes on from its step; the sidecar evaluator rebuilds the Keras model, evaluates every
    checkpoint and its last line is the chief's final log-loss."""
    ckpt = tmp_path / "ckpt"
    cmd = kubeps_local(KERAS_EXAMPLE, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "240",
                       "--epochs", "4", "--steps-per-epoch", "480", "--eval-examples", "20000",
                       flags=("--restart", "--evaluator"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, killed_at = [], None
    ps0 = None
    deadline = time.monotonic() + 380
    try:
        for line in proc.stdout:
            lines.append(line)
            found = re.match(r"\[kubeps\] ps-0 pid (\d+) ", line)
            if found and ps0 is None:
                ps0 = int(found.group(1))
            if killed_at is None and re.match(r"\[chief-0\] step 480: saved", line):
                os.kill(ps0, signal.SIGKILL)  # a process this test's kubeps local started
                killed_at = time.monotonic()
            if time.monotonic() > deadline:
                break
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert status == 0, out[-4000:]
    assert killed_at is not None, out[-4000:]
    resumed = [int(s) for s in re.findall(r"^\[chief-0\] resumed from step (\d+) ", out, re.M)]
    assert resumed and resumed[0] >= 480, out[-4000:]  # the latest checkpoint when the chief restarted
    assert re.search(r"^\[chief-0\] step 1920: saved .*ckpt-\d+ \(final\)$", out, re.M), out[-4000:]
    result = result_of(out)
    assert result["logloss"] <= 1.03 * result["teacher_logloss"], result
    evaluated = re.findall(r"^\[evaluator-0\] ckpt-\d+ \(step (\d+)\): eval log-loss ([\d.]+)", out, re.M)
    assert evaluated and evaluated[-1][0] == "1920", out[-4000:]
    assert float(evaluated[-1][1]) == pytest.approx(result["logloss"], abs=1e-4)
