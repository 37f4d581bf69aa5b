"""CPU budget per task and math thread pools sized to it (kubeps.runtime.util.threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kubeps.runtime.util import threads
from kubeps.runtime.local.launcher import LauncherError, LocalCluster
from kubeps.runtime.settings import TaskSettings


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota(tmp_path):
    _write(tmp_path, "cpu.max", "150000 100000\n")
    assert threads.cgroup_cpu_limit(str(tmp_path)) == 1.5
    budget = threads.cpu_budget(TaskSettings(), cgroup_root=str(tmp_path))
    assert int(budget) == min(2, threads._affinity()) and budget.source in ("cgroup quota", "affinity")


def test_cgroup_v2_no_quota(tmp_path):
    _write(tmp_path, "cpu.max", "max 100000\n")
    assert threads.cgroup_cpu_limit(str(tmp_path)) is None


def test_cgroup_v1_quota_and_unlimited(tmp_path):
    _write(tmp_path, "cpu,cpuacct/cpu.cfs_quota_us", "50000\n")
    _write(tmp_path, "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert threads.cgroup_cpu_limit(str(tmp_path)) == 0.5
    assert int(threads.cpu_budget(TaskSettings(), cgroup_root=str(tmp_path))) == 1  # half a CPU still gets one thread
    _write(tmp_path, "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    assert threads.cgroup_cpu_limit(str(tmp_path)) is None


def test_env_overrides_when_smaller(tmp_path):
    budget = threads.cpu_budget(TaskSettings(cpus=1), cgroup_root=str(tmp_path))
    assert (int(budget), budget.source) == (1, threads.CPUS_ENV)
    # a larger request never exceeds what the task may run on
    assert int(threads.cpu_budget(TaskSettings(cpus=4096), cgroup_root=str(tmp_path))) == threads._affinity()


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_malformed_env_names_variable_value_and_allowed(value):
    with pytest.raises(ValueError) as err:
        TaskSettings.from_env({threads.CPUS_ENV: value})
    message = str(err.value)
    assert threads.CPUS_ENV in message and repr(value) in message and ">= 1" in message


def test_limit_math_threads_caps_blas_in_a_fresh_process():
    code = (
        "import numpy, threadpoolctl, json\n"
        "from kubeps.runtime.settings import TaskSettings\n"
        "from kubeps.runtime.util.threads import limit_math_threads\n"
        "b = limit_math_threads(settings=TaskSettings.from_env())\n"
        "print(json.dumps([int(b), b.source, [p['num_threads'] for p in threadpoolctl.threadpool_info()]]))\n"
    )
    env = dict(os.environ, **{threads.CPUS_ENV: "1"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    cpus, source, pools = json.loads(out.stdout)
    assert (cpus, source) == (1, threads.CPUS_ENV)
    assert pools and all(n == 1 for n in pools)


def test_local_cluster_gives_each_task_its_share(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    env = {k: v for k, v in os.environ.items() if k != threads.CPUS_ENV}
    cluster = LocalCluster(str(script), num_ps=2, num_workers=2, env=env)
    share = max(1, int(threads.cpu_budget(TaskSettings.from_env(env))) // 4)
    assert cluster.task_env("worker", 0)[threads.CPUS_ENV] == str(share)
    # an explicit budget is kept, and a malformed one is a launcher error naming it
    cluster = LocalCluster(str(script), env=dict(env, **{threads.CPUS_ENV: "3"}))
    assert cluster.task_env("ps", 1)[threads.CPUS_ENV] == "3"
    with pytest.raises(LauncherError, match=threads.CPUS_ENV):
        LocalCluster(str(script), env=dict(env, **{threads.CPUS_ENV: "lots"}))


class _FakeClosures:
    """Closures whose wall and CPU time depend on the thread count the tuner applied."""

    def __init__(self, costs):
        self.costs, self.threads, self.wall, self.cpu = costs, None, 0.0, 0.0

    def apply(self, n):
        self.threads = n

    def run(self, tuner):
        with tuner.measure():
            wall, cpu = self.costs[self.threads]
            self.wall += wall
            self.cpu += cpu


@pytest.mark.parametrize("costs, chosen", [
    # threads that spin on small matmuls: hardly faster, twice or four times the CPU -> one thread
    ({1: (10, 10), 2: (9.5, 19), 4: (9, 36)}, 1),
    # a real parallel gain at the same CPU: the fastest within 1.2x the CPU of one thread
    ({1: (10, 10), 2: (5.5, 11), 4: (3, 12)}, 4),
    ({1: (10, 10), 2: (5.5, 11), 4: (2.9, 14)}, 2),
    # cheaper but not 10% faster: not worth a pool
    ({1: (10, 10), 2: (9.5, 10), 4: (9.4, 10)}, 1),
])
def test_a_worker_keeps_the_threads_that_buy_speed_without_costing_cpu(costs, chosen, caplog):
    from kubeps.runtime.util.threads import MathThreadTuner

    closures = _FakeClosures(costs)
    tuner = MathThreadTuner(4, trials=3, warmup=2, apply=closures.apply,
                            clocks=(lambda: closures.wall, lambda: closures.cpu))
    assert tuner.candidates == [1, 2, 4] and closures.threads == 1
    with caplog.at_level("INFO", logger="kubeps.threads"):
        for _ in range(2 + 3 * 3):
            assert tuner.chosen is None
            closures.run(tuner)
    assert tuner.chosen == chosen and closures.threads == chosen
    assert f"{chosen} thread(s) of a budget of 4, chosen by what they buy" in caplog.text


def test_overlapping_closures_are_not_counted_and_a_budget_of_one_needs_no_trial():
    from kubeps.runtime.util.threads import MathThreadTuner

    applied = []
    assert MathThreadTuner(1, apply=applied.append).chosen == 1 and applied == []
    tuner = MathThreadTuner(2, warmup=0, trials=1, apply=applied.append, clocks=(lambda: 0.0, lambda: 0.0))
    with tuner.measure():
        with tuner.measure():
            pass
    assert tuner.chosen is None and applied == [1]
