"""The sidecar evaluator writes its metrics as TensorBoard scalars to ``<logdir>/eval`` at the checkpoint's step."""

from __future__ import annotations

import numpy as np
import pytest

import kubeps.runtime as kp
from kubeps.runtime.checkpoint import Checkpoint, CheckpointManager, StepCounter
from kubeps.runtime.contract import LOGDIR_ENV

pytest.importorskip("tensorboardX")


def test_sidecar_evaluator_writes_eval_scalars_at_the_checkpoints_step(tmp_path, monkeypatch, read_scalars):
    monkeypatch.setenv(LOGDIR_ENV, str(tmp_path / "logs"))  # as a job manifest sets it
    settings = kp.TFConfigClusterResolver().settings  # the evaluator's settings, read once where it starts
    w = np.zeros(2)
    step = StepCounter()
    mgr = CheckpointManager(Checkpoint(w=w, step=step), tmp_path / "ckpt")
    for i in range(1, 4):
        w[:] = i
        step.assign(i * 100)
        mgr.save(final=i == 3)

    def eval_fn(values, batches):
        return {"mean_w": float(values["w"].mean()), "note": "text stays in metrics.jsonl", "flag": True}

    ev = kp.SidecarEvaluator(eval_fn, [None], str(tmp_path / "ckpt"), poll_interval=0.05, timeout=5,
                             settings=settings)
    assert ev.event_dir == str(tmp_path / "logs" / "eval")
    records = ev.start()
    assert [r["step"] for r in records] == [300]  # it fell behind: the newest checkpoint only, the final one
    assert read_scalars(tmp_path / "logs" / "eval") == {"mean_w": [(300, 3.0)]}


def test_sidecar_evaluator_without_a_log_dir_writes_no_event_files(tmp_path, monkeypatch, read_scalars):
    monkeypatch.setenv(LOGDIR_ENV, str(tmp_path / "unread"))  # the evaluator reads only the settings it is given
    mgr = CheckpointManager(Checkpoint(w=np.ones(2)), tmp_path)
    mgr.save(final=True)  # no step saved: the checkpoint number stands in when a log dir is set
    ev = kp.SidecarEvaluator(lambda values, batches: {"s": 1.0}, [None], str(tmp_path), timeout=5)
    assert ev.event_dir is None and len(ev.start()) == 1
    assert not list(tmp_path.rglob("events.out.tfevents.*"))
    ev = kp.SidecarEvaluator(lambda values, batches: {"s": 2.0}, [None], str(tmp_path), timeout=5,
                             metrics_path=str(tmp_path / "m2.jsonl"), logdir=str(tmp_path / "logs"))
    [record] = ev.start()
    assert record["step"] is None
    assert read_scalars(tmp_path / "logs" / "eval") == {"s": [(0, 2.0)]}
