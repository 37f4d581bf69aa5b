"""Variables, sharding, placement and embedding lookups against in-process parameter servers."""

from __future__ import annotations

import numpy as np
import pytest

from kubeps.runtime.cluster import TFConfig, TFConfigClusterResolver
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.variables.partitioners import FixedShardsPartitioner, MinSizePartitioner
from kubeps.runtime.server import Server
from kubeps.runtime.coordinator.strategy import ParameterServerStrategy
from kubeps.runtime.variables.variable import ShardedVariable, Variable, embedding_lookup

from .conftest import TOKEN, free_ports

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def servers():
    ports = free_ports(4)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{p}" for p in ports[1:3]],
               "worker": [f"127.0.0.1:{ports[3]}"]}
    ps = [Server(cluster, "ps", i, token=TOKEN, bind_host="127.0.0.1") for i in range(2)]
    yield cluster, ps
    for s in ps:
        s.stop(grace=None)


def _strategy(cluster, partitioner=None):
    resolver = TFConfigClusterResolver(tf_config=TFConfig.for_task(cluster, "chief", 0))
    return ParameterServerStrategy(resolver, variable_partitioner=partitioner, job_token=TOKEN)


def test_server_api(servers):
    cluster, ps = servers
    assert ps[1].target == f"grpc://{cluster['ps'][1]}"
    assert ps[0].job_name == "ps" and ps[0].task_index == 0


def test_round_robin_placement_and_unique_names(servers):
    cluster, ps = servers
    strategy = _strategy(cluster)
    with strategy.scope():
        vs = [Variable(np.full(2, i, np.float32), name="x") for i in range(5)]
    assert [v.name for v in vs] == ["x", "x_1", "x_2", "x_3", "x_4"]
    assert [v.device for v in vs] == [f"/job:ps/replica:0/task:{i % 2}/device:CPU:0" for i in range(5)]
    assert all(v.name in ps[i % 2].state.variables for i, v in enumerate(vs))
    np.testing.assert_array_equal(vs[3].numpy(), [3, 3])
    assert strategy.num_ps == 2 and strategy.num_workers == 1


def test_div_split_13_rows_over_5_shards(servers):
    cluster, ps = servers
    strategy = _strategy(cluster, FixedShardsPartitioner(5))
    full = np.arange(13 * 3, dtype=np.float32).reshape(13, 3)
    with strategy.scope():
        emb = Variable(full, name="emb13")
    assert isinstance(emb, ShardedVariable) and emb.shape == (13, 3) and emb.num_shards == 5
    assert [v.shape[0] for v in emb.variables] == [3, 3, 3, 2, 2]
    assert emb.shard_rows() == [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]
    assert [v.name for v in emb.variables] == [f"emb13/part_{i}" for i in range(5)]
    assert [v.device.split("/")[3] for v in emb.variables] == ["task:0", "task:1", "task:0", "task:1", "task:0"]
    np.testing.assert_array_equal(ps[1].state.read("emb13/part_3"), full[9:11])
    np.testing.assert_array_equal(np.asarray(emb), full)
    np.testing.assert_array_equal(emb.numpy(), full)
    emb.assign_add(np.ones_like(full))
    np.testing.assert_array_equal(emb.read_value(), full + 1)


def test_embedding_lookup_owner_arithmetic_and_dedup(servers, monkeypatch):
    cluster, ps = servers
    strategy = _strategy(cluster, FixedShardsPartitioner(5))
    full = np.arange(13 * 2, dtype=np.float64).reshape(13, 2)
    with strategy.scope():
        emb = Variable(full, name="lookup")
    requested = []
    for server in ps:
        original = server.state.read_rows
        monkeypatch.setattr(server.state, "read_rows",
                            lambda name, idx, _o=original: (requested.append((name, list(idx))), _o(name, idx))[1])
    ids = np.array([[12, 0, 3], [3, 9, 12]])
    out = embedding_lookup(emb, ids)
    np.testing.assert_array_equal(out, full[ids])
    assert out.shape == (2, 3, 2)
    # rows deduplicated and asked from their owners, in shard-local ids: 0 -> part_0, 3 -> part_1[0],
    # 9 -> part_3[0], 12 -> part_4[1]; part_2 untouched
    assert sorted(requested) == [("lookup/part_0", [0]), ("lookup/part_1", [0]), ("lookup/part_3", [0]),
                                 ("lookup/part_4", [1])]
    # every row of the table
    np.testing.assert_array_equal(embedding_lookup(emb, np.arange(13)), full)
    with pytest.raises(RuntimeConfigError, match="ids must be in \\[0, 13\\)"):
        embedding_lookup(emb, [13])


def test_an_explicit_name_never_reuses_a_generated_one(servers):
    """``Variable(name="dup")`` twice makes "dup" and "dup_1"; a third variable named "dup_1" explicitly used to get
    the key "dup_1" again, and its CreateVariables replaced the second variable's shards on the ps."""
    cluster, ps = servers
    strategy = _strategy(cluster, FixedShardsPartitioner(2))
    with strategy.scope():
        first = Variable(np.zeros(2, np.float32), name="dup")
        second = Variable(np.ones(2, np.float32), name="dup")                # "dup_1"
        Variable(np.zeros(1, np.float32), name="filler")
        third = Variable(np.full(5, 7.0, np.float32), name="dup_1")          # must not be "dup_1" again
        table = Variable(np.zeros((4, 2), np.float32), name="tab")          # shards tab/part_0, tab/part_1
        clash = Variable(np.full(3, 9.0, np.float32), name="tab/part_1")   # must not replace a shard
    keys = [k for v in (first, second, third, table, clash)
            for k in [v.name] + ([s.name for s in v.variables] if isinstance(v, ShardedVariable) else [])]
    assert len(set(keys)) == len(keys), keys
    assert second.name == "dup_1" and third.name != "dup_1"
    np.testing.assert_array_equal(second.numpy(), [1, 1])
    np.testing.assert_array_equal(third.numpy(), [7] * 5)
    np.testing.assert_array_equal(table.numpy(), np.zeros((4, 2)))
    np.testing.assert_array_equal(clash.numpy(), [9] * 3)


def test_partitioner_edge_cases(servers):
    cluster, _ = servers
    strategy = _strategy(cluster, MinSizePartitioner(min_shard_bytes=8, max_shards=3))
    with strategy.scope():
        scalar = Variable(3.0, name="scalar")
        one_row = Variable(np.zeros((1, 4)), name="one_row")
        split = Variable(np.zeros((7, 4)), name="split")
    assert isinstance(scalar, Variable) and isinstance(one_row, Variable)
    assert isinstance(split, ShardedVariable) and split.num_shards == 3
    assert float(scalar.numpy()) == 3.0


def test_local_variables_outside_scope():
    v = Variable(np.arange(3.0), name="local")
    assert not v.is_remote and v.device == ""
    v.assign_add([1, 1, 1])
    v.assign_sub(np.ones(3))
    np.testing.assert_array_equal(np.asarray(v), [0, 1, 2])
    np.testing.assert_array_equal(v * 2 + 1, [1, 3, 5])
    np.testing.assert_array_equal(np.ones(3) @ v, 3.0)
    np.testing.assert_array_equal(embedding_lookup(v, [2, 2]), [2, 2])
    c = Variable(lambda: np.zeros(2), dtype="float32")
    assert c.dtype == np.float32 and c.name == "Variable"


def test_bad_arguments_name_field():
    with pytest.raises(RuntimeConfigError, match="'initial_value' has invalid value None"):
        Variable(None)
    with pytest.raises(RuntimeConfigError, match="'dtype' has invalid value 'nope'"):
        Variable(1.0, dtype="nope")
    with pytest.raises(RuntimeConfigError, match="'name'"):
        Variable(1.0, name="a:b")
    v = Variable(np.zeros(2))
    with pytest.raises(RuntimeConfigError, match="has shape \\[2\\]"):
        v.assign(np.zeros(3))


def test_strategy_needs_ps_and_worker():
    resolver = TFConfigClusterResolver(tf_config={"cluster": {"chief": ["127.0.0.1:2"], "worker": ["127.0.0.1:1"]},
                                                  "task": {"type": "chief", "index": 0}})
    with pytest.raises(RuntimeConfigError, match=r"TF_CONFIG.cluster.*\{'chief': 1, 'worker': 1\}.*missing \['ps'\]"):
        ParameterServerStrategy(resolver)
    with pytest.raises(RuntimeConfigError, match="cluster_resolver"):
        ParameterServerStrategy(None)
    with pytest.raises(RuntimeConfigError, match="variable_partitioner"):
        ParameterServerStrategy(resolver, variable_partitioner=3)


def test_scope_nesting_is_checked(servers):
    from kubeps.runtime.variables import context

    cluster, _ = servers
    a, b = _strategy(cluster), _strategy(cluster)
    context.push_strategy(a)
    try:
        with b.scope():
            assert context.current_strategy() is b
            with pytest.raises(RuntimeError, match="reverse order"):
                context.pop_strategy(a)
        assert context.current_strategy() is a
    finally:
        context.pop_strategy(a)
    assert context.current_strategy() is None


@pytest.mark.parametrize("value, what", [(np.array(["a", "b"]), r"'<U1' \(strings\)"),
                                         (np.array([{"x": 1}], dtype=object), r"'\|O' \(Python objects\)"),
                                         (["a", "b"], r"'<U1' \(strings\)")])
def test_string_and_object_values_are_refused_naming_the_dtype(value, what):
    """A string variable failed deep in the transport (WireError ... '<U1'), an object array with
    "invalid value 'ndarray'"."""
    resolver = TFConfigClusterResolver(tf_config={"cluster": {"chief": ["127.0.0.1:3"], "ps": ["127.0.0.1:1"],
                                                              "worker": ["127.0.0.1:2"]},
                                                  "task": {"type": "chief", "index": 0}})
    strategy = ParameterServerStrategy(resolver, job_token="t" * 32, ps_startup_timeout=0.1)
    allowed = r"a variable holds bool, integer, float or complex numbers"
    with pytest.raises(RuntimeConfigError, match=rf"'initial_value' has invalid value \"array of dtype {what}\": {allowed}"):
        with strategy.scope():
            Variable(value)
    with pytest.raises(RuntimeConfigError, match=allowed):
        Variable(value)  # a local variable too
    strategy.close()


def test_no_silent_casts_into_a_variable():
    from kubeps.runtime.ops.optimizers import SGD
    from kubeps.runtime.variables.push import IndexedSlices

    v = Variable(np.zeros(3, np.float32), name="w")
    opt = SGD(0.1)
    for grad in (np.ones(3, np.float64), np.ones(3, np.int64)):
        with pytest.raises(RuntimeConfigError, match=rf"'gradient of 'w'' has invalid value 'array of dtype "
                                                     rf"{grad.dtype}': must have variable 'w''s dtype float32"):
            opt.apply_gradients([(grad, v)])
    with pytest.raises(RuntimeConfigError, match="IndexedSlices values.*array of dtype float64"):
        opt.apply_gradients([(IndexedSlices(np.ones((1,), np.float64), np.array([0])), v)])
    with pytest.raises(RuntimeConfigError, match=r"'value' has invalid value 'array of dtype int64': must have "
                                                 r"variable 'w''s dtype float32"):
        v.assign(np.arange(3, dtype=np.int64))
    with pytest.raises(RuntimeConfigError, match="dtype float32"):
        v.assign_sub(np.ones(3, np.float64))
    np.testing.assert_array_equal(v.numpy(), 0)  # nothing was applied
    v.assign([1, 2, 3])  # Python numbers take the variable's dtype, as TF converts them
    v.assign_add([1, 1, 1])
    opt.apply_gradients([(np.ones(3, np.float32), v)])
    np.testing.assert_allclose(v.numpy(), [1.9, 2.9, 3.9], rtol=1e-6)
    counts = Variable(np.zeros(2, np.int64))
    with pytest.raises(RuntimeConfigError, match="without changing its kind"):
        counts.assign_add([0.5, 0.5])


def test_rows_of_a_shard_land_at_their_positions_consecutive_or_not():
    from kubeps.runtime.variables.variable import _set_positions  # noqa: PLC0415

    for positions in (np.arange(3, 9), np.array([0, 2, 3, 7]), np.array([], dtype=np.int64)):
        rows = np.zeros((10, 4), np.float32)
        block = np.arange(positions.size * 4, dtype=np.float32).reshape(-1, 4) + 1
        _set_positions(rows, positions, block)
        want = np.zeros((10, 4), np.float32)
        want[positions] = block
        np.testing.assert_array_equal(rows, want)
