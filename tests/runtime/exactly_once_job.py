"""A ``kubeps local`` job for tests/runtime/test_exactly_once.py: every step trains one batch of each of two
exactly-once datasets of record ids (a ``from_tensor_slices`` and a ``from_files``) and returns them; the chief
writes each step's worker, the worker's pid and the ids, one JSON line a step, as the steps finish, then prints the
chief's input counters. A step touches ``DATA_DIR/started-<worker>`` when it starts, and the steps from
``GATE_STEP`` on wait for ``DATA_DIR/gate``: the test lets them go once the worker it added has started one, so the
epoch does not end before the churn, however slow the machine.

Usage: ``kubeps local --ps 1 --workers 2 --restart exactly_once_job.py -- OUT_LINES DATA_DIR``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from kubeps.runtime.cluster import TFConfigClusterResolver
from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator
from kubeps.runtime.coordinator.strategy import ParameterServerStrategy
from kubeps.runtime.data import Dataset
from kubeps.runtime.server import Server
from kubeps.runtime.variables.context import get_current_worker_index

RECORDS, FILES, BATCH, STEP_SECONDS = 1500, 5, 5, 0.1
GATE_STEP = 150


def write_files(data_dir: str) -> str:
    """The ids ``0..RECORDS-1`` in ``FILES`` text files; their glob pattern."""
    per_file = RECORDS // FILES
    for part in range(FILES):
        with open(os.path.join(data_dir, f"ids-{part}.txt"), "w") as out:
            out.writelines(f"{i}\n" for i in range(part * per_file, (part + 1) * per_file))
    return os.path.join(data_dir, "ids-*.txt")


def step(slices, files, index: int, data_dir: str):
    worker = get_current_worker_index()
    open(os.path.join(data_dir, f"started-{worker}"), "a").close()
    while index >= GATE_STEP and not os.path.exists(os.path.join(data_dir, "gate")):
        time.sleep(0.02)
    time.sleep(STEP_SECONDS)
    return worker, os.getpid(), next(slices), next(files)


def main(out_path: str, data_dir: str) -> int:
    resolver = TFConfigClusterResolver()
    if resolver.task_type in ("ps", "worker"):
        Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
        return 0
    pattern = write_files(data_dir)
    strategy = ParameterServerStrategy(resolver)
    coordinator = ClusterCoordinator(strategy)
    slices = iter(coordinator.create_per_worker_dataset(
        lambda: Dataset.from_tensor_slices(np.arange(RECORDS)).batch(BATCH).prefetch(2), exactly_once=True,
        shard_records=50))
    files = iter(coordinator.create_per_worker_dataset(
        lambda: Dataset.from_files(pattern).map(int).batch(BATCH).prefetch(2), exactly_once=True))
    values = [coordinator.schedule(step, args=(slices, files, i, data_dir)) for i in range(RECORDS // BATCH)]
    with open(out_path, "w") as out:
        for value in values:
            worker, pid, a, b = value.fetch()
            out.write(json.dumps([worker, pid, [int(i) for i in a], [int(i) for i in b]]) + "\n")
            out.flush()
    figures = coordinator.workers.leases.figures()
    print("INPUT " + json.dumps(figures._asdict()), flush=True)
    coordinator.shutdown()
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
