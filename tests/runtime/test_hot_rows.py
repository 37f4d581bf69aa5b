"""The worker-side cache of hot rows (``nn.Embedding(hot_rows=..., hot_refresh_steps=...)``), on real ps and worker
processes: cached rows are exactly as stale as the bound says and no more, the other rows are fresh, fewer rows are
pulled, every push still lands on the parameter servers, and the cache outlives a scheduled function."""

from __future__ import annotations

import numpy as np
import pytest

from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.ops import nn
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.variables import hot_rows
from kubeps.runtime.variables.partitioners import FixedShardsPartitioner
from kubeps.runtime.variables.variable import Variable

ROWS, DIM, REFRESH = 70_000, 4, 3  # a table above the closure's whole-variable pull (1 MB): rows are looked up
HOT_A, HOT_B, COLD = 1, ROWS - 1, 5  # a hot row on each ps (looked up 3 and 2 times a step), a cold one on ps 0
BATCH = np.array([[HOT_A, HOT_A, HOT_A, HOT_B, HOT_B, COLD]])


def test_cached_rows_are_at_most_the_bound_stale_and_every_push_lands(make_cluster):
    cluster = make_cluster(num_ps=2, num_workers=1)
    strategy = cluster.strategy(variable_partitioner=FixedShardsPartitioner(2))
    coordinator = ClusterCoordinator(strategy)
    try:
        with strategy.scope():
            table = Variable(np.zeros((ROWS, DIM), np.float32), name="table")
        emb = nn.Embedding(ROWS, DIM, embeddings=table, hot_rows=2, hot_refresh_steps=REFRESH)
        opt = SGD(learning_rate=1.0)

        def train(steps):
            seen = []
            for _ in range(steps):
                rows = emb.forward(BATCH)
                seen.append([float(rows[0, i, 0]) for i in (0, 3, 5)])  # HOT_A, HOT_B, COLD
                emb.backward(np.ones_like(rows))  # each step: HOT_A -= 3, HOT_B -= 2, COLD -= 1
                opt.apply_gradients(emb.grads_and_vars())
            return seen, emb.rows_pulled

        seen, pulled = coordinator.schedule(train, args=(7,)).fetch()
        later, pulled_later = coordinator.schedule(train, args=(2,)).fetch()  # a new function, the same cache
        table_now = table.numpy()
    finally:
        coordinator.shutdown()
        strategy.close()
    for k, (a, b, cold) in enumerate(seen + later):
        pulled_at = REFRESH * (k // REFRESH)  # the hot rows as they were at the last refresh
        assert (a, b, cold) == (-3.0 * pulled_at, -2.0 * pulled_at, -1.0 * k), k
    # a refresh pulls the 3 rows (the 2 hot ones with the batch's); between refreshes only the cold one
    assert pulled == 3 + 1 + 1 + 3 + 1 + 1 + 3 and pulled_later == 1 + 1
    assert table_now[HOT_A, 0] == -3.0 * 9 and table_now[HOT_B, 0] == -2.0 * 9 and table_now[COLD, 0] == -9.0


def test_a_table_in_this_process_is_not_cached_and_looks_up_as_without():
    local = Variable(np.arange(20, dtype=np.float32).reshape(10, 2))
    assert hot_rows.cache_for(local, 4, 2) is None
    emb = nn.Embedding(10, 2, embeddings=local, hot_rows=4, hot_refresh_steps=2)
    np.testing.assert_array_equal(emb.forward(np.array([[3, 3, 7]])), local.numpy()[[[3, 3, 7]]])


@pytest.mark.parametrize(("field", "value", "allowed"), [("hot_rows", -1, ">= 0"), ("hot_refresh_steps", 0, ">= 1"),
                                                          ("hot_rows", 2.5, "integer")])
def test_bad_options_are_refused_with_the_field_and_the_value(field, value, allowed):
    with pytest.raises(RuntimeConfigError) as err:
        nn.Embedding(10, 2, **{field: value})
    assert field in str(err.value) and str(value) in str(err.value) and allowed in str(err.value)
