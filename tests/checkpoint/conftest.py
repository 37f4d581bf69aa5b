"""Parameter servers as real processes (``python -m kubeps.runtime.server``) for checkpoint tests, stopped by PID."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from kubeps.runtime.cluster import TFConfig, TFConfigClusterResolver
from kubeps.runtime.errors import RemoteError
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.protocol import PS_SERVICE

TOKEN = "kubeps-checkpoint-test-token-0123456789"


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class PSCluster:
    """``num_ps`` parameter servers on loopback; the worker and chief addresses are reserved, nothing runs there."""

    def __init__(self, num_ps: int, log_dir: Path):
        ports = _free_ports(num_ps + 2)
        self.cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"],
                        "ps": [f"127.0.0.1:{p}" for p in ports[2:]]}
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEPS_") and k != "TF_CONFIG"}
        env.update(KUBEPS_BIND_HOST="127.0.0.1", KUBEPS_LOG_LEVEL="WARNING", KUBEPS_JOB_TOKEN=TOKEN)
        for i in range(num_ps):
            env["TF_CONFIG"] = TFConfig.for_task(self.cluster, "ps", i).to_json()
            with open(log_dir / f"ps-{i}-{time.monotonic_ns()}.log", "wb") as log:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "kubeps.runtime.server"], env=dict(env),
                                                   stdout=log, stderr=subprocess.STDOUT))
        for i, address in enumerate(self.cluster["ps"]):
            client = Client(address, PS_SERVICE, TOKEN, 2.0)
            deadline = time.monotonic() + 60
            try:
                while True:
                    if self.procs[i].poll() is not None:
                        raise RuntimeError(f"ps {i} exited with {self.procs[i].returncode}")
                    try:
                        client.call("Ping", timeout=2.0)
                        break
                    except RemoteError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
            finally:
                client.close()

    def strategy(self, **kwargs):
        from kubeps.runtime.coordinator.strategy import ParameterServerStrategy

        resolver = TFConfigClusterResolver(tf_config=TFConfig.for_task(self.cluster, "chief", 0))
        return ParameterServerStrategy(resolver, job_token=TOKEN, **kwargs)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


@pytest.fixture
def ps_cluster(tmp_path: Path) -> Iterator:
    """Factory ``ps_cluster(num_ps)``; every cluster it made is stopped after the test."""
    made: list[PSCluster] = []

    def make(num_ps: int) -> PSCluster:
        c = PSCluster(num_ps, tmp_path)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()
