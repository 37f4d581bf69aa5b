"""The pipelined lookup (``Embedding.prefetch`` / ``variables.start_lookup``): on real ps and worker processes, a
step that prefetched the next batch's rows computes on values exactly one step stale for this worker's own pushes,
still makes one call per parameter server per step, and ends with every push applied."""

from __future__ import annotations

import numpy as np

from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator
from kubeps.runtime.ops import nn
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.variables.partitioners import FixedShardsPartitioner
from kubeps.runtime.variables.variable import Variable

ROWS, DIM, STEPS = 70_000, 4, 4  # a table: rows are looked up, never pulled whole


def _run(make_cluster, overlap: bool):
    cluster = make_cluster(num_ps=2, num_workers=1)
    strategy = cluster.strategy(variable_partitioner=FixedShardsPartitioner(2))
    coordinator = ClusterCoordinator(strategy)
    try:
        with strategy.scope():
            table = Variable(np.zeros((ROWS, DIM), np.float32), name="table")
            w = Variable(np.zeros(3, np.float32), name="w")
        emb = nn.Embedding(ROWS, DIM, embeddings=table)
        opt = SGD(learning_rate=1.0)
        batches = [np.array([[1, ROWS - 1]]) for _ in range(STEPS)]  # a row on each ps

        def train():
            from kubeps.runtime.variables import context

            ctx = context.current_closure_context()
            calls = []
            send = ctx.transport.call_many

            def counted(requests, timeout=None):
                calls.append(sorted(requests))
                return send(requests, timeout)

            ctx.transport.call_many = counted
            seen = []
            for k, ids in enumerate(batches):
                rows = emb.forward(ids)
                if overlap and k + 1 < len(batches):
                    emb.prefetch(batches[k + 1])
                seen.append((float(rows[0, 0, 0]), float(rows[0, 1, 0]), float(w.read_value()[0])))
                emb.backward(np.ones_like(rows))
                opt.apply_gradients(emb.grads_and_vars() + [(np.ones(3, np.float32), w)])
            return seen, calls

        seen, calls = coordinator.schedule(train).fetch()
        final = (float(table.numpy()[1, 0]), float(table.numpy()[ROWS - 1, 0]), float(w.numpy()[0]))
        return seen, calls, final
    finally:
        coordinator.shutdown()
        strategy.close()


def test_overlap_is_one_step_stale_one_call_per_ps_per_step_and_loses_no_push(make_cluster):
    seen, calls, final = _run(make_cluster, overlap=True)
    # step 0 reads at once; step 1 uses what was pulled during step 0 (before its push); from then on each step
    # lacks exactly the previous step's push
    assert [s[2] for s in seen] == [0.0, 0.0, -1.0, -2.0]
    assert all(s[0] == s[1] == s[2] for s in seen), seen  # rows and dense values read together
    assert final == (-4.0, -4.0, -4.0)  # every push applied by the end of the function
    assert all(c == [0, 1] for c in calls), calls  # each call goes to both ps at once
    assert len(calls) <= STEPS + 2, calls  # one per step, plus the last pushes' own


def test_without_overlap_each_step_sees_its_own_last_push(make_cluster):
    seen, calls, final = _run(make_cluster, overlap=False)
    assert [s[2] for s in seen] == [0.0, -1.0, -2.0, -3.0]
    assert all(s[0] == s[1] == s[2] for s in seen), seen
    assert final == (-4.0, -4.0, -4.0)
    assert len(calls) == STEPS + 1, calls


def test_prefetch_on_a_local_table_changes_nothing():
    layer = nn.Embedding(10, 2, embeddings=np.arange(20, dtype=np.float32).reshape(10, 2))
    layer.prefetch(np.array([1, 2]))  # a local table: nothing to pull, forward gathers
    np.testing.assert_array_equal(layer.forward(np.array([3])), [[6.0, 7.0]])
