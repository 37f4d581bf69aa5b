"""Table-driven server methods: other modules add PS/worker methods without touching server.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.protocol import PS_SERVICE, WORKER_SERVICE
from kubeps.runtime.server import Server, register_ps_method, register_worker_method
from kubeps.runtime.server.methods import ps_methods

from .conftest import TOKEN, LocalCluster, free_ports

pytestmark = pytest.mark.timeout(90)


def _sum_all(state, meta, arrays):
    return {"names": state.names()}, [sum(state.read(n).sum() for n in state.names()) * np.ones(1) * meta["scale"]]


def test_register_ps_method_in_process():
    register_ps_method("SumAll", _sum_all, replace=True)
    register_worker_method("Echo", lambda state, meta, arrays: ({"worker": state.worker_index, **meta}, arrays),
                           replace=True)
    assert "SumAll" in ps_methods()
    ports = free_ports(2)
    cluster = {"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]}
    ps = Server(cluster, "ps", 0, token=TOKEN, bind_host="127.0.0.1")
    worker = Server(cluster, "worker", 0, token=TOKEN, bind_host="127.0.0.1")
    try:
        ps.state.create("a", np.ones(3))
        ps.state.create("b", np.ones((2, 2)))
        client = Client(cluster["ps"][0], PS_SERVICE, TOKEN, timeout=5)
        meta, (total,) = client.call("SumAll", {"scale": 2})
        assert sorted(meta["names"]) == ["a", "b"] and total[0] == 14
        wclient = Client(cluster["worker"][0], WORKER_SERVICE, TOKEN, timeout=5)
        meta, (echo,) = wclient.call("Echo", {"x": 1}, [np.arange(3)])
        assert meta == {"worker": 0, "x": 1}
        np.testing.assert_array_equal(echo, np.arange(3))
        client.close()
        wclient.close()
    finally:
        ps.stop(grace=None)
        worker.stop(grace=None)


def test_registration_checks():
    with pytest.raises(RuntimeConfigError, match="'name' has invalid value 'Ping'"):
        register_ps_method("Ping", _sum_all)
    with pytest.raises(RuntimeConfigError, match="already registered"):
        register_ps_method("Read", _sum_all)
    with pytest.raises(RuntimeConfigError, match="'fn'"):
        register_ps_method("Fine", 3)


def test_extension_module_registers_methods_in_server_process(tmp_path):
    (tmp_path / "kubeps_test_ext.py").write_text(textwrap.dedent("""
        import numpy as np
        from kubeps.runtime.server import register_ps_method

        def count(state, meta, arrays):
            return {"count": len(state.names())}, []

        register_ps_method("CountVariables", count)
    """))
    cluster = LocalCluster(1, 1, tmp_path, extra_env={
        "KUBEPS_SERVER_EXTENSIONS": "kubeps_test_ext",
        "PYTHONPATH": str(tmp_path),
    })
    try:
        cluster.start_task("ps", 0)
        client = cluster.client("ps", 0)
        assert client.call("CountVariables")[0] == {"count": 0}
        client.close()
    finally:
        cluster.stop()
    env = dict(cluster.env_for("ps", 0), KUBEPS_SERVER_EXTENSIONS="no_such_module_xyz")
    result = subprocess.run([sys.executable, "-m", "kubeps.runtime.server"], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and "KUBEPS_SERVER_EXTENSIONS' has invalid value 'no_such_module_xyz'" in result.stderr


def test_a_plain_server_serves_the_checkpoint_methods():
    """``kp.Server(...).join()`` -- the README's way to run a ps -- serves SaveShards/RestoreShards: the method
    tables are composed explicitly (server/methods.py), not filled by whoever happened to import the checkpoints."""
    port = free_ports(1)[0]
    code = textwrap.dedent(f"""
        import sys
        import kubeps.runtime as kp
        from kubeps.runtime.server import methods
        s = kp.Server({{"ps": ["127.0.0.1:{port}"], "worker": ["127.0.0.1:1"]}}, "ps", 0, token={TOKEN!r},
                      bind_host="127.0.0.1")
        print(sorted(set(methods.ps_methods()) & {{"SaveShards", "RestoreShards"}}))
        s.stop()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['RestoreShards', 'SaveShards']"
