"""A ps task of several server processes (``KUBEPS_PS_PROCESSES``): the cluster as kubeps tasks read it, the task's
own process supervising the others, and training over ``kubeps local --ps-processes`` (real processes, gRPC)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kubeps.runtime.cluster import TFConfig, TFConfigClusterResolver, TFConfigError
from kubeps.runtime.local.launcher import LocalCluster, free_port_runs
from kubeps.runtime.server.processes import EXIT_PROCESS_LOST

CLUSTER = {"chief": ["c:1"], "ps": ["a:2222", "[::1]:3000"], "worker": ["w:1"]}


def test_each_ps_task_becomes_its_processes_own_first_then_every_second_process():
    config = TFConfig.for_task(CLUSTER, "ps", 1).with_ps_processes(3, 2)
    assert config.cluster["ps"] == ["a:2222", "[::1]:3000", "a:2223", "[::1]:3001", "a:2224", "[::1]:3002"]
    assert config.task_index == 1 + 2 * 2 and config.address() == "[::1]:3002"
    assert config.cluster["worker"] == ["w:1"] and config.cluster["chief"] == ["c:1"]
    worker = TFConfig.for_task(CLUSTER, "worker", 0)
    assert worker.with_ps_processes(1) is worker
    assert worker.with_ps_processes(2).cluster["ps"][2:] == ["a:2223", "[::1]:3001"]


def test_the_resolver_reads_the_processes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", TFConfig.for_task(CLUSTER, "chief", 0).to_json())
    monkeypatch.setenv("KUBEPS_PS_PROCESSES", "2")
    assert TFConfigClusterResolver().cluster_spec().num_tasks("ps") == 4


@pytest.mark.parametrize("processes, process, field, says", [
    (0, 0, "KUBEPS_PS_PROCESSES", ">= 1"),
    (2, 2, "process", "0..1"),
    (2, 1, "process", "only a ps task"),
])
def test_bad_process_counts_are_refused_naming_the_field(processes, process, field, says):
    with pytest.raises(TFConfigError) as err:
        TFConfig.for_task(CLUSTER, "worker", 0).with_ps_processes(processes, process)
    assert field in str(err.value) and says in str(err.value)


def test_ports_past_65535_are_refused():
    config = TFConfig.for_task({"chief": ["c:1"], "ps": ["a:65535"], "worker": ["w:1"]}, "chief", 0)
    with pytest.raises(TFConfigError, match="at most 1 processes"):
        config.with_ps_processes(2)


def _serve(ports_from: int, processes: int, tmp_path, **extra_env: str) -> subprocess.Popen:
    cluster = {"chief": [f"127.0.0.1:{ports_from + processes}"], "ps": [f"127.0.0.1:{ports_from}"],
               "worker": [f"127.0.0.1:{ports_from + processes + 1}"]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEPS_")}
    env.update(TF_CONFIG=TFConfig.for_task(cluster, "ps", 0).to_json(), KUBEPS_JOB_TOKEN="t" * 32,
               KUBEPS_BIND_HOST="127.0.0.1", KUBEPS_PS_PROCESSES=str(processes), **extra_env)
    log = open(tmp_path / "ps.log", "wb")  # noqa: SIM115 - the process writes it until the test ends
    return subprocess.Popen([sys.executable, "-m", "kubeps.runtime.server"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def _children(pid: int, want: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            found = [int(p) for p in f.read().split()]
        if len(found) == want:
            return found
        time.sleep(0.1)
    raise AssertionError(f"pid {pid} has not started {want} process(es) in {timeout} s")


def _gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_ps_task_ends_when_one_of_its_processes_dies(tmp_path):
    port = free_port_runs(1, 5)[0]
    task = _serve(port, 3, tmp_path)
    try:
        others = _children(task.pid, 2)
        os.kill(others[0], signal.SIGKILL)  # a process this test started (through the ps task)
        assert task.wait(timeout=30) == EXIT_PROCESS_LOST
        assert _gone(others[1]), "the task's other process outlived it"
        assert "exited with status -9 while its task served" in (tmp_path / "ps.log").read_text()
    finally:
        if task.poll() is None:
            task.kill()
            task.wait()


def test_the_processes_of_a_killed_ps_task_die_with_it(tmp_path):
    port = free_port_runs(1, 4)[0]
    task = _serve(port, 2, tmp_path)
    try:
        other = _children(task.pid, 1)[0]
        os.kill(task.pid, signal.SIGKILL)  # the task's own process, as a kubelet's kill would
        task.wait(timeout=10)
        assert _gone(other), "the second process outlived its task"
    finally:
        if task.poll() is None:
            task.kill()
            task.wait()


def test_a_process_whose_ps_task_has_ended_exits_at_once(tmp_path):
    """A server process a ps task started sets PR_SET_PDEATHSIG itself (nothing runs between fork and exec in the
    task's threaded process) and first checks the task is still its parent: here it names pid 1, not its parent."""
    task = _serve(free_port_runs(1, 3)[0], 1, tmp_path, KUBEPS_PS_TASK_PID="1")
    try:
        assert task.wait(timeout=60) == EXIT_PROCESS_LOST
    finally:
        if task.poll() is None:
            task.kill()
            task.wait()
    log = (tmp_path / "ps.log").read_text()
    assert "the ps task's process 1 ended before this process of it started" in log
    assert "serving" not in log


PROGRAM = textwrap.dedent("""
    import sys
    import numpy as np
    import kubeps.runtime as kp

    resolver = kp.TFConfigClusterResolver()
    if resolver.task_type in ("ps", "worker"):
        kp.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
        sys.exit(0)
    servers = resolver.cluster_spec().num_tasks("ps")
    strategy = kp.ParameterServerStrategy(resolver, variable_partitioner=kp.FixedShardsPartitioner(servers))
    coordinator = kp.ClusterCoordinator(strategy)
    with strategy.scope():
        table = kp.Variable(np.zeros((8, 3), np.float32), name="table")
    optimizer = kp.SGD(learning_rate=1.0)

    def step():
        optimizer.apply_gradients([(-np.ones((8, 3), np.float32), table)])
        return 0

    for _ in range(5):
        coordinator.schedule(step)
    coordinator.join()
    print("servers", servers, "shards on", sorted({v.device for v in table.variables}), "sum",
          float(np.asarray(table).sum()), flush=True)
    coordinator.shutdown()
    strategy.close()
""")


def test_kubeps_local_trains_on_ps_tasks_of_two_processes(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(PROGRAM)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        cluster = LocalCluster(str(script), num_ps=2, num_workers=1, ps_processes=2, output=f, log=f, tls=False)
        with cluster:
            cluster.start()
            assert cluster.wait(timeout=180) == 0, out.read_text()
    text = out.read_text()
    shards = ", ".join(f"'/job:ps/replica:0/task:{i}/device:CPU:0'" for i in range(4))
    assert f"servers 4 shards on [{shards}] sum 120.0" in text, text
    # the other processes of a ps task serve no metrics: none tries the port of the task's own process
    assert "cannot serve on port" not in text, text
