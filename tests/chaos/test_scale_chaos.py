"""Failures at scale: a 64-worker ``kubeps local --restart`` job (``scale_program.py``: tiny closures) survives 10 worker
kills and one ps kill. Every execution up to the last one is marked on the parameter servers (nothing lost), the ps
kill restarts the chief, which resumes from its latest checkpoint; the time from the ps kill to the first execution
finished after the resume is reported (``CHAOS {...}`` with ``pytest -s``, docs/benchmarks.md)."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from .conftest import report, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROGRAM = str(Path(__file__).resolve().parent / "scale_program.py")
WORKERS = 64
CHUNK = 64


def test_64_workers_survive_10_worker_kills_and_a_ps_kill(chaos_run, tmp_path):
    stop = tmp_path / "stop"
    t_start = time.time()
    run = chaos_run("scale", num_workers=WORKERS, tls=False, program=PROGRAM,
                    program_args=("--stop-file", str(stop), "--chunk", str(CHUNK), "--min-steps", str(4 * CHUNK)))
    run.start()
    try:
        wait_until(lambda: run.checkpoints(), 150, "the first checkpoint")
        started_s = run.checkpoints()[0]["time"] - t_start
        rng = random.Random(39)
        kills = []
        while len(kills) < 10:
            index = rng.randrange(WORKERS)
            task = run.task("worker", index)
            if task is None or not task.running:
                continue
            os.kill(task.pid, signal.SIGKILL)  # a process this test's cluster started
            kills.append(index)
            time.sleep(rng.uniform(0.1, 0.4))
        # the ps, once a checkpoint was saved after the worker kills
        after = run.checkpoints()[-1]["step"]
        wait_until(lambda: run.checkpoints()[-1]["step"] > after, 60, "a checkpoint after the worker kills")
        saved = run.checkpoints()[-1]["step"]
        victim = run.task("ps", 0)
        t_kill = time.time()
        os.kill(victim.pid, signal.SIGKILL)  # a process this test's cluster started
        wait_until(lambda: [s for s in run.starts() if s["time"] > t_kill], 90, "the chief to resume")
        resumed = [s for s in run.starts() if s["time"] > t_kill][0]
        wait_until(lambda: [r for r in run.runs() if r[3] > resumed["time"]], 60, "an execution after the resume")
        t_first = min(r[3] for r in run.runs() if r[3] > resumed["time"])
        stop.touch()
        assert run.join(120) == 0, "the job must complete despite the kills"
    finally:
        stop.touch()
    result = run.result()
    assert result["missing"] == [], f"executions lost: {result['missing'][:20]}"
    assert result["resumed_from_step"] >= saved, "the chief resumes from the checkpoint saved before the ps kill"
    ended = {i for i, *_ in run.runs()}
    assert ended >= set(range(result["executions"])), "every execution ended on some worker"
    restarts = run.cluster.restarts
    assert sum(n for (kind, _), n in restarts.items() if kind == "worker") >= 10
    figures = {"workers": WORKERS, "worker_kills": len(kills), "executions": result["executions"],
               "reruns": result["reruns"], "first_checkpoint_s": round(started_s, 1),
               "resumed_from_step": resumed["restored_step"], "restore_s": resumed["restore_seconds"],
               "ps_kill_to_chief_resumed_s": round(resumed["time"] - t_kill, 2),
               "ps_kill_to_first_execution_s": round(t_first - t_kill, 2),
               "total_s": round(time.time() - t_start, 1)}
    report("scale_64_workers", figures)
