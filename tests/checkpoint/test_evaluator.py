"""SidecarEvaluator: polls, evaluates each new checkpoint from its files, stops at the final one, resumes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kubeps.runtime.checkpoint import Checkpoint, CheckpointManager, StepCounter
from kubeps.runtime.checkpoint.evaluator import SidecarEvaluator, read_metrics
from kubeps.runtime.errors import RuntimeConfigError


def _mse(values, batches):
    w = values["w"]
    losses = [float(np.mean((x @ w - y) ** 2)) for x, y in batches]
    return {"mse": np.float32(np.mean(losses)), "batches": len(losses), "step_seen": values.step}


def _data(n=6):
    rng = np.random.default_rng(0)
    true_w = np.array([1.0, -2.0])
    out = []
    for _ in range(n):
        x = rng.normal(size=(8, 2))
        out.append((x, x @ true_w))
    return out


def test_follows_training_and_stops_after_final(tmp_path):
    w = np.zeros(2)
    step = StepCounter()
    mgr = CheckpointManager(Checkpoint(w=w, step=step), tmp_path, max_to_keep=2)
    ev = SidecarEvaluator(_mse, _data(), str(tmp_path), steps=4, poll_interval=0.05, timeout=20)
    result: list = []
    t = threading.Thread(target=lambda: result.extend(ev.start()))
    t.start()
    target = np.array([1.0, -2.0])
    for i in range(1, 4):
        w[:] = target * i / 3
        step.assign(i * 100)
        mgr.save(final=(i == 3))
        deadline = time.monotonic() + 10
        while len(ev.records) < i and time.monotonic() < deadline:  # the evaluator keeps up
            time.sleep(0.02)
    t.join(timeout=20)
    assert not t.is_alive()
    assert [r["step"] for r in result] == [100, 200, 300]
    assert result[-1]["final"] is True
    assert result[-1]["metrics"]["mse"] < 1e-12 < result[0]["metrics"]["mse"]
    assert all(r["metrics"]["batches"] == 4 for r in result)
    on_disk = read_metrics(ev.metrics_path)
    assert [r["checkpoint_number"] for r in on_disk] == [0, 1, 2]
    assert set(on_disk[0]) >= {"checkpoint", "step", "metrics", "time"}
    # a restarted evaluator sees the final checkpoint was evaluated and does nothing
    assert SidecarEvaluator(_mse, _data(), str(tmp_path), poll_interval=0.05, timeout=1).start() == []


def test_max_evaluations_resume_and_timeout(tmp_path):
    w = np.ones(2)
    mgr = CheckpointManager(Checkpoint(w=w), tmp_path)
    mgr.save(step=1)
    mgr.save(step=2)
    ev = SidecarEvaluator(_mse, lambda: _data(2), str(tmp_path), max_evaluations=1, poll_interval=0.05)
    recs = ev.start()
    assert [r["step"] for r in recs] == [2], "falling behind, it evaluates the newest"
    mgr.save(step=3)
    t0 = time.monotonic()
    again = SidecarEvaluator(_mse, lambda: _data(2), str(tmp_path), poll_interval=0.05, timeout=0.5).start()
    assert [r["step"] for r in again] == [3], "a restarted evaluator carries on after the last evaluated"
    assert time.monotonic() - t0 < 5


def test_bad_arguments(tmp_path):
    with pytest.raises(RuntimeConfigError, match=r"'SidecarEvaluator.data' has invalid value '\w+': re-iterable"):
        SidecarEvaluator(_mse, iter(_data()), str(tmp_path))
    with pytest.raises(RuntimeConfigError, match=r"'SidecarEvaluator.steps' has invalid value 0: an integer >= 1, or None"):
        SidecarEvaluator(_mse, _data(), str(tmp_path), steps=0)
    with pytest.raises(RuntimeConfigError, match=r"'SidecarEvaluator.timeout' has invalid value 0: a number of seconds"):
        SidecarEvaluator(_mse, _data(), str(tmp_path), timeout=0)
    with pytest.raises(RuntimeConfigError, match=r"'SidecarEvaluator.eval_fn' has invalid value 3: a callable"):
        SidecarEvaluator(3, _data(), str(tmp_path))


def test_reads_any_shard_count_and_metric_types(tmp_path):
    emb = np.arange(12.0).reshape(6, 2)
    path = CheckpointManager(Checkpoint(emb=emb), tmp_path).save(step=5, final=True)
    ev = SidecarEvaluator(lambda v, b: {"sum": float(v["emb"].sum()), "n": np.int64(len(list(b)))},
                          [1, 2, 3], str(tmp_path), poll_interval=0.05, timeout=5)
    (rec,) = ev.start()
    assert rec["checkpoint"] == path and rec["metrics"] == {"sum": 66.0, "n": 3}
    bad = SidecarEvaluator(lambda v, b: {"x": object()}, [1], str(tmp_path / "other"), timeout=0.1)
    CheckpointManager(Checkpoint(emb=emb), tmp_path / "other").save()
    with pytest.raises(TypeError, match="metric 'x'"):
        bad.start()
