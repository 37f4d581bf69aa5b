"""examples/eval/train.py under a local cluster with an evaluator: checkpoints every chunk, the evaluator follows
them to the final one and the log-loss falls; a second run resumes from the final checkpoint and does nothing."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kubeps.runtime.checkpoint.evaluator import read_metrics
from kubeps.runtime.local.restarting import RestartingLocalCluster

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "eval" / "train.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _run(tmp_path, out):
    cluster = RestartingLocalCluster(
        EXAMPLE, ["--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "120", "--checkpoint-every", "40",
                  "--evaluator-timeout", "60"],
        num_ps=2, num_workers=2, evaluator=True, output=out, log=out, grace_period=3.0)
    try:
        cluster.start()
        status = cluster.wait(timeout=150)
    finally:
        cluster.stop()
    return status, cluster


def test_example_trains_checkpoints_and_evaluates(tmp_path):
    out = io.StringIO()
    status, cluster = _run(tmp_path, out)
    assert status == 0, out.getvalue()[-3000:]
    evaluator = cluster.tasks[("evaluator", 0)]
    assert evaluator.returncode == 0, "the evaluator stops by itself after the final checkpoint"
    records = read_metrics(str(tmp_path / "ckpt" / "eval" / "metrics.jsonl"))
    assert [r["step"] for r in records][-1] == 120 and records[-1]["final"]
    losses = [r["metrics"]["log_loss"] for r in records]
    assert losses[-1] < 0.69 and losses[-1] <= losses[0] + 1e-6
    out2 = io.StringIO()
    status, _ = _run(tmp_path, out2)
    assert status == 0 and "starting at step 120" in out2.getvalue()
