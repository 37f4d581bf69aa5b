"""The runtime's Prometheus metrics: what a ps counts per variable, what the RPC client and server record, the hot-ps
rule and the detector on a real cluster (a skewed job is flagged, a balanced one never is), JSON log lines."""

from __future__ import annotations

import io
import json
import logging
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client import REGISTRY

from kubeps.runtime.cluster import MembershipAck
from kubeps.runtime.contract import MEMBERSHIP_ACK_PATH
from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator
from kubeps.runtime.coordinator.hotspots import HotSpotDetector, Imbalance, assess, traffic_of
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.observe import logs
from kubeps.runtime.observe import metrics as m
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.ps.methods import rpc_list_variables
from kubeps.runtime.ps.state import ParameterServerState
from kubeps.runtime.server.metrics import split_shard, state_collector
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.variables.indexed_slices import IndexedSlices
from kubeps.runtime.variables.partitioners import FixedShardsPartitioner
from kubeps.runtime.variables.variable import Variable, embedding_lookup

from ..runtime.conftest import LocalCluster, free_ports

MB = 1 << 20


# -- what a ps counts -------------------------------------------------------------------------------------------------
def test_a_ps_counts_rows_and_bytes_read_and_pushed_per_variable():
    state = ParameterServerState(settings=TaskSettings())
    state.create("emb/part_1", np.zeros((10, 4), np.float32))
    state.read_rows("emb/part_1", np.array([1, 2, 2]))
    state.read("emb/part_1")
    state.push(SGD(learning_rate=0.1).get_config(),
               [("sparse", "emb/part_1", np.array([3, 4]), np.ones((2, 4), np.float32))])
    var = state.variables["emb/part_1"]
    assert (var.rows_read, var.bytes_read) == (3 + 10, (3 + 10) * 16)
    assert (var.rows_pushed, var.bytes_pushed, var.updates) == (2, 32, 1)
    assert var.lock_wait_s >= 0
    answer, _ = rpc_list_variables(state, {}, [])
    (info,) = answer["variables"]
    assert {k: info[k] for k in ("rows_read", "bytes_read", "rows_pushed", "bytes_pushed")} == {
        "rows_read": 13, "bytes_read": 208, "rows_pushed": 2, "bytes_pushed": 32}
    families = {f.name: f for f in state_collector(state)()}
    (sample,) = families["kubeps_ps_variable_read_bytes"].samples
    assert sample.labels == {"variable": "emb", "shard": "1"} and sample.value == 208
    assert families["kubeps_ps_variables"].samples[0].value == 1


@pytest.mark.parametrize("name, split", [("emb/part_3", ("emb", "3")), ("dense/kernel", ("dense/kernel", "0")),
                                         ("a/part_x", ("a/part_x", "0"))])
def test_split_shard(name, split):
    assert split_shard(name) == split


# -- the hot-ps rule ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("after, imbalanced, ratio", [
    ({0: {"e/part_0": 9 * MB}, 1: {"e/part_1": 3 * MB}}, True, 3.0),      # one ps 3x the other
    ({0: {"e/part_0": 4 * MB}, 1: {"e/part_1": 3 * MB}}, False, 4 / 3),   # within 2x
    ({0: {"e/part_0": 2 * MB}, 1: {"e/part_1": 1 * MB}}, False, 2.0),     # exactly 2x is not more than 2x
    ({0: {"e/part_0": 5 * MB}, 1: {"e/part_1": MB}, 2: {"e/part_2": 2 * MB}, 3: {"e/part_3": MB}}, True, 3.75),
])
def test_assess_compares_the_busiest_ps_with_the_others_mean(after, imbalanced, ratio):
    verdict = assess({}, after)
    assert verdict is not None and verdict.imbalanced is imbalanced and verdict.ratio == pytest.approx(ratio)
    assert verdict.ps == 0 and verdict.variable == "e/part_0"
    assert sum(verdict.shares.values()) == pytest.approx(1.0)


def test_assess_counts_the_window_only_and_needs_evidence():
    before = {0: {"a": 100 * MB, "b": 0}, 1: {"c": MB}}
    verdict = assess(before, {0: {"a": 101 * MB, "b": MB}, 1: {"c": 3 * MB}})  # window: ps 0 2 MB, ps 1 2 MB
    assert verdict is not None and not verdict.imbalanced and verdict.ratio == pytest.approx(1.0)
    assert assess(before, {0: {"a": 100 * MB}, 1: {"c": MB + 10}}) is None  # too little traffic to judge
    assert assess({}, {0: {"a": 9 * MB}}) is None  # one ps
    # a variable created again (a new coordinator) or a restarted ps: the window mixes two lives, no verdict
    assert assess({0: {"a": 50 * MB}, 1: {"c": 50 * MB}}, {0: {"a": 9 * MB}, 1: {"c": 51 * MB}}) is None


def test_traffic_of_adds_bytes_read_and_pushed():
    assert traffic_of([{"name": "a", "bytes_read": 3, "bytes_pushed": 4}, {"name": "b"}]) == {"a": 7, "b": 0}


def test_the_detector_refuses_bad_settings():
    with pytest.raises(RuntimeConfigError, match="hotspot_threshold"):
        HotSpotDetector(2, lambda ps: [], threshold=1.0)
    with pytest.raises(RuntimeConfigError, match="hotspot_interval"):
        HotSpotDetector(2, lambda ps: [], interval=0)


def test_the_detector_logs_and_sets_the_metrics_on_every_change(caplog):
    m.enable()
    detector = HotSpotDetector(2, lambda ps: [], threshold=2.0)
    hot = Imbalance(shares={0: 0.8, 1: 0.2}, ratio=4.0, imbalanced=True, ps=0, variable="emb/part_0")
    with caplog.at_level(logging.INFO, logger="kubeps.runtime.coordinator.hotspots"):
        detector.observe(hot)
        detector.observe(hot)  # no second warning
        assert REGISTRY.get_sample_value("kubeps_ps_imbalanced", {"ps": "0", "variable": "emb/part_0"}) == 1
        assert REGISTRY.get_sample_value("kubeps_ps_traffic_share", {"ps": "0"}) == 0.8
        detector.observe(Imbalance(shares={0: 0.5, 1: 0.5}, ratio=1.0, imbalanced=False, ps=0, variable="emb/part_0"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ps 0 serves 4.0x" in warnings[0] and "'emb/part_0'" in warnings[0]
    assert REGISTRY.get_sample_value("kubeps_ps_imbalanced", {"ps": "0", "variable": "emb/part_0"}) is None
    assert REGISTRY.get_sample_value("kubeps_ps_imbalance_ratio") == 1.0


# -- the detector on a real job ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = LocalCluster(2, 2, tmp_path_factory.mktemp("hotspots"))
    try:
        yield local.start()
    finally:
        local.stop()


def _train(cluster, ids_fn, seconds: float) -> list[Imbalance]:
    """Train a 2-shard embedding on ids from ``ids_fn(rng)`` for ``seconds``; the detector's verdicts (1 s windows)."""
    strategy = cluster.strategy(variable_partitioner=FixedShardsPartitioner(2))
    verdicts: list[Imbalance] = []
    coordinator = ClusterCoordinator(strategy, hotspot_interval=1.0)
    coordinator.hotspots.on_verdict = verdicts.append
    try:
        with strategy.scope():
            emb = Variable(np.zeros((4096, 64), np.float32), name="emb")
        opt = SGD(learning_rate=0.1)

        def step(seed):
            ids = ids_fn(np.random.default_rng(seed))
            rows = embedding_lookup(emb, ids)
            opt.apply_gradients([(IndexedSlices(np.ones_like(rows), ids), emb)])
            return 0

        deadline, seed = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            for _ in range(8):
                coordinator.schedule(step, args=(seed,))
                seed += 1
            coordinator.join()
    finally:
        coordinator.shutdown()
        strategy.close()
    return verdicts


@pytest.mark.timeout(120)
def test_a_skewed_job_is_flagged_within_60_s_naming_the_hot_shard(cluster):
    # popular ids are small ids: 90% of the lookups fall in the first shard's rows (range shards)
    def skewed(rng):
        return np.unique(np.where(rng.random(2048) < 0.9, rng.integers(0, 2048, 2048), rng.integers(0, 4096, 2048)))

    started = time.monotonic()
    verdicts = _train(cluster, skewed, seconds=6)
    flagged = [v for v in verdicts if v.imbalanced]
    assert flagged, verdicts
    assert flagged[0].ps == 0 and flagged[0].variable == "emb/part_0" and flagged[0].ratio > 2
    assert time.monotonic() - started < 60


@pytest.mark.timeout(120)
def test_a_balanced_job_is_never_flagged(cluster):
    verdicts = _train(cluster, lambda rng: np.unique(rng.integers(0, 4096, 2048)), seconds=6)
    assert verdicts and not any(v.imbalanced for v in verdicts), verdicts
    assert all(abs(share - 0.5) < 0.1 for v in verdicts for share in v.shares.values())


# -- JSON logs ----------------------------------------------------------------------------------------------------------
def test_json_log_lines_carry_the_job_role_index_and_step():
    tf_config = json.dumps({"cluster": {"ps": ["ctr-ps-0.team.svc:2222", "ctr-ps-1.team.svc:2222"]},
                            "task": {"type": "ps", "index": 1}})
    settings = TaskSettings(tf_config=tf_config, log_format="json")
    assert logs.identity_of(settings) == {"job": "ctr", "role": "ps", "index": 1}
    local = TaskSettings(tf_config=json.dumps({"cluster": {"worker": ["127.0.0.1:5000"]},
                                               "task": {"type": "worker", "index": 0}}))
    assert logs.identity_of(local) == {"job": "local", "role": "worker", "index": 0}
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter(logs.identity_of(settings)))
    logger = logging.getLogger("kubeps.test.json")
    logger.addHandler(handler)
    try:
        logs.set_step(120)
        logger.warning("hot %s", "ps")
    finally:
        logger.removeHandler(handler)
    line = json.loads(stream.getvalue())
    assert {k: line[k] for k in ("level", "logger", "message", "job", "role", "index", "step")} == {
        "level": "WARNING", "logger": "kubeps.test.json", "message": "hot ps", "job": "ctr", "role": "ps",
        "index": 1, "step": 120}
    assert line["time"].endswith("Z")


# -- the chief's membership acknowledgement over HTTP --------------------------------------------------------------------
def _get(port: int, path: str) -> tuple[int, str, str]:
    """``(status, content type, body)`` of ``GET path`` on the metrics port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def test_the_chief_serves_its_membership_ack_beside_its_metrics(tmp_path):
    """The operator acts on the typed acknowledgement, parsed with the model the chief renders it with; the
    gauges stay on ``/metrics`` for dashboards; once the chief is gone the path answers 404."""
    local = LocalCluster(1, 2, tmp_path).start()
    settings = TaskSettings(metrics_port=free_ports(1)[0], bind_host="127.0.0.1")
    strategy = local.strategy(settings=settings)
    coordinator = ClusterCoordinator(strategy)
    try:
        port = m.served_port()
        assert port is not None
        status, kind, body = _get(port, MEMBERSHIP_ACK_PATH)
        assert (status, kind) == (200, "application/json")
        assert MembershipAck.model_validate_json(body) == coordinator.membership_status()
        assert MembershipAck.model_validate_json(body).workers == [0, 1]
        coordinator.apply_membership(local.cluster["worker"][:1])
        deadline = time.monotonic() + 30
        while (ack := MembershipAck.model_validate_json(_get(port, MEMBERSHIP_ACK_PATH)[2])).drained != [1]:
            assert time.monotonic() < deadline, ack
            time.sleep(0.05)
        assert (ack.generation, ack.workers, ack.draining) == (1, [0], [])
        status, _, text = _get(port, "/metrics")
        assert status == 200
        assert "kubeps_membership_generation 1.0" in text and "kubeps_workers_draining 0.0" in text
    finally:
        coordinator.shutdown()
        strategy.close()
        local.stop()
    assert _get(port, MEMBERSHIP_ACK_PATH)[0] == 404
    assert _get(port, "/metrics")[0] == 200
