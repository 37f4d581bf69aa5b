"""The CTR example under ``kubeps local --ps 2 --workers 2 --evaluator`` with ``--logdir``: the chief's train scalars
and the evaluator's eval scalars, read back as TensorBoard reads them."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorboardX")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ctr" / "train.py"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ctr_example_writes_train_and_eval_scalars(tmp_path, read_scalars):
    steps, every, batch = 400, 100, 512
    ckpt, logdir = tmp_path / "ckpt", tmp_path / "logs"
    result = subprocess.run(
        [sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "2", "--workers", "2", "--evaluator",
         str(EXAMPLE), "--", "--steps", str(steps), "--checkpoint-every", str(every), "--batch-size", str(batch),
         "--train-examples", "50000", "--eval-examples", "10000", "--checkpoint-dir", str(ckpt),
         "--logdir", str(logdir)],
        capture_output=True, text=True, timeout=190,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]

    # the chief: one point per report, at the steps it printed, with the loss it printed
    train = read_scalars(logdir / "train")
    assert set(train) == {"loss", "global_step/sec", "examples/sec"}, train
    printed = [(int(s), float(v)) for s, v in re.findall(rf"\[chief-0\] step +(\d+)/{steps}  train log-loss ([\d.]+)", out)]
    reported = list(range(every, steps + 1, every))
    assert [s for s, _ in printed] == reported, out[-3000:]
    assert [s for s, _ in train["loss"]] == reported
    assert all(v == pytest.approx(p, abs=5e-5) for (_, v), (_, p) in zip(train["loss"], printed))
    for (step, per_s), (step2, examples_per_s) in zip(train["global_step/sec"], train["examples/sec"]):
        assert step == step2 and math.isfinite(per_s) and per_s > 0
        assert examples_per_s == pytest.approx(per_s * batch, rel=1e-5)
    assert [s for s, _ in train["global_step/sec"]] == reported

    # the evaluator: its metrics at the checkpoints' steps, as in metrics.jsonl
    records = [json.loads(line) for line in (ckpt / "eval" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["step"] for r in records]
    assert evaluated and evaluated == sorted(set(evaluated)) and evaluated[-1] == steps, records
    assert set(evaluated) <= set(reported)  # an evaluator that falls behind skips to the newest checkpoint
    eval_scalars = read_scalars(logdir / "eval")
    assert set(eval_scalars) == {"logloss", "auc", "gap_pct"}, eval_scalars
    for name, points in eval_scalars.items():
        assert [s for s, _ in points] == evaluated
        assert all(math.isfinite(v) for _, v in points)
        assert [v for _, v in points] == pytest.approx([r["metrics"][name] for r in records], rel=1e-6)
    assert re.search(r"evaluator-0 \(pid \d+\) exited with status 0", result.stderr), result.stderr[-2000:]


def test_logdir_defaults_to_the_environment(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ctr_train_example_tb", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("KUBEPS_LOGDIR", raising=False)
    assert module.parse_args([]).logdir is None
    monkeypatch.setenv("KUBEPS_LOGDIR", "/logs/job")
    assert module.parse_args([]).logdir == "/logs/job"
    assert module.parse_args(["--logdir", "/elsewhere"]).logdir == "/elsewhere"
