"""Real processes over gRPC on loopback: datasets, batching, security, bad config, and failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import cloudpickle
import numpy as np
import pytest

from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator, PerWorkerIterator
from kubeps.runtime.variables.context import current_closure_context, get_current_worker_index
from kubeps.runtime.errors import InsecureServerError, PSUnavailableError, RemoteError, UnauthenticatedError
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.server import Server
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.variables.variable import Variable

from .conftest import TOKEN, free_ports

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def coord(shared_cluster):
    strategy = shared_cluster.strategy()
    coordinator = ClusterCoordinator(strategy)
    yield strategy, coordinator
    coordinator.shutdown()
    strategy.close()


def _counting_dataset():
    worker = get_current_worker_index()
    i = 0
    while True:
        yield worker, i
        i += 1


def test_per_worker_dataset_and_worker_index(coord):
    strategy, coordinator = coord
    dataset = coordinator.create_per_worker_dataset(_counting_dataset)
    iterator = iter(dataset)
    assert isinstance(iterator, PerWorkerIterator)
    with pytest.raises(TypeError, match="not allowed on the coordinator"):
        next(iterator)

    def step(it):
        worker, i = next(it)
        assert worker == get_current_worker_index()
        return worker, i

    results = coordinator.fetch([coordinator.schedule(step, args=(iterator,)) for _ in range(12)])
    per_worker = {}
    for worker, i in results:
        per_worker.setdefault(worker, []).append(i)
    for worker, seen in per_worker.items():
        assert sorted(seen) == list(range(len(seen)))  # each worker consumes its own iterator in order
    assert sum(len(v) for v in per_worker.values()) == 12

    # a dataset fn that takes an InputContext gets the worker's pipeline id
    ds2 = coordinator.create_per_worker_dataset(lambda ctx: iter([(ctx.input_pipeline_id, ctx.num_input_pipelines)] * 100))
    it2 = iter(ds2)
    out = coordinator.fetch([coordinator.schedule(lambda it: (next(it), get_current_worker_index()), args=(it2,))
                             for _ in range(6)])
    for (pipeline, n), worker in out:
        assert pipeline == worker and n == 2


def test_strategy_distributes_datasets_as_tensorflow_does(coord):
    """Both of TF's forms: a DistributedDataset made on the coordinator and handed to create_per_worker_dataset, and
    the tutorial's dataset fn that calls the captured strategy on the worker."""
    from kubeps.runtime.data import Dataset, DistributedDataset
    from kubeps.runtime.errors import RuntimeConfigError

    strategy, coordinator = coord
    data = np.arange(40)

    def take(it):
        return get_current_worker_index(), int(next(it))

    def drawn(per_worker_dataset, n=12):
        iterator = iter(per_worker_dataset)
        return coordinator.fetch([coordinator.schedule(take, args=(iterator,)) for _ in range(n)])

    dist = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices(data).repeat())
    assert isinstance(dist, DistributedDataset)
    with pytest.raises(TypeError, match="create_per_worker_dataset"):
        iter(dist)
    out = drawn(coordinator.create_per_worker_dataset(dist))
    assert {w for w, _ in out} <= {0, 1} and all(value % 2 == worker for worker, value in out)  # DATA: worker::2

    def dataset_fn(ctx):
        assert ctx.num_input_pipelines == 2 and ctx.input_pipeline_id == get_current_worker_index()
        return Dataset.from_tensor_slices(data + 1000 * ctx.input_pipeline_id).repeat()

    on_coordinator = strategy.distribute_datasets_from_function(dataset_fn)
    on_workers = lambda: strategy.distribute_datasets_from_function(dataset_fn)  # noqa: E731 - TF's tutorial form
    on_workers_sharded = lambda: strategy.experimental_distribute_dataset(data)  # noqa: E731
    for per_worker_dataset in (on_coordinator, on_workers):
        out = drawn(coordinator.create_per_worker_dataset(per_worker_dataset))
        assert all(value // 1000 == worker for worker, value in out), out
    out = drawn(coordinator.create_per_worker_dataset(on_workers_sharded), n=8)
    assert all(value % 2 == worker for worker, value in out), out

    with pytest.raises(RuntimeConfigError, match="'options' has invalid value 'object': must be None"):
        strategy.experimental_distribute_dataset(data, options=object())
    with pytest.raises(RuntimeConfigError, match="'dataset_fn' has invalid value 'int': must be a function"):
        strategy.distribute_datasets_from_function(42)


def test_one_pull_per_ps_per_step(coord):
    strategy, coordinator = coord
    with strategy.scope():
        vs = [Variable(np.full(3, float(i), np.float32), name=f"batch{i}") for i in range(4)]  # 2 per ps
    opt = SGD(learning_rate=1.0)

    def step():
        ctx = current_closure_context()
        first = vs[0].read_value()
        after_first = ctx.pulls
        rest = [v.read_value() for v in vs[1:]]
        after_all = ctx.pulls
        opt.apply_gradients([(np.ones(3, np.float32), v) for v in vs])
        again = [v.read_value() for v in vs]
        return after_first, after_all, ctx.pulls, float(first[0] + sum(r[0] for r in rest)), float(sum(a[0] for a in again))

    after_first, after_all, after_push, total, total_after = coordinator.schedule(step).fetch()
    # one Read per ps for the first reads; the reads after the push pull again, carrying the push (PushRead)
    assert (after_first, after_all, after_push) == (2, 2, 4)
    assert total == 0 + 1 + 2 + 3 and total_after == total - 4


def test_closure_with_strategy_run_and_local_capture(coord):
    strategy, coordinator = coord
    local = Variable(np.arange(3.0))  # outside scope: shipped by value

    def fn():
        return strategy.run(lambda x: x * 2, args=(local.numpy(),))

    np.testing.assert_array_equal(coordinator.schedule(fn).fetch(), [0, 2, 4])


def test_token_refusal_closure_never_runs(shared_cluster, tmp_path):
    marker = tmp_path / "ran"

    def touch():
        marker.write_text("ran")
        return 1

    payload = np.frombuffer(cloudpickle.dumps((touch, (), {})), np.uint8)
    for token in (None, "wrong-token-0123456789abcdef"):
        client = shared_cluster.client("worker", 0, token=token)
        with pytest.raises(UnauthenticatedError, match="UNAUTHENTICATED.*(missing|wrong) job token"):
            client.call("RunClosure", {}, [payload])
        client.close()
    ps = shared_cluster.client("ps", 0, token="nope-nope-nope-nope-nope")
    with pytest.raises(UnauthenticatedError):
        ps.call("ListVariables")
    ps.close()
    assert not marker.exists()
    good = shared_cluster.client("worker", 0)
    meta, arrays = good.call("RunClosure", {}, [payload])
    good.close()
    assert meta["status"] == "ok" and marker.read_text() == "ran"


def test_malformed_rpc_is_invalid_argument_and_server_survives(shared_cluster):
    client = shared_cluster.client("ps", 0)
    method = client._method("Read")
    with pytest.raises(Exception) as info:
        list(method(iter([b"KPS1garbage"]), timeout=5, metadata=client._metadata))
    assert "INVALID_ARGUMENT" in str(info.value.code()) and "header_length" in info.value.details()
    with pytest.raises(RemoteError, match="INVALID_ARGUMENT.*field 'names' has value 'x': input should be a valid list"):
        client.call("Read", {"names": "x"})
    with pytest.raises(RemoteError, match="NOT_FOUND.*no variable named 'nope'"):
        client.call("Read", {"names": ["nope"]})
    with pytest.raises(RemoteError, match="UNIMPLEMENTED"):
        client.call("NoSuchMethod")
    assert client.call("Ping")[0]["job"] == "ps"
    client.close()


def _run_server(env_updates, timeout=30):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEPS_") and k != "TF_CONFIG"}
    env.update(env_updates)
    return subprocess.run([sys.executable, "-m", "kubeps.runtime.server"], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_server_entry_point_refuses_bad_config():
    port = free_ports(1)[0]
    good = {"cluster": {"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1"]}, "task": {"type": "ps", "index": 0}}
    cases = [
        ({"TF_CONFIG": "{not json", "KUBEPS_JOB_TOKEN": TOKEN}, "TF_CONFIG' has invalid value"),
        ({"TF_CONFIG": json.dumps({**good, "task": {"type": "ps", "index": 3}}), "KUBEPS_JOB_TOKEN": TOKEN},
         "field 'task.index' has invalid value 3"),
        ({"TF_CONFIG": json.dumps({**good, "task": {"type": "chief", "index": 0},
                                   "cluster": {**good["cluster"], "chief": ["127.0.0.1:2"]}}),
          "KUBEPS_JOB_TOKEN": TOKEN}, "runs 'ps' and 'worker' tasks"),
        ({"TF_CONFIG": json.dumps(good)}, "refusing to start a kubeps server without a job token"),
        ({"TF_CONFIG": json.dumps(good), "KUBEPS_JOB_TOKEN": "short"}, "at least 16 characters"),
        ({"TF_CONFIG": json.dumps(good), "KUBEPS_JOB_TOKEN_FILE": "/nonexistent/token"},
         "KUBEPS_JOB_TOKEN_FILE' has invalid value '/nonexistent/token'"),
        ({}, "must name a cluster and a task"),
    ]
    for env, message in cases:
        result = _run_server(env)
        assert result.returncode == 2, (env, result.stderr)
        assert message in result.stderr, (message, result.stderr)


def test_server_bad_arguments_and_insecure(tmp_path):
    port = free_ports(1)[0]
    cluster = {"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1"]}
    with pytest.raises(InsecureServerError, match="refusing to start"):
        Server(cluster, "ps", 0, token=None, start=False)
    with pytest.raises(ValueError, match="'job_name' has invalid value 'chief'"):
        Server(cluster, "chief", 0, token=TOKEN)
    with pytest.raises(ValueError, match="'task_index' has invalid value 2.*index must be in 0..0"):
        Server(cluster, "ps", 2, token=TOKEN)
    with pytest.raises(ValueError, match="cluster_spec"):
        Server({"ps": ["nohostport"]}, "ps", 0, token=TOKEN)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    server = Server(cluster, "ps", 0, start=True, bind_host="127.0.0.1",
                    token=__import__("kubeps.runtime.rpc.security", fromlist=["x"]).load_job_token(
                        TaskSettings(job_token_file=str(token_file))))
    try:
        with pytest.raises(OSError, match=f"cannot listen on port {port}"):
            Server(cluster, "ps", 0, token=TOKEN, bind_host="127.0.0.1")
    finally:
        server.stop(grace=None)
    explicit = Server(cluster, "ps", 0, token=None, allow_insecure=True, bind_host="127.0.0.1")
    explicit.stop(grace=None)


def test_killed_worker_closure_reruns_elsewhere_and_worker_comes_back(make_cluster):
    cluster = make_cluster(num_ps=1, num_workers=2)
    strategy = cluster.strategy()
    # the killed worker's call breaks at once; 6 missed pings (3 s) before the untouched ps counts as dead keeps a
    # loaded machine (the other pytest-xdist worker busy) from failing the job on a slow ping
    coordinator = ClusterCoordinator(strategy, heartbeat_interval=0.5, heartbeat_failures=6)
    try:
        dataset = coordinator.create_per_worker_dataset(_counting_dataset)
        iterator = iter(dataset)

        def slow(it, seconds):
            worker, i = next(it)
            time.sleep(seconds)
            return worker, i

        # warm both workers, then give worker 0 a long closure and kill it mid-run
        coordinator.fetch([coordinator.schedule(slow, args=(iterator, 0.0)) for _ in range(4)])
        long_ones = [coordinator.schedule(slow, args=(iterator, 1.5)) for _ in range(2)]
        time.sleep(0.7)
        cluster.kill("worker", 0)
        results = coordinator.fetch(long_ones)
        # one of them was running on worker 0 when it died: it ran again on worker 1 (at-least-once)
        assert [w for w, _ in results] == [1, 1]
        coordinator.join()
        # the worker returns at the same address: it is used again, with its dataset rebuilt from scratch
        cluster.start_task("worker", 0)
        deadline = time.monotonic() + 30
        seen0 = []
        while time.monotonic() < deadline and not seen0:
            out = coordinator.fetch([coordinator.schedule(slow, args=(iterator, 0.05)) for _ in range(6)])
            seen0 = [i for w, i in out if w == 0]
        assert seen0 and min(seen0) == 0  # a fresh iterator on the new process
    finally:
        coordinator.shutdown()
        strategy.close()


def test_killed_ps_raises_ps_unavailable_within_10s(two_ps_job):
    job = two_ps_job(step_sleep=0.05, heartbeat_interval=0.5)
    cluster, coordinator, b, step = job.cluster, job.coordinator, job.b, job.step
    cluster.kill("ps", 1)
    start = time.monotonic()
    with pytest.raises(PSUnavailableError) as info:
        while time.monotonic() - start < 15:
            coordinator.schedule(step)
            time.sleep(0.05)
        coordinator.join()
    assert time.monotonic() - start < 10
    assert info.value.ps_index == 1 and cluster.cluster["ps"][1] in str(info.value)
    with pytest.raises(PSUnavailableError, match="/job:ps/task:1"):
        b.numpy()  # the coordinator's own reads fail fast too


def test_hung_worker_is_detected_by_heartbeat_and_its_closure_reruns(make_cluster):
    import signal

    cluster = make_cluster(num_ps=1, num_workers=2)
    strategy = cluster.strategy()
    # a 2 s silence budget: a smaller one can take a busy (not hung) ps for dead on a loaded machine
    coordinator = ClusterCoordinator(strategy, heartbeat_interval=0.5, heartbeat_failures=4)
    proc = cluster.procs[("worker", 0)]
    try:
        def slow(seconds):
            time.sleep(seconds)
            return get_current_worker_index()

        coordinator.fetch([coordinator.schedule(slow, args=(0.0,)) for _ in range(4)])
        long_ones = [coordinator.schedule(slow, args=(2.0,)) for _ in range(2)]
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGSTOP)  # alive (TCP open) but silent: only the failure detector notices
        start = time.monotonic()
        assert coordinator.fetch(long_ones) == [1, 1]
        assert time.monotonic() - start < 15
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        coordinator.shutdown()
        strategy.close()


def test_hung_ps_is_reported_without_running_functions(make_cluster):
    import signal

    cluster = make_cluster(num_ps=1, num_workers=1)
    strategy = cluster.strategy()
    coordinator = ClusterCoordinator(strategy, heartbeat_interval=0.3)
    proc = cluster.procs[("ps", 0)]
    try:
        assert coordinator.schedule(lambda: 1).fetch() == 1
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(PSUnavailableError, match="/job:ps/task:0"):
            while time.monotonic() - start < 15:
                coordinator.done()
                time.sleep(0.1)
        assert time.monotonic() - start < 10
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        coordinator.shutdown()
        strategy.close()
