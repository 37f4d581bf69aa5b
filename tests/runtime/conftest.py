"""A local kubeps cluster for runtime tests: N ps + M worker processes (``python -m kubeps.runtime.server``) on
free loopback ports, with TF_CONFIG and a job token, torn down by PID."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import pytest

from kubeps.runtime.cluster import TFConfig, TFConfigClusterResolver
from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator
from kubeps.runtime.errors import RemoteError
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.protocol import PS_SERVICE, WORKER_SERVICE
from kubeps.runtime.rpc.tls import load_tls
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.variables.variable import Variable

TOKEN = "kubeps-test-token-0123456789abcdef"


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class LocalCluster:
    """``num_ps`` parameter servers and ``num_workers`` workers as real processes on 127.0.0.1."""

    def __init__(self, num_ps: int, num_workers: int, log_dir: Path, token: str | None = TOKEN,
                 extra_env: dict[str, str] | None = None):
        ports = free_ports(num_ps + num_workers + 1)
        self.cluster = {
            "chief": [f"127.0.0.1:{ports[0]}"],
            "ps": [f"127.0.0.1:{p}" for p in ports[1 : 1 + num_ps]],
            "worker": [f"127.0.0.1:{p}" for p in ports[1 + num_ps :]],
        }
        self.token = token
        self.log_dir = log_dir
        self.extra_env = dict(extra_env or {})
        #: the tasks' mutual TLS files when ``extra_env`` names them (KUBEPS_TLS_*_FILE), else None
        self.tls = load_tls(TaskSettings.from_env(self.extra_env))
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}

    # -- processes -----------------------------------------------------------------------------------------------
    def env_for(self, job: str, index: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEPS_") and k != "TF_CONFIG"}
        env["TF_CONFIG"] = TFConfig.for_task(self.cluster, job, index).to_json()
        env["KUBEPS_BIND_HOST"] = "127.0.0.1"
        env["KUBEPS_LOG_LEVEL"] = "WARNING"
        if self.token:
            env["KUBEPS_JOB_TOKEN"] = self.token
        env.update(self.extra_env)
        return env

    def start_task(self, job: str, index: int, wait: bool = True) -> subprocess.Popen:
        log = open(self.log_dir / f"{job}-{index}-{len(self.procs)}-{time.monotonic_ns()}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "kubeps.runtime.server"], env=self.env_for(job, index),
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs[(job, index)] = proc
        if wait:
            self.wait_ready(job, index)
        return proc

    def start(self) -> "LocalCluster":
        for job in ("ps", "worker"):
            for i in range(len(self.cluster[job])):
                self.start_task(job, i, wait=False)
        for job in ("ps", "worker"):
            for i in range(len(self.cluster[job])):
                self.wait_ready(job, i)
        return self

    def client(self, job: str, index: int, token: str | None = "default", timeout: float = 5.0) -> Client:
        service = PS_SERVICE if job == "ps" else WORKER_SERVICE
        return Client(self.cluster[job][index], service, self.token if token == "default" else token, timeout,
                      tls=self.tls)

    def wait_ready(self, job: str, index: int, timeout: float = 60.0) -> None:
        client = self.client(job, index, timeout=2.0)
        deadline = time.monotonic() + timeout
        try:
            while True:
                proc = self.procs[(job, index)]
                if proc.poll() is not None:
                    raise RuntimeError(f"{job}:{index} exited with {proc.returncode}: {self.log_text(job, index)}")
                try:
                    client.call("Ping", timeout=2.0)
                    return
                except RemoteError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        finally:
            client.close()

    def log_text(self, job: str, index: int) -> str:
        logs = sorted(self.log_dir.glob(f"{job}-{index}-*.log"))
        return logs[-1].read_text(errors="replace") if logs else ""

    def kill(self, job: str, index: int) -> None:
        proc = self.procs.pop((job, index))
        proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()

    # -- coordinator side ----------------------------------------------------------------------------------------
    def resolver(self) -> TFConfigClusterResolver:
        return TFConfigClusterResolver(tf_config=TFConfig.for_task(self.cluster, "chief", 0))

    def strategy(self, **kwargs: Any):
        from kubeps.runtime.coordinator.strategy import ParameterServerStrategy

        kwargs.setdefault("job_token", self.token)
        kwargs.setdefault("tls", self.tls)
        return ParameterServerStrategy(self.resolver(), **kwargs)


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    """The first true value of ``predicate()``, polled every 50 ms; an AssertionError naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@contextlib.contextmanager
def running_coordinator(cluster: LocalCluster, **kwargs: Any) -> Iterator[ClusterCoordinator]:
    """A coordinator of ``cluster``'s strategy, shut down (and the strategy closed) on the way out."""
    strategy = cluster.strategy()
    coordinator = ClusterCoordinator(strategy, **kwargs)
    try:
        yield coordinator
    finally:
        coordinator.shutdown()
        strategy.close()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Any]:
    """Factory: ``make_cluster(num_ps, num_workers)`` starts a cluster that is torn down after the test."""
    clusters: list[LocalCluster] = []

    def make(num_ps: int = 1, num_workers: int = 1, start: bool = True, **kwargs: Any) -> LocalCluster:
        cluster = LocalCluster(num_ps, num_workers, tmp_path, **kwargs)
        clusters.append(cluster)
        return cluster.start() if start else cluster

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture
def two_ps_job(make_cluster) -> Iterator[Any]:
    """Factory: ``two_ps_job(step_sleep=0, **coordinator_kwargs)`` starts 2 ps and 1 worker, a coordinator, variables
    ``a`` (on ps 0) and ``b`` (on ps 1), and a ``step`` pushing an SGD update to both, already run 3 times. Returns
    a namespace (``cluster``, ``strategy``, ``coordinator``, ``a``, ``b``, ``step``); shut down after the test."""
    made: list[tuple[ClusterCoordinator, Any]] = []

    def make(step_sleep: float = 0.0, **coordinator_kwargs: Any) -> SimpleNamespace:
        cluster = make_cluster(num_ps=2, num_workers=1)
        strategy = cluster.strategy()
        coordinator = ClusterCoordinator(strategy, **coordinator_kwargs)
        made.append((coordinator, strategy))
        with strategy.scope():
            a = Variable(np.zeros(2), name="a")
            b = Variable(np.zeros(2), name="b")  # on ps 1
        opt = SGD(learning_rate=0.1)

        def step():
            opt.apply_gradients([(np.ones(2), a), (np.ones(2), b)])
            if step_sleep:
                time.sleep(step_sleep)

        for _ in range(3):
            coordinator.schedule(step)
        coordinator.join()
        return SimpleNamespace(cluster=cluster, strategy=strategy, coordinator=coordinator, a=a, b=b, step=step)

    yield make
    for coordinator, strategy in made:
        coordinator.shutdown()
        strategy.close()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """2 ps + 2 workers shared by a test module (tests must not kill its tasks)."""
    cluster = LocalCluster(2, 2, tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def coord(shared_cluster: LocalCluster):
    """``(strategy, coordinator)`` on the module's shared cluster; tables split in 2 shards."""
    from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator
    from kubeps.runtime.variables.partitioners import FixedShardsPartitioner

    strategy = shared_cluster.strategy(variable_partitioner=FixedShardsPartitioner(2))
    coordinator = ClusterCoordinator(strategy)
    yield strategy, coordinator
    coordinator.shutdown()
    strategy.close()


@contextlib.contextmanager
def fake_worker_coordinator(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, client_type: type,
                            **kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """``(coordinator, client)``: a coordinator whose one worker is ``client_type``, a stand-in for ``rpc.Client``.
    The ps addresses lead nowhere: a huge ``heartbeat_failures`` keeps the failure detector from declaring the ps
    dead during a test; ``kwargs`` go to the coordinator."""
    from kubeps.runtime.coordinator import cluster_coordinator as coordinator_module
    from kubeps.runtime.coordinator.strategy import ParameterServerStrategy

    monkeypatch.setattr(coordinator_module, "Client", client_type)
    strategy = ParameterServerStrategy(LocalCluster(1, 1, tmp_path).resolver(), job_token=TOKEN)
    coordinator = ClusterCoordinator(strategy, heartbeat_failures=10_000, **kwargs)
    try:
        client = coordinator.workers.members[0].client
        assert isinstance(client, client_type)
        yield coordinator, client
    finally:
        coordinator.shutdown()
        strategy.close()
