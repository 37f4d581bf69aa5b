"""ClusterCoordinator against a real local cluster (2 ps + 2 workers, gRPC on loopback)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from kubeps.runtime.errors import CancelledError
from kubeps.runtime.variables.context import get_current_worker_index
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.variables.push import IndexedSlices
from kubeps.runtime.variables.variable import ShardedVariable, Variable, embedding_lookup

pytestmark = pytest.mark.timeout(120)


def test_schedule_join_fetch(coord):
    strategy, coordinator = coord
    values = [coordinator.schedule(lambda x, y=1: np.arange(3) * x + y, args=(i,), kwargs={"y": 10})
              for i in range(6)]
    coordinator.join()
    assert coordinator.done()
    fetched = coordinator.fetch({"all": values, "plain": 5})
    assert fetched["plain"] == 5
    for i, got in enumerate(fetched["all"]):
        np.testing.assert_array_equal(got, np.arange(3) * i + 10)
    assert values[0].fetch().flags.writeable


def test_nested_results_and_worker_index(coord):
    strategy, coordinator = coord
    Point = collections.namedtuple("Point", "x y")

    def fn():
        return {"w": get_current_worker_index(), "p": Point(np.ones(2, np.float32), "s"), "l": [np.int64(3)]}

    results = [coordinator.schedule(fn) for _ in range(8)]
    coordinator.join()
    seen = set()
    for rv in results:
        out = rv.fetch()
        assert isinstance(out["p"], Point) and out["p"].y == "s"
        np.testing.assert_array_equal(out["p"].x, np.ones(2, np.float32))
        assert out["l"] == [3]
        seen.add(out["w"])
    assert seen <= {0, 1} and seen


def test_error_propagation_and_cancellation(coord, tmp_path):
    strategy, coordinator = coord
    import time

    queued_marker = str(tmp_path / "queued")

    def fail():
        import os

        deadline = time.monotonic() + 30
        while not os.path.exists(queued_marker) and time.monotonic() < deadline:
            time.sleep(0.01)  # until the test has queued the others
        raise ValueError("boom from worker")

    def slow(i):
        time.sleep(0.2)
        return i

    bad = coordinator.schedule(fail)
    queued = [coordinator.schedule(slow, args=(i,)) for i in range(20)]
    open(queued_marker, "w").close()
    with pytest.raises(ValueError, match="boom from worker"):
        coordinator.join()
    with pytest.raises(ValueError, match="boom from worker") as info:
        bad.fetch()
    assert any(note.startswith("raised on worker ") and "in fail" in note for note in info.value.__notes__)
    outcomes = collections.Counter()
    for rv in queued:
        try:
            rv.fetch(timeout=30)
            outcomes["ok"] += 1
        except CancelledError:
            outcomes["cancelled"] += 1
    assert outcomes["cancelled"] > 0
    # the error was cleared: scheduling works again
    assert coordinator.schedule(lambda: 7).fetch(timeout=30) == 7
    coordinator.join()


def test_remote_value_as_an_argument(coord):
    """As in TensorFlow: a finished RemoteValue passed to schedule() resolves to its value on the worker."""
    strategy, coordinator = coord
    first = coordinator.schedule(lambda: np.arange(3.0))
    first.fetch(timeout=30)
    assert coordinator.schedule(lambda v, w: float((v * w).sum()), args=(first,), kwargs={"w": 2.0}
                                ).fetch(timeout=30) == 6.0
    assert coordinator.schedule(lambda d: d["x"].tolist(), args=({"x": first},)).fetch(timeout=30) == [0, 1, 2]

    slow = coordinator.schedule(lambda: __import__("time").sleep(2.0))
    with pytest.raises(TypeError, match="must be ready, and its function has not finished"):
        coordinator.schedule(lambda v: v, args=(slow,))

    def boom():
        raise KeyError("nope")

    failed = coordinator.schedule(boom)
    with pytest.raises(KeyError):
        coordinator.join()
    with pytest.raises(TypeError, match="has no value: its function failed with KeyError"):
        coordinator.schedule(lambda v: v, args=(failed,))
    coordinator.join()


def test_variables_sgd_training_loop(coord):
    strategy, coordinator = coord
    with strategy.scope():
        w = Variable(np.ones((4, 3), np.float32), name="w")
        b = Variable(np.zeros(3, np.float32), name="b")
        emb = Variable(np.arange(26, dtype=np.float32).reshape(13, 2), name="emb")
    local = Variable(np.zeros(2), name="local")
    assert isinstance(emb, ShardedVariable) and [v.name for v in emb.variables] == ["emb/part_0", "emb/part_1"]
    assert not local.is_remote
    # the partitioner splits every variable with >= 2 rows; shards are placed round-robin over the 2 ps
    devices = [v.device[-len("task:0/device:CPU:0"):-len("/device:CPU:0")] for x in (w, b, emb) for v in x.variables]
    assert devices == ["task:0", "task:1", "task:0", "task:1", "task:0", "task:1"]
    opt = SGD(learning_rate=0.5)

    def step():
        wv, bv = w.read_value(), b.read_value()
        rows = embedding_lookup(emb, np.array([1, 12, 1]))
        opt.apply_gradients([
            (np.full((4, 3), 2.0, np.float32), w),
            (np.ones(3, np.float32), b),
            (IndexedSlices(np.ones((2, 2), np.float32), np.array([1, 12])), emb),
        ])
        return wv.sum() + bv.sum(), rows

    results = [coordinator.schedule(step) for _ in range(4)]
    coordinator.join()
    for rv in results:
        total, rows = rv.fetch()
        assert rows.shape == (3, 2)
    np.testing.assert_allclose(w.numpy(), np.ones((4, 3)) - 4 * 0.5 * 2.0)
    np.testing.assert_allclose(b.numpy(), -4 * 0.5 * np.ones(3))
    expected = np.arange(26, dtype=np.float32).reshape(13, 2)
    expected[[1, 12]] -= 4 * 0.5
    np.testing.assert_allclose(np.asarray(emb), expected)


def test_worker_index_inside_a_prefetched_generator(coord):
    """docs/data.md's pipeline ends in .prefetch(), whose producer thread runs the generator; the worker
    index must still be known there (it failed saying the code ran on the coordinator)."""
    from kubeps.runtime.data.dataset import Dataset

    strategy, coordinator = coord

    def dataset_fn():
        def gen():
            while True:
                yield np.int64(get_current_worker_index())
        return Dataset.from_generator(gen).batch(2).prefetch(2)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    results = [coordinator.schedule(lambda it: (int(next(it)[0]), get_current_worker_index()), args=(iterator,))
               for _ in range(6)]
    coordinator.join()
    for rv in results:
        from_generator, from_step = rv.fetch()
        assert from_generator == from_step


def test_worker_index_off_a_worker_says_where_it_ran(monkeypatch):
    import threading

    from kubeps.runtime.variables import context

    monkeypatch.setattr(context, "_worker_processes", set())  # in-process servers of other tests do not count

    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, get_current_worker_index)))
    thread.start()
    thread.join()
    assert "this process serves no worker" in str(errors[0].value)


def test_a_dataset_that_runs_out_raises_out_of_range_naming_the_worker(coord):
    """TF raises OutOfRangeError; kubeps surfaced a bare StopIteration that named no worker."""
    import re

    import kubeps.runtime as kp
    from kubeps.runtime.data.dataset import Dataset

    strategy, coordinator = coord
    iterator = iter(coordinator.create_per_worker_dataset(lambda: Dataset.range(4).batch(2)))  # 2 batches, no repeat
    results = [coordinator.schedule(lambda it: next(it), args=(iterator,)) for _ in range(12)]
    with pytest.raises(kp.OutOfRangeError, match=r"End of sequence on worker (\d) \(/job:worker/task:\1 at "
                                                 r"127\.0\.0\.1:\d+\).*\.repeat\(\)") as caught:
        coordinator.join()
    assert any(re.match(r"raised on worker \d \(/job:worker/task:\d at 127\.0\.0\.1:\d+\):\n.*StopIteration", note,
                        flags=re.S) for note in caught.value.__notes__)
    with pytest.raises((kp.OutOfRangeError, kp.CancelledError)):
        results[-1].fetch()  # it ran out too, or was cancelled by the first error
    coordinator.join()  # the error was raised once and cleared


def test_every_forwarded_error_names_its_worker(coord):
    strategy, coordinator = coord

    def fail():
        raise KeyError("no such feature")

    rv = coordinator.schedule(fail)
    with pytest.raises(KeyError) as caught:
        coordinator.join()
    assert any(note.startswith("raised on worker ") and "/job:worker/task:" in note and "127.0.0.1:" in note
               for note in caught.value.__notes__)
    with pytest.raises(KeyError):
        rv.fetch()
