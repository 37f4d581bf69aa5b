"""``ParameterServerStrategy(dense_staleness=S)``: a worker reuses the dense values it pulled for its next S steps,
across scheduled functions, while every push reaches the parameter server; tables' rows stay fresh. Real ps and
worker processes over gRPC."""

from __future__ import annotations

import numpy as np
import pytest

from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.variables.indexed_slices import IndexedSlices
from kubeps.runtime.variables.context import current_closure_context, get_current_worker_index
from kubeps.runtime.variables.variable import Variable, embedding_lookup

pytestmark = pytest.mark.timeout(120)


def _steps(variables, table, steps: int):
    """``steps`` SGD steps of gradient 1 on every variable; per step the value read and the pulls so far."""
    opt = SGD(learning_rate=1.0)

    def fn():
        ctx = current_closure_context()
        seen = []
        for _ in range(steps):
            value = float(variables[0].read_value()[0])
            row = float(embedding_lookup(table, np.array([0]))[0, 0])
            seen.append((value, row, ctx.pulls))
            opt.apply_gradients([(np.ones(3, np.float32), v) for v in variables]
                                + [(IndexedSlices(np.ones((1, 2), np.float32), np.array([0])), table)])
        return get_current_worker_index(), seen

    return fn


def test_values_are_reused_for_the_bound_and_every_push_lands(shared_cluster):
    strategy = shared_cluster.strategy(dense_staleness=2)
    coordinator = ClusterCoordinator(strategy)
    try:
        with strategy.scope():
            variables = [Variable(np.zeros(3, np.float32), name=f"w{i}") for i in range(2)]  # one per ps
            table = Variable(np.zeros((32 << 20 >> 3, 2), np.float32), name="table")  # 32 MiB: a table, never kept
        assert variables[0].staleness == 2 and table.staleness == 0

        worker, seen = coordinator.schedule(_steps(variables, table, 7)).fetch()
        values = [v for v, _, _ in seen]
        # a value pulled in step k serves steps k, k+1, k+2: pulled in steps 0, 3 and 6 (this worker's pushes only)
        assert values == [0, 0, 0, -3, -3, -3, -6], seen
        rows = [r for _, r, _ in seen]
        assert rows == [0, -1, -2, -3, -4, -5, -6], seen  # the table's rows are read fresh every step
        np.testing.assert_array_equal(variables[0].numpy(), np.full(3, -7.0))  # every push reached the ps

        # the kept values outlive the function: the same worker's next function reads its last pull, still in bound
        again = None
        for _ in range(8):
            w, more = coordinator.schedule(_steps(variables, table, 1)).fetch()
            if w == worker:
                again = more[0][0]
                break
        if again is not None:
            truth = float(variables[0].numpy()[0])
            assert truth <= again <= truth + 2 + 8, (again, truth)  # at most 2 own steps (+ the others') stale
    finally:
        coordinator.shutdown()
        strategy.close()


def test_zero_reads_every_step_as_tensorflow(shared_cluster):
    strategy = shared_cluster.strategy()
    coordinator = ClusterCoordinator(strategy)
    try:
        with strategy.scope():
            variables = [Variable(np.zeros(3, np.float32), name=f"v{i}") for i in range(2)]
            table = Variable(np.zeros((4, 2), np.float32), name="small_table")
        _, seen = coordinator.schedule(_steps(variables, table, 4)).fetch()
        assert [v for v, _, _ in seen] == [0, -1, -2, -3]
    finally:
        coordinator.shutdown()
        strategy.close()


@pytest.mark.parametrize("value", [-1, 1.5, "3", True])
def test_a_bad_bound_is_refused_naming_it(shared_cluster, value):
    with pytest.raises(RuntimeConfigError, match=r"'ParameterServerStrategy.dense_staleness' has invalid value"):
        shared_cluster.strategy(dense_staleness=value)
