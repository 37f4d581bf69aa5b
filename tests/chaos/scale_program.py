"""A lightweight training program for failures at scale: many workers, tiny closures, checkpoints.

Every task runs this file (``kubeps local``). The chief schedules numbered executions in chunks of ``--chunk``; each
execution marks its slot in a ``done`` vector on the parameter servers (``assign_add`` of a one-hot row, so a
re-run after a worker loss counts twice: at-least-once, visible) and sleeps ``--work-s`` on its worker. After each
chunk the chief saves ``done`` and the step (``step N/M ... saved ckpt-K``). It goes on until ``--stop-file`` exists
(at least ``--min-steps`` executions), then checks that every slot up to the last execution is marked and prints
``RESULT {...}``. Restarted after a lost ps (status 133), it resumes from the latest checkpoint (``resumed from step
N (..., restored in S s)``) and re-runs the executions after it.

Output lines are those of ``examples/ctr/train.py``, so the chaos harness (``conftest.py``) reads both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import kubeps.runtime as kp
from kubeps.runtime.checkpoint import Checkpoint, CheckpointManager, StepCounter
from kubeps.runtime.coordinator.supervisor import run_coordinator

SLOTS = 20_000  # executions a run may do at most


def log_closure(path: str, event: str, index: int) -> None:
    """``S|E execution worker pid time``, as the CTR example's ``--closure-log``."""
    with open(path, "a") as f:
        f.write(f"{event} {index} {kp.get_current_worker_index()} {os.getpid()} {time.time():.3f}\n")


def run_chief(args: argparse.Namespace, resolver: kp.TFConfigClusterResolver) -> int:
    strategy = kp.ParameterServerStrategy(resolver)
    coordinator = kp.ClusterCoordinator(strategy)
    with strategy.scope():
        done = kp.Variable(np.zeros(SLOTS, np.float32), name="done")
    step = StepCounter()
    manager = CheckpointManager(Checkpoint(done=done, step=step), args.checkpoint_dir, max_to_keep=2)
    t0 = time.perf_counter()
    start = manager.restore_or_initialize()
    if start:
        print(f"resumed from step {start} ({manager.latest_checkpoint}, restored in {time.perf_counter() - t0:.2f} s)",
              flush=True)
    else:
        print(f"no checkpoint in {args.checkpoint_dir}: starting from step 0", flush=True)
    closure_log, work_s = args.closure_log, args.work_s

    def execution(index):  # runs on a worker
        log_closure(closure_log, "S", index)
        time.sleep(work_s)
        row = np.zeros(SLOTS, np.float32)
        row[index] = 1.0
        done.assign_add(row)
        log_closure(closure_log, "E", index)
        return index

    executed = start
    while executed < SLOTS - args.chunk and (executed < args.min_steps or not os.path.exists(args.stop_file)):
        for index in range(executed, executed + args.chunk):
            coordinator.schedule(execution, args=(index,))
        coordinator.join()
        executed += args.chunk
        step.assign(executed)
        path = manager.save()
        print(f"step {executed:6d}/{SLOTS} chunk done, saved {os.path.basename(path)}", flush=True)
    marks = np.asarray(done.read_value())[:executed]
    missing = [int(i) for i in np.flatnonzero(marks < 1)]
    print("RESULT " + json.dumps({"executions": executed, "missing": missing, "reruns": int(marks.sum()) - executed,
                                  "resumed_from_step": start}), flush=True)
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--closure-log", required=True)
    p.add_argument("--metrics", help="unused (the chaos harness passes it)")
    p.add_argument("--stop-file", required=True, help="the chief stops after the chunk during which this appears")
    p.add_argument("--chunk", type=int, default=64, help="executions between checkpoints (64)")
    p.add_argument("--min-steps", type=int, default=128, help="executions before the stop file is looked at (128)")
    p.add_argument("--work-s", type=float, default=0.05, help="seconds each execution sleeps on its worker (0.05)")
    args = p.parse_args(argv)
    resolver = kp.TFConfigClusterResolver()
    if resolver.task_type in ("ps", "worker"):
        kp.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
        return 0
    return run_coordinator(lambda: run_chief(args, resolver))


if __name__ == "__main__":
    sys.exit(main())
