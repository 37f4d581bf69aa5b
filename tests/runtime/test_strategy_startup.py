"""Tasks of a job start together: the coordinator's first variable waits for late parameter servers."""

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


def test_startup_timeout_must_be_positive(free_port_list):
    with pytest.raises(RuntimeConfigError, match="'ps_startup_timeout' has invalid value 0"):
        _strategy(_cluster(free_port_list(3)), ps_startup_timeout=0)


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
