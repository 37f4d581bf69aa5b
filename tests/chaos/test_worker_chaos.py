"""Kill a random worker every few seconds while the CTR example trains: the job completes, every scheduled execution
(``--steps-per-execution`` steps) ran at least once (duplicates counted), and the eval log-loss is within 2% of an
undisturbed run."""

from __future__ import annotations

import os
import random
import signal
import statistics
import time

import pytest

from .conftest import STEPS_PER_EXECUTION, report, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

# Long enough for the 4+ kills the test asks for at 1.5-3 s apart: 3600 steps were over in ~5 s on a quiet
# machine once the runtime got faster, after 3 kills.
STEPS = 12000
EXECUTIONS = STEPS // STEPS_PER_EXECUTION  # scheduled functions, numbered 0..EXECUTIONS-1 in the closure log
ARGS = ("--steps", str(STEPS), "--checkpoint-every", "2400", "--eval-examples", "20000")


def test_random_worker_kills_do_not_stop_training(chaos_run):
    baseline = chaos_run("baseline", program_args=ARGS)
    baseline.start()
    assert baseline.join(200) == 0  # ~20 s on an idle machine; generous for a loaded one (a bound, not a goal)
    base_loss = baseline.result()["logloss"]

    run = chaos_run("chaos", evaluator=True, program_args=ARGS)
    run.start()
    wait_until(lambda: len(run.runs()) >= 5, 60, "the first closures")
    # a hung worker (SIGSTOP: the connection stays open, nothing answers) is found by the heartbeat
    frozen = run.task("worker", 0)
    wait_until(lambda: [r for r in run.runs("S") if r[1] == 0 and r[2] == frozen.pid], 30, "worker 0 busy")
    t_freeze = time.time()
    os.kill(frozen.pid, signal.SIGSTOP)
    wait_until(lambda: run.stream.first("worker 0 missed", after=t_freeze), 20, "the heartbeat to notice worker 0")
    heartbeat_detection = run.stream.first("worker 0 missed", after=t_freeze) - t_freeze
    os.kill(frozen.pid, signal.SIGKILL)  # then it dies for good and is restarted
    rng = random.Random(6)
    kills: list[tuple[float, int, int]] = [(t_freeze, 0, frozen.pid)]  # (time, worker index, pid)
    while run.running and len(kills) < 8:
        time.sleep(rng.uniform(1.5, 3.0))
        index = rng.randrange(3)
        task = run.task("worker", index)
        if task is None or not task.running or not run.running:
            continue
        kills.append((time.time(), index, task.pid))
        os.kill(task.pid, signal.SIGKILL)  # a process this test's cluster started
    assert run.join(180) == 0, "the job must complete despite the worker kills"
    assert len(kills) >= 4, f"only {len(kills)} kills happened before the job ended; make the run longer"

    runs, starts = run.runs("E"), run.runs("S")
    counts: dict[int, int] = {}
    for i, *_ in runs:
        counts[i] = counts.get(i, 0) + 1
    missing = sorted(set(range(EXECUTIONS)) - set(counts))
    assert not missing, f"scheduled executions never ran to completion: {missing}"
    assert set(counts) == set(range(EXECUTIONS)), sorted(set(counts) - set(range(EXECUTIONS)))
    duplicates = sum(c - 1 for c in counts.values())  # completed twice (at-least-once)
    reruns = len(starts) - EXECUTIONS  # started again after their worker died (partial runs included)
    assert reruns >= 1, "killing busy workers must have re-run at least one execution"

    result = run.result()
    assert result["resumed_from_step"] == 0, "worker failures must not restart the chief"
    loss = result["logloss"]
    assert abs(loss - base_loss) / base_loss < 0.02, f"log-loss {loss:.4f} vs undisturbed {base_loss:.4f}"

    # detection: the coordinator logs the failure of a worker whose RunClosure call broke
    detections, recoveries = [], []
    for n, (t_kill, index, pid) in enumerate(kills[1:], start=1):
        # a worker killed while idle and restarted before its next dispatch is never seen failing: a detection
        # after the next kill belongs to that one, not to this
        until = kills[n + 1][0] if n + 1 < len(kills) else t_kill + 30
        t_detect = run.stream.first(f"worker {index} (", after=t_kill)
        if t_detect is not None and t_detect < until:
            detections.append(t_detect - t_kill)
        # recovery: the first closure finished by the restarted process of that worker
        after = [t for i, w, p, t in runs if w == index and p != pid and t > t_kill]
        if after:
            recoveries.append(min(after) - t_kill)
    assert heartbeat_detection < 10, f"a hung worker was detected after {heartbeat_detection:.1f} s"
    assert detections, "no worker failure was detected by the coordinator"
    assert max(detections) < 10, f"worker failure detection took {max(detections):.1f} s"
    # a recovery is the restarted process's boot (Python, JAX, its dataset, the first function) plus the restart
    # backoff (up to 2 s) and the reconnect: 3.6 s median and 8 s at most on a 2-core machine beside a Go build,
    # but up to 31 s in a CI run under the suite's full load. The median holds the coordinator to a prompt return
    # (a reconnect that waited out a long backoff would fail it); the max, to a return while the job runs.
    took = f"recoveries took {sorted(round(r, 1) for r in recoveries)} s"
    assert recoveries, "no restarted worker finished a function"
    assert statistics.median(recoveries) < 30, took
    assert max(recoveries) < 60, took

    # the sidecar evaluator followed the checkpoints and evaluated the final one, as the chief did
    from kubeps.runtime.checkpoint.evaluator import read_metrics

    records = read_metrics(str(run.metrics))
    assert records and records[-1]["final"] and records[-1]["step"] == STEPS
    assert [r["step"] for r in records] == sorted({r["step"] for r in records}), "one line per checkpoint, in order"
    assert abs(records[-1]["metrics"]["logloss"] - loss) < 1e-4

    report("worker_kills", {
        "kills": len(kills), "executions": EXECUTIONS, "completed_executions": len(runs), "completed_twice": duplicates,
        "started_again": reruns, "hung_worker_detection_s": round(heartbeat_detection, 3),
        "log_loss": round(loss, 5), "undisturbed_log_loss": round(base_loss, 5),
        "relative_diff": round(abs(loss - base_loss) / base_loss, 5),
        "detection_s_median": round(statistics.median(detections), 3), "detection_s_max": round(max(detections), 3),
        "recovery_s_median": round(statistics.median(recoveries), 3), "recovery_s_max": round(max(recoveries), 3),
        "evaluations": len(records),
    })
