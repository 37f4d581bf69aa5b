"""Tasks of a job start together: the coordinator's first variable waits for late parameter servers."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kubeps.runtime.cluster import TFConfigClusterResolver
from kubeps.runtime.errors import PSUnavailableError, RuntimeConfigError
from kubeps.runtime.server import Server
from kubeps.runtime.coordinator.strategy import ParameterServerStrategy

TOKEN = "startup-test-token-0123456789abcdef"


def _cluster(ports):
    return {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"], "worker": [f"127.0.0.1:{ports[2]}"]}


def _strategy(cluster, **kwargs):
    resolver = TFConfigClusterResolver(tf_config={"cluster": cluster, "task": {"type": "chief", "index": 0}})
    return ParameterServerStrategy(resolver, job_token=TOKEN, **kwargs)


def test_first_variable_waits_for_a_late_parameter_server(free_port_list):
    cluster = _cluster(free_port_list(3))
    strategy = _strategy(cluster)
    servers = []
    starter = threading.Timer(1.0, lambda: servers.append(
        Server(cluster, "ps", 0, token=TOKEN, bind_host="127.0.0.1")))
    starter.start()
    try:
        began = time.monotonic()
        with strategy.scope():
            v = strategy_variable(strategy)
        assert time.monotonic() - began >= 0.9
        np.testing.assert_array_equal(v.numpy(), np.arange(4, dtype=np.float32))
    finally:
        starter.join()
        for s in servers:
            s.stop()
        strategy.close()


def test_a_parameter_server_that_never_comes_is_named(free_port_list):
    cluster = _cluster(free_port_list(3))
    strategy = _strategy(cluster, ps_startup_timeout=1.5)
    try:
        began = time.monotonic()
        with pytest.raises(PSUnavailableError, match=r"/job:ps/task:0 at 127\.0\.0\.1:\d+"):
            with strategy.scope():
                strategy_variable(strategy)
        assert time.monotonic() - began < 10
    finally:
        strategy.close()


def test_the_chief_says_it_waits_for_how_long_and_for_which_ps(free_port_list, caplog):
    """The only output while waiting was a heartbeat line that looked fatal."""
    import logging

    cluster = _cluster(free_port_list(3))
    strategy = _strategy(cluster, ps_startup_timeout=1.5)
    try:
        with caplog.at_level(logging.WARNING, logger="kubeps.runtime.coordinator.strategy"):
            with pytest.raises(PSUnavailableError, match=r"no answer within ps_startup_timeout=1.5 s .*still silent: "
                                                         r"/job:ps/task:0 at 127\.0\.0\.1:\d+"):
                with strategy.scope():
                    strategy_variable(strategy)
        assert re.search(r"waiting up to 1.5 s \(ps_startup_timeout\) for 1 parameter server\(s\) to answer: "
                         r"/job:ps/task:0 at " + re.escape(cluster["ps"][0]), caplog.text), caplog.text
    finally:
        strategy.close()


def _train_with_a_ps_that_starts_late(free_port_list, idle_before_first_variable: float) -> None:
    """A coordinator whose only ps starts listening 4.5 s after it, and a variable created after
    ``idle_before_first_variable`` s: the job must go on once the ps is there (sum of the variable: 6)."""
    from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator

    cluster = _cluster(free_port_list(3))
    strategy = _strategy(cluster, ps_startup_timeout=30)
    servers = [Server(cluster, "worker", 0, token=TOKEN, bind_host="127.0.0.1")]
    coordinator = ClusterCoordinator(strategy)
    starter = threading.Timer(4.5, lambda: servers.append(Server(cluster, "ps", 0, token=TOKEN, bind_host="127.0.0.1")))
    starter.start()
    try:
        time.sleep(idle_before_first_variable)
        with strategy.scope():
            v = strategy_variable(strategy)
        result = coordinator.schedule(lambda: v.read_value().sum())
        coordinator.join()
        assert result.fetch() == 6
    finally:
        starter.join()
        coordinator.shutdown()
        for s in servers:
            s.stop()
        strategy.close()


def test_a_coordinator_started_before_its_ps_does_not_declare_them_dead(free_port_list):
    """The heartbeat declared a ps that was not listening yet dead after 3 s, failing the job once it came."""
    _train_with_a_ps_that_starts_late(free_port_list, idle_before_first_variable=0)


def test_a_ps_still_starting_before_the_first_variable_is_not_declared_dead(free_port_list):
    """The Keras ``fit`` path builds per-worker resources before any variable: on a loaded machine a ps that took more
    than 3 s to listen was declared dead by the heartbeat (nobody had waited for it yet), failing the job. Here
    the coordinator runs 5.5 s before the first variable (past the heartbeat's 3 s of silence) while the ps starts
    at 4.5 s."""
    _train_with_a_ps_that_starts_late(free_port_list, idle_before_first_variable=5.5)


def test_startup_timeout_must_be_positive(free_port_list):
    with pytest.raises(RuntimeConfigError, match="'ps_startup_timeout' has invalid value 0"):
        _strategy(_cluster(free_port_list(3)), ps_startup_timeout=0)


@pytest.mark.parametrize("task_type", ["ps", "worker"])
def test_a_ps_or_worker_that_builds_the_strategy_is_told_to_run_a_server(free_port_list, task_type):
    resolver = TFConfigClusterResolver(tf_config={"cluster": _cluster(free_port_list(3)),
                                                  "task": {"type": task_type, "index": 0}})
    with pytest.raises(RuntimeConfigError, match=rf"'TF_CONFIG.task.type' has invalid value '{task_type}': "
                                                 r"ParameterServerStrategy runs on the chief.*kp\.Server\("):
        ParameterServerStrategy(resolver, job_token=TOKEN)


def test_a_coordinator_only_program_fails_at_once_on_a_ps(free_port_list, tmp_path):
    """docs/runtime.md's example once held only the coordinator's code: on a ps it waited 120 s for servers that the
    ps itself should have been running. Now the ps task exits at once, saying what to run."""
    script = tmp_path / "coordinator_only.py"
    script.write_text("import kubeps.runtime as kp\n"
                      "strategy = kp.ParameterServerStrategy(kp.TFConfigClusterResolver())\n"
                      "coordinator = kp.ClusterCoordinator(strategy)\n")
    env = {**os.environ, "KUBEPS_JOB_TOKEN": TOKEN,
           "TF_CONFIG": json.dumps({"cluster": _cluster(free_port_list(3)), "task": {"type": "ps", "index": 0}})}
    began = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert time.monotonic() - began < 30
    assert "runs on the chief (the coordinator) only" in result.stderr, result.stderr[-2000:]


def strategy_variable(strategy):
    from kubeps.runtime.variables.variable import Variable

    return Variable(np.arange(4, dtype=np.float32), name="v")


@pytest.fixture
def free_port_list():
    from socket import socket

    def ports(n):
        socks = [socket() for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        out = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        return out

    return ports
