"""Dynamic embedding tables against in-process parameter servers: rows on first use, sharding by hash, the same
optimizer math as fixed tables, the one-round-trip step, admission, eviction, refusals that change nothing, and
memory that stays bounded under an unbounded id stream."""

from __future__ import annotations

import numpy as np
import pytest

import kubeps.runtime as kp
from kubeps.runtime.cluster import TFConfig, TFConfigClusterResolver
from kubeps.runtime.coordinator.strategy import ParameterServerStrategy
from kubeps.runtime.errors import RemoteError, RuntimeConfigError
from kubeps.runtime.rpc.protocol import PS
from kubeps.runtime.util.key_index import KeyIndex, RowIndex
from kubeps.runtime.util.keyhash import shard_of
from kubeps.runtime.variables import context as _context
from kubeps.runtime.variables.indexed_slices import IndexedSlices

from .conftest import TOKEN
from . import test_variables as _fixed

servers = _fixed.servers  # the two in-process parameter servers of the fixed-table tests (a module fixture)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def strategy(servers):
    cluster, _ = servers
    resolver = TFConfigClusterResolver(tf_config=TFConfig.for_task(cluster, "chief", 0))
    s = ParameterServerStrategy(resolver, job_token=TOKEN)
    yield s
    s.close()


def _table(strategy, **kwargs):
    with strategy.scope():
        return kp.DynamicEmbedding("dyn", **{"dim": 4, **kwargs})


@pytest.mark.parametrize("kind", ["keys", "rows"])
def test_key_index_matches_a_dict_under_inserts_and_removals(kind):
    rng = np.random.default_rng(1)
    store = np.zeros(30 * 1000, dtype=np.int64)  # RowIndex: the owner's keys, by row
    index, truth = (KeyIndex() if kind == "keys" else RowIndex(store)), {}
    for step in range(30):
        fresh = np.setdiff1d(np.unique(rng.integers(-2**62, 2**62, 500)), np.fromiter(truth, np.int64))
        rows = np.arange(step * 1000, step * 1000 + fresh.size)
        store[rows] = fresh
        index.insert(fresh, rows)
        truth.update(zip(fresh.tolist(), rows.tolist()))
        gone = np.array(list(truth)[::3], dtype=np.int64)
        index.remove(gone)
        for k in gone.tolist():
            del truth[k]
    keys = np.fromiter(truth, np.int64)
    assert len(index) == len(truth)
    assert index.lookup(keys).tolist() == [truth[k] for k in keys.tolist()]
    assert (index.lookup(np.array([2**63 - 1, -2**63])) == -1).all()


def test_sequential_ids_spread_evenly_over_the_ps():
    counts = np.bincount(shard_of(np.arange(0, 200_000, 2, dtype=np.int64), 3), minlength=3)
    assert counts.min() > 0.97 * counts.max()  # `key mod 2` would put every one of them on one ps


def test_rows_are_created_on_first_use_and_sharded_by_hash(strategy):
    table = _table(strategy, initializer={"kind": "normal", "stddev": 0.1, "seed": 7})
    ids = np.array([[2**40 + 3, 17], [17, 2**39]], dtype=np.int64)
    assert table.size() == 0
    rows = table.lookup(ids, train=True)
    assert rows.shape == (2, 2, 4) and table.size() == 3
    np.testing.assert_array_equal(rows[0, 1], rows[1, 0])
    local = kp.DynamicEmbedding("same", 4, initializer={"kind": "normal", "stddev": 0.1, "seed": 7})
    np.testing.assert_allclose(local.lookup(ids), rows)  # a row's first values depend on its key only
    sizes = [info["size"] for info in table.shard_info()]
    expect = np.bincount(shard_of(np.unique(ids), 2), minlength=2).tolist()
    assert sizes == expect
    assert table.lookup(np.array([99]), train=False).tolist() == [[0.0] * 4] and table.size() == 3


@pytest.mark.parametrize("opt", [kp.SGD(0.1), kp.Adagrad(0.1), kp.Adam(0.01), kp.Ftrl(0.1)],
                         ids=lambda o: type(o).__name__)
def test_updates_use_the_fixed_tables_sparse_math(strategy, opt):
    table = _table(strategy, initializer={"kind": "uniform", "seed": 3})
    keys = np.array([5, 2**41, 9, 5], dtype=np.int64)
    start = table.lookup(keys, train=True)
    uniq, first = np.unique(keys, return_index=True)
    fixed = kp.Variable(start[first].copy())  # a local fixed table holding the same rows
    rng = np.random.default_rng(0)
    for _ in range(3):
        grad = rng.normal(size=(4, 4)).astype(np.float32)
        opt.apply_gradients([(IndexedSlices(grad, keys), table)])
        opt.apply_gradients([(IndexedSlices(grad, np.searchsorted(uniq, keys)), fixed)])
    np.testing.assert_allclose(table.lookup(uniq, train=False), fixed.numpy(), rtol=1e-5, atol=1e-6)


def test_a_step_costs_one_round_trip_per_ps(strategy):
    table = _table(strategy)
    with strategy.scope():
        dense = kp.Variable(np.zeros(3, np.float32), name="w")
    sent = []
    transport = strategy.transport
    real = transport.call_many

    def spy(requests, timeout=None):
        sent.extend(method for method, _, _ in requests.values())
        return real(requests, timeout)

    transport.call_many = spy
    ctx = _context.ClosureContext(0, transport, {})
    previous = _context.set_closure_context(ctx)
    try:
        ctx.register(dense)
        layer = kp.nn.DynamicEmbeddingLayer(table)
        ids = np.arange(64, dtype=np.int64) * 2**30
        for _ in range(3):
            out = layer.forward(ids)
            dense.read_value()
            layer.backward(np.ones_like(out))
            kp.SGD(0.1).apply_gradients(layer.grads_and_vars() + [(np.ones(3, np.float32), dense)])
        ctx.flush()
    finally:
        _context.set_closure_context(previous)
        transport.call_many = real
    # step 1: one lookup per ps (carrying the dense pull); steps 2, 3: the same, carrying the last push; then a flush
    assert sent.count(PS.LOOKUP_DYNAMIC) == 2 and sent.count(PS.PUSH_LOOKUP_DYNAMIC) == 4
    assert sent.count(PS.PUSH) == 2 and len(sent) == 8
    assert table.size() == 64 and dense.numpy().tolist() == pytest.approx([-0.3] * 3)


def test_admission_by_count_reads_the_default_and_takes_no_gradient(strategy):
    table = _table(strategy, filter_freq=3, default_value=0.5)
    key = np.array([123456789012], dtype=np.int64)
    for seen in (1, 2):
        assert table.lookup(key, train=True).tolist() == [[0.5] * 4], seen
        kp.SGD(1.0).apply_gradients([(IndexedSlices(np.ones((1, 4), np.float32), key), table)])
        assert table.size() == 0
    row = table.lookup(key, train=True)  # third sighting: admitted
    assert table.size() == 1 and row.tolist() != [[0.5] * 4]
    kp.SGD(1.0).apply_gradients([(IndexedSlices(np.ones((1, 4), np.float32), key), table)])
    np.testing.assert_allclose(table.lookup(key, train=False), row - 1.0)
    keys, values, freqs, steps = table.export(with_metadata=True)
    assert keys.tolist() == key.tolist() and freqs.tolist() == [3]


def test_counting_bloom_filter_admits_after_the_threshold(strategy):
    table = _table(strategy, filter_freq=2, bloom_counters=4096)
    keys = np.arange(100, dtype=np.int64) * 7919
    table.lookup(keys, train=True)
    assert table.size() == 0
    table.lookup(keys, train=True)
    assert table.size() == 100


def test_eviction_by_steps_to_live(strategy):
    table = _table(strategy, steps_to_live=5, sweep_every=1)
    old, new = np.arange(10, dtype=np.int64), np.arange(10, 20, dtype=np.int64) + 2**50
    table.lookup(np.concatenate([old, new]), train=True)
    grad = np.ones((10, 4), np.float32)
    for _ in range(12):  # only `new` is trained: `old` goes once it was not updated for 5 updates of its shard
        table.lookup(new, train=True)
        kp.SGD(0.01).apply_gradients([(IndexedSlices(grad, new), table)])
    keys = table.export()[0]
    assert sorted(keys.tolist()) == new.tolist()
    assert sum(i["evicted"] for i in table.shard_info()) == 10


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_capacity_evicts_least_recently_or_least_often_used(strategy, policy):
    table = _table(strategy, capacity=8, evict_policy=policy)
    keys = np.array([k for k in range(400) if shard_of(np.array([k]), 2)[0] == 0][:12], dtype=np.int64)
    hot, cold, late = keys[:4], keys[4:8], keys[8:]
    table.lookup(np.concatenate([hot, cold]), train=True)
    for _ in range(3):
        table.lookup(hot, train=True)
        kp.SGD(0.1).apply_gradients([(IndexedSlices(np.ones((4, 4), np.float32), hot), table)])
    table.lookup(late, train=True)  # four more on a full shard: the cold four go
    assert sorted(table.export()[0].tolist()) == sorted(np.concatenate([hot, late]).tolist())


def test_a_refused_call_changes_nothing(strategy):
    table = _table(strategy, filter_freq=2)
    keys = np.arange(8, dtype=np.int64)
    table.lookup(keys, train=True)
    table.lookup(keys, train=True)
    before = table.export(with_metadata=True)
    client = strategy.transport
    ps = int(shard_of(keys[:1], 2)[0])
    mine = keys[shard_of(keys, 2) == ps]
    bad = [
        # a variable that does not exist, beside a good table update and a training lookup
        ({"optimizer": kp.SGD(0.1).get_config(), "updates": [{"name": table.key, "kind": "dynamic"},
                                                             {"name": "nope", "kind": "dense"}],
          "names": [], "rows": [], "dynamic": [{"name": table.key, "train": True}]},
         [mine, np.ones((mine.size, 4), np.float32), np.zeros(1, np.float32), mine, np.ones(mine.size, np.int64)]),
        # a gradient of the wrong width
        ({"optimizer": kp.SGD(0.1).get_config(), "updates": [{"name": table.key, "kind": "dynamic"}],
          "names": [], "rows": [], "dynamic": [{"name": table.key, "train": True}]},
         [mine, np.ones((mine.size, 3), np.float32), mine, np.ones(mine.size, np.int64)]),
        # keys repeated in a lookup
        ({"names": [], "rows": [], "dynamic": [{"name": table.key, "train": True}]},
         [np.array([1, 1], np.int64), np.ones(2, np.int64)]),
        # a NaN gradient
        ({"optimizer": kp.SGD(0.1).get_config(), "updates": [{"name": table.key, "kind": "dynamic"}]},
         [mine, np.full((mine.size, 4), np.nan, np.float32)]),
    ]
    for meta, arrays in bad:
        method = PS.PUSH_LOOKUP_DYNAMIC if "updates" in meta and "dynamic" in meta else (
            PS.PUSH if "updates" in meta else PS.LOOKUP_DYNAMIC)
        with pytest.raises(RemoteError):
            client.call(ps, method, meta, arrays)
    after = table.export(with_metadata=True)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_string_keys_are_hashed(strategy):
    table = _table(strategy, key_dtype="string")
    rows = table.lookup(np.array(["user:1", "user:2", "user:1"]), train=True)
    assert table.size() == 2
    np.testing.assert_array_equal(rows[0], rows[2])
    with pytest.raises(RuntimeConfigError, match="key_dtype 'int64'"):
        _table(strategy).lookup(np.array(["x"]))


def test_bad_settings_are_refused_naming_the_field(strategy):
    with pytest.raises(RuntimeConfigError, match="filter_freq=0"):
        _table(strategy, filter_freq=0)
    with pytest.raises(RuntimeConfigError, match="field 'evict_policy' has value 'fifo': input should be 'lru' or 'lfu'"):
        _table(strategy, evict_policy="fifo")
    with pytest.raises(RuntimeConfigError, match="initializer"):
        _table(strategy, initializer={"kind": "normal", "stdev": 1})


def test_memory_stays_bounded_under_an_unbounded_id_stream(strategy):
    """10x capacity distinct ids (from a 2**40 space) through training lookups and pushes: row counts never pass
    the capacity, and the bytes a shard holds stay within 10% of the figure at capacity."""
    capacity = 2000
    table = _table(strategy, dim=8, capacity=capacity)
    rng = np.random.default_rng(0)
    opt = kp.Adagrad(0.05)
    at_capacity = None
    for step in range(40):
        ids = rng.integers(0, 2**40, 1000, dtype=np.int64)  # 40k distinct ids over 2 shards: 10x the capacity
        table.lookup(ids, train=True)
        opt.apply_gradients([(IndexedSlices(np.ones((ids.size, 8), np.float32), ids), table)])
        info = table.shard_info()
        assert all(i["size"] <= capacity for i in info)
        if at_capacity is None and all(i["size"] == capacity for i in info):
            at_capacity = [i["nbytes"] for i in info]
    assert at_capacity is not None
    final = table.shard_info()
    assert sum(i["evicted"] for i in final) > 30_000
    for first, now in zip(at_capacity, (i["nbytes"] for i in final)):
        assert now <= 1.1 * first, (first, now)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_index_follows_rows_moved_by_eviction(policy):
    """The index holds only rows and reads keys from the table's ``keys``: after evictions moved rows into the
    holes, every live key still finds its own row and no evicted key finds one."""
    table = kp.DynamicEmbedding("moving", dim=2, capacity=300, evict_policy=policy, steps_to_live=40, sweep_every=7)
    local = table.local_table
    opt = kp.SGD(0.1)
    rng = np.random.default_rng(5)
    seen: set[int] = set()
    for step in range(60):
        keys = np.unique(rng.integers(0, 3000, 64))
        seen.update(keys.tolist())
        table.lookup(keys)
        table.apply_local_update(opt, IndexedSlices(np.ones((keys.size, 2), np.float32), keys))
        live = local.keys[: local.size]
        assert (local.index.lookup(live) == np.arange(local.size)).all(), step
    gone = np.array(sorted(seen - set(local.keys[: local.size].tolist())), dtype=np.int64)
    assert gone.size and (local.index.lookup(gone) == -1).all()
    assert local.evicted > 0 and local.freqs.dtype == np.int32
