"""ParameterServerState without sockets: concurrency, optimizer state, checks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.ps.push import rpc_push
from kubeps.runtime.rpc.validation import PS_REQUESTS
from kubeps.runtime.ps.state import DISTINCT_ROWS_FROM_BYTES, ParameterServerState, UnknownVariableError, all_distinct
from kubeps.runtime.settings import TaskSettings

pytestmark = pytest.mark.timeout(60)

SGD_CONFIG = SGD(learning_rate=1.0).get_config()


def _hammer(n_threads, fn):
    barrier = threading.Barrier(n_threads)
    errors = []

    def run(i):
        try:
            barrier.wait()
            fn(i)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_many_threads_pushing_one_shard_lose_no_update():
    state = ParameterServerState(settings=TaskSettings())
    state.create("v", np.zeros(1000, np.float64))
    per_thread = 50

    def push(i):
        for _ in range(per_thread):
            state.apply_dense("v", SGD_CONFIG, np.full(1000, -1.0))  # v -= 1.0 * (-1)

    _hammer(8, push)
    np.testing.assert_array_equal(state.read("v"), np.full(1000, 8 * per_thread))
    assert state.get("v").updates == 8 * per_thread


def test_sparse_pushes_with_duplicates_are_atomic():
    state = ParameterServerState(settings=TaskSettings())
    state.create("e", np.zeros((10, 2), np.float32))

    def push(i):
        for _ in range(20):
            state.apply_sparse("e", SGD_CONFIG, np.array([1, 1, 3]), -np.ones((3, 2), np.float32))

    _hammer(6, push)
    out = state.read("e")
    np.testing.assert_array_equal(out[1], [240, 240])
    np.testing.assert_array_equal(out[3], [120, 120])
    assert out[[0, 2, 4]].sum() == 0


class _SlowOptimizer:
    """Sleeps inside the update (or meets the other update there): shows whether two variables' updates overlap."""

    active = 0
    peak = 0
    lock = threading.Lock()
    meet: threading.Barrier | None = None  # both updates must be inside at once, else BrokenBarrierError

    def init_slots(self, var):
        return {}

    def apply_dense(self, var, grad, slots, step):
        with _SlowOptimizer.lock:
            _SlowOptimizer.active += 1
            _SlowOptimizer.peak = max(_SlowOptimizer.peak, _SlowOptimizer.active)
        if _SlowOptimizer.meet is not None:
            _SlowOptimizer.meet.wait(timeout=10)
        else:
            time.sleep(0.05)
        var -= grad
        with _SlowOptimizer.lock:
            _SlowOptimizer.active -= 1


def test_unrelated_shards_are_not_serialised():
    state = ParameterServerState(optimizer_factory=lambda config: _SlowOptimizer(), settings=TaskSettings())
    state.create("a", np.zeros(3))
    state.create("b", np.zeros(3))
    _SlowOptimizer.meet = threading.Barrier(2)  # deterministic: a serialising PS never lets both in
    try:
        _hammer(2, lambda i: state.apply_dense("ab"[i], {"class_name": "Slow"}, np.ones(3)))
    finally:
        _SlowOptimizer.meet = None
    assert _SlowOptimizer.peak == 2
    _SlowOptimizer.peak = 0
    _hammer(2, lambda i: state.apply_dense("a", {"class_name": "Slow"}, np.ones(3)))
    assert _SlowOptimizer.peak == 1  # same shard: one at a time
    np.testing.assert_array_equal(state.read("a"), [-3, -3, -3])


def test_slots_are_lazy_per_optimizer_and_steps_count():
    state = ParameterServerState(settings=TaskSettings())
    state.create("v", np.ones(4, np.float32))
    from kubeps.runtime.ops.optimizers import Adagrad

    cfg = Adagrad(learning_rate=0.1).get_config()
    assert state.get("v").slots == {}
    assert state.apply_dense("v", cfg, np.ones(4, np.float32)) == 1
    assert state.apply_dense("v", SGD_CONFIG, np.ones(4, np.float32)) == 2
    slots = state.get("v").slots
    assert len(slots) == 2 and any(s for s in slots.values())  # Adagrad's accumulator, SGD's nothing


def test_checks_name_the_problem():
    state = ParameterServerState(settings=TaskSettings())
    state.create("v", np.zeros((3, 2), np.float32))
    with pytest.raises(UnknownVariableError, match="no variable named 'w'.*holds \\['v'\\]"):
        state.read("w")
    with pytest.raises(ValueError, match="grad for variable 'v' has shape \\[2\\]; the variable's shape is \\[3, 2\\]"):
        state.apply_dense("v", SGD_CONFIG, np.zeros(2))
    with pytest.raises(ValueError, match="holds row 3; the variable has rows 0..2"):
        state.apply_sparse("v", SGD_CONFIG, np.array([3]), np.zeros((1, 2)))
    with pytest.raises(ValueError, match="'values' has shape \\[1, 3\\], expected \\[1, 2\\]"):
        state.apply_sparse("v", SGD_CONFIG, np.array([0]), np.zeros((1, 3)))
    with pytest.raises(ValueError, match="field 'updates\\[0\\].kind' has value 'weird'"):
        PS_REQUESTS["Push"].validate({"optimizer": SGD_CONFIG, "updates": [{"name": "v", "kind": "weird"}]})
    with pytest.raises(ValueError, match="holds 0 tensor\\(s\\); 'updates' needs more \\(updates\\[0\\] of kind 'dense'"):
        rpc_push(state, {"optimizer": SGD_CONFIG, "updates": [{"name": "v"}]}, [])


def test_read_rows_and_assign():
    state = ParameterServerState(settings=TaskSettings())
    state.create("v", np.arange(6, dtype=np.float32).reshape(3, 2))
    np.testing.assert_array_equal(state.read_rows("v", np.array([2, 0, 2])), [[4, 5], [0, 1], [4, 5]])
    state.assign_add("v", np.ones((3, 2), np.float32))
    state.assign("v", state.read("v") * 2)
    np.testing.assert_array_equal(state.read("v"), (np.arange(6).reshape(3, 2) + 1) * 2)


def test_the_ps_refuses_a_gradient_of_another_dtype():
    state = ParameterServerState(settings=TaskSettings())
    state.create("v", np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="grad for variable 'v' has dtype float64; the variable is float32"):
        state.apply_dense("v", SGD_CONFIG, np.zeros((3, 2), np.float64))
    with pytest.raises(ValueError, match="'values' has dtype int64; the variable is float32"):
        state.apply_sparse("v", SGD_CONFIG, np.array([1]), np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="value for variable 'v' has dtype int64"):
        state.assign("v", np.zeros((3, 2), np.int64))


def test_all_distinct_takes_ascending_ids_in_one_pass_and_sorts_the_rest():
    assert all_distinct(np.array([], np.int64)) and all_distinct(np.array([7]))
    assert all_distinct(np.arange(0, 10_000, 3))  # ascending: the one-pass answer
    assert all_distinct(np.array([5, 1, 9, 3]))  # distinct, not ascending: sorted
    assert not all_distinct(np.array([1, 2, 2, 3]))  # ascending but not strictly
    assert not all_distinct(np.array([9, 1, 9]))


def test_a_big_read_of_rows_names_each_row_once_in_any_order():
    """Past DISTINCT_ROWS_FROM_BYTES a read must name each row once; ascending ids (what kubeps sends) and any other
    order of distinct ids are read, a repeated id is refused."""
    state = ParameterServerState(settings=TaskSettings())
    rows = DISTINCT_ROWS_FROM_BYTES // 256 + 100
    state.create("t", np.arange(2 * rows * 64, dtype=np.float32).reshape(2 * rows, 64))
    ascending = np.arange(0, 2 * rows, 2)
    shuffled = np.random.default_rng(0).permutation(ascending)
    for ids in (ascending, shuffled):
        state.check_reads([], ["t"], [ids])
        np.testing.assert_array_equal(state.read_rows("t", ids), state.read("t")[ids])
    repeated = ascending.copy()
    repeated[-1] = repeated[0]
    with pytest.raises(ValueError, match="name each row once"):
        state.check_reads([], ["t"], [repeated])


def test_the_change_record_gives_the_rows_changed_since_a_save_and_survives_a_failed_save():
    from kubeps.runtime.ops.optimizers import Adagrad

    state = ParameterServerState(settings=TaskSettings())
    state.create("v", np.zeros((10, 2), np.float32))
    adagrad = Adagrad(0.1).get_config()

    def since(source, generation):
        view = state.save_view("v", source, generation)
        return None if view.ids is None else view.ids.tolist(), view

    ids, view = since(None, None)
    assert ids is None and view.shape == (10, 2) and view.slots == {}  # asked for in full
    source, first = view.source, view.generation
    state.apply_sparse("v", SGD_CONFIG, np.array([3, 1]), np.ones((2, 2), np.float32))
    ids, view = since(source, first)
    assert ids == [1, 3] and view.value.shape == (2, 2) and view.updates == 1
    failed = view.generation
    # that save failed: the next one asks again since the last committed save and still sees rows 1 and 3
    state.apply_sparse("v", SGD_CONFIG, np.array([7]), np.ones((1, 2), np.float32))
    assert since(source, first)[0] == [1, 3, 7]
    ids, view = since(source, failed)
    assert ids == [7]
    latest = view.generation
    assert since(source, latest)[0] == []
    # a new optimizer's slots change every row; so do assign, another source and a generation not yet seen
    state.apply_sparse("v", adagrad, np.array([0]), np.ones((1, 2), np.float32))
    assert since(source, latest)[0] is None
    now = since(None, None)[1].generation
    assert since("another", now)[0] is None
    assert since(source, now + 5)[0] is None
    state.assign("v", np.ones((10, 2), np.float32))
    assert since(source, now)[0] is None
    # a load (a restore) starts a new record
    state.load("v", np.zeros((10, 2), np.float32), None, None)
    assert state.get("v").changes.source != source


def test_a_full_save_streams_the_rows_chunk_by_chunk_and_training_goes_on_between_chunks():
    from kubeps.runtime.ps.changes import save_view

    state = ParameterServerState(settings=TaskSettings())
    state.create("v", np.zeros((20, 2), np.float32))
    view = save_view(state.get("v"), None, None, chunk_bytes=8 * 6)  # 6 rows a chunk
    chunks = view.chunks()
    first, _ = next(chunks)
    state.apply_sparse("v", SGD_CONFIG, np.array([2, 15]), np.ones((2, 2), np.float32))  # between two chunks
    rest = [part for part, _ in chunks]
    assert [len(c) for c in [first, *rest]] == [6, 6, 6, 2]
    assert (first == 0).all()  # copied before the push
    assert rest[1][3].tolist() == [-1, -1]  # row 15, copied after it
    # both rows the push changed belong to the next save
    assert state.save_view("v", view.source, view.generation).ids.tolist() == [2, 15]
