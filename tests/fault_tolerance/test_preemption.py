"""Preemption under ``kubeps local --restart``: SIGTERM to the chief mid-training makes it save a checkpoint of the
steps since the last one (an incremental save) before it exits with 143; restarted, it resumes from that checkpoint
and no step is lost or repeated (every step adds 1 to one row: the final table is exact)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(240)

STEPS = 300

PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path

    import numpy as np

    from kubeps.runtime.checkpoint import Checkpoint, CheckpointManager, StepCounter
    from kubeps.runtime.checkpoint.preemption import deferred
    from kubeps.runtime.cluster import TFConfigClusterResolver
    from kubeps.runtime.coordinator.strategy import ParameterServerStrategy
    from kubeps.runtime.ops.optimizers import SGD
    from kubeps.runtime.server import Server
    from kubeps.runtime.variables.push import IndexedSlices
    from kubeps.runtime.variables.variable import Variable

    state, steps = Path(sys.argv[1]), int(sys.argv[2])
    resolver = TFConfigClusterResolver()
    if resolver.task_type in ("ps", "worker"):
        Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
        sys.exit(0)
    strategy = ParameterServerStrategy(resolver)
    with strategy.scope():
        table = Variable(np.zeros((50, 2), np.float32), name="table")
    step = StepCounter()
    manager = CheckpointManager(Checkpoint(table=table, step=step), str(state / "ckpt"), max_to_keep=2,
                                incremental=True)
    start = manager.restore_or_initialize()
    with open(state / "starts", "a") as f:
        f.write(f"{start}\\n")
    (state / "chief.pid").write_text(str(os.getpid()))
    opt = SGD(1.0)
    while step.value < steps:
        # step k adds 1 to row k % 50 (SGD, gradient -1): a lost or repeated step shows in the table
        with deferred():  # a SIGTERM lands between two steps
            opt.apply_gradients([(IndexedSlices(-np.ones((1, 2), np.float32), np.array([step.value % 50])), table)])
            step.assign_add(1)
        (state / "progress").write_text(str(step.value))
        if step.value % 100 == 0:
            manager.save()
        time.sleep(0.01)
    manager.save(final=True)
    expected = np.full((50, 2), steps // 50, np.float32)
    print("TABLE EXACT" if np.array_equal(table.numpy(), expected) else f"TABLE WRONG {table.numpy()[:, 0]}")
    strategy.close()
    """
)


def _progress(state) -> int:
    """The chief's step count (0 before its first; the file may be caught between truncation and write)."""
    try:
        return int((state / "progress").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def test_sigterm_to_the_chief_saves_the_steps_since_the_last_checkpoint_and_the_restart_loses_none(tmp_path):
    program = tmp_path / "job.py"
    program.write_text(PROGRAM)
    cmd = [sys.executable, "-m", "kubeps.runtime.cli", "local", "--restart", "--ps", "1", "--workers", "1",
           "--grace-period", "20", str(program), "--", str(tmp_path), str(STEPS)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while _progress(tmp_path) < 140:
            assert job.poll() is None and time.monotonic() < deadline, "the chief made no progress"
            time.sleep(0.05)
        chief = int((tmp_path / "chief.pid").read_text())
        os.kill(chief, signal.SIGTERM)  # 40+ steps after the checkpoint of step 100
        out, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, out[-3000:]
    starts = [int(s) for s in (tmp_path / "starts").read_text().split()]
    assert len(starts) == 2 and starts[0] == 0, (starts, out[-3000:])
    assert "TABLE EXACT" in out, (starts, out[-3000:])
    assert starts[1] >= 140 and starts[1] % 100 != 0, starts  # resumed from the SIGTERM's checkpoint, not step 100
