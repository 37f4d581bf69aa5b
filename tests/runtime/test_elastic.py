"""Elastic workers: the closure queue's retire/admit (no sockets), the membership document and its watcher (files),
and workers joining and leaving a running coordinator (real processes)."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from kubeps.runtime.cluster import Membership, MembershipAck, TFConfigError
from kubeps.runtime.coordinator.closure_queue import Closure, ClosureQueue, ClosureState
from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator
from kubeps.runtime.coordinator.membership import MembershipWatcher
from kubeps.runtime.observe.chief_metrics import chief_families
from kubeps.runtime.util.files import write_atomically
from kubeps.runtime.variables.context import get_current_worker_index

from .conftest import free_ports, running_coordinator


# -- the closure queue ---------------------------------------------------------------------------------------------
def test_a_retired_worker_gets_nothing_and_its_waiting_get_returns_at_once():
    queue = ClosureQueue()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(queue.get(1, timeout=10)))
    waiter.start()
    time.sleep(0.1)
    started = time.monotonic()
    queue.retire_worker(1)
    waiter.join(timeout=5)
    assert got == [None] and time.monotonic() - started < 1.0
    queue.put(Closure(b"x"))
    assert queue.get(1, timeout=0.1) is None  # retired: the global queue is not handed to it
    closure = queue.get(0, timeout=0.1)
    assert closure is not None and closure.state is ClosureState.RUNNING
    queue.admit_worker(1)
    queue.put(Closure(b"y"))
    assert queue.get(1, timeout=0.1) is not None


def test_retiring_drops_the_tagged_closures_and_passes_its_wake_up_on():
    queue = ClosureQueue()
    tagged = Closure(b"resource", kind="resource")
    queue.put_per_worker(2, tagged)
    assert queue.retire_worker(2) == [tagged] and tagged.remote_value.fetch(0) is None
    # worker 0 idle; worker 1 idle and woken for a closure it never takes because it retires: 0 gets it
    taken: list[object] = []
    threads = [threading.Thread(target=lambda w=w: taken.append((w, queue.get(w, timeout=2)))) for w in (1, 0)]
    for thread in threads:
        thread.start()
        time.sleep(0.1)  # 1 idle first, so the put wakes 1
    with queue._cond:  # the put and the retirement before 1 runs again: its wake-up is unused
        queue._enqueue(Closure(b"z"), queue._queue)
        queue.counts["scheduled"] += 1
        assert 1 in queue._woken
    queue.retire_worker(1)
    for thread in threads:
        thread.join(timeout=5)
    assert dict(taken)[1] is None and dict(taken)[0] is not None


def test_a_closure_that_fails_on_a_retiring_worker_is_requeued_for_the_others():
    queue = ClosureQueue()
    queue.put(Closure(b"x"))
    closure = queue.get(3, timeout=0.1)
    queue.retire_worker(3)
    queue.requeue(closure)
    assert queue.get(0, timeout=0.1) is closure and closure.ran_on == [3, 0]


# -- the membership document ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("document, field", [
    ({"generation": -1, "workers": ["a:1"]}, "membership.generation"),
    ({"generation": 1, "workers": []}, "membership.workers"),
    ({"generation": 1, "workers": ["a:1", "nohost"]}, "membership.workers[1]"),
    ({"generation": 1, "workers": ["a:1", "a:1"]}, "membership.workers"),
    ("[1, 2]", "membership"),
])
def test_a_bad_membership_document_names_the_field(document, field):
    with pytest.raises(TFConfigError, match=f"'{field.replace('[', '.').replace(']', '.')}'"):
        Membership.parse(document if isinstance(document, str) else json.dumps(document))


class _Target:
    def __init__(self) -> None:
        self.applied: list[Membership] = []
        self.drained: list[int] = []

    def apply_membership(self, membership: Membership) -> MembershipAck:
        self.applied.append(membership)
        return self.membership_status()

    def membership_status(self) -> MembershipAck:
        last = self.applied[-1] if self.applied else Membership(workers=["a:1"])
        return MembershipAck(generation=last.generation, workers=list(range(len(last.workers))),
                             drained=list(self.drained))


def test_the_watcher_applies_each_generation_once_and_acks_every_change(tmp_path, caplog):
    path, ack = str(tmp_path / "membership.json"), str(tmp_path / "ack.json")
    target = _Target()
    watcher = MembershipWatcher(target, path, ack_path=ack)
    assert watcher.poll() is not None and target.applied == []  # no file yet: TF_CONFIG's workers, acked
    write_atomically(path, Membership(generation=1, workers=["a:1", "b:1"]).to_json())
    watcher.poll()
    watcher.poll()
    assert [m.generation for m in target.applied] == [1]
    assert MembershipAck.model_validate_json(open(ack).read()).workers == [0, 1]
    target.drained.append(1)
    assert watcher.poll() is not None and MembershipAck.model_validate_json(open(ack).read()).drained == [1]
    with open(path, "w") as fh:
        fh.write('{"generation": 2, "workers": []}')
    watcher.poll()
    assert [m.generation for m in target.applied] == [1] and "skipped" in caplog.text


# -- a running coordinator (real processes) ------------------------------------------------------------------------
_coordinator = running_coordinator


def _which_worker(pause: float) -> int:
    time.sleep(pause)
    return get_current_worker_index()


def _add_workers(cluster, count: int) -> list[str]:
    addresses = [f"127.0.0.1:{p}" for p in free_ports(count)]
    first = len(cluster.cluster["worker"])
    cluster.cluster["worker"].extend(addresses)
    for index in range(first, first + count):
        cluster.start_task("worker", index, wait=False)
    return cluster.cluster["worker"]


def test_workers_join_and_leave_a_running_coordinator_without_losing_a_closure(make_cluster):
    cluster = make_cluster(num_ps=1, num_workers=2)
    with _coordinator(cluster) as coordinator:
        dataset = coordinator.create_per_worker_dataset(lambda ctx: [(ctx.input_pipeline_id, ctx.num_input_pipelines)]
                                                        * 1000)
        iterator = iter(dataset)

        def shard(it):
            return next(it)

        values = [coordinator.schedule(_which_worker, args=(0.02,)) for _ in range(40)]
        addresses = _add_workers(cluster, 2)
        scaled_at = time.monotonic()
        status = coordinator.apply_membership(Membership(generation=1, workers=addresses))
        assert status.workers == [0, 1, 2, 3] and coordinator.num_workers == 4
        # the joiners answer, get the dataset and the iterator built, then take closures
        first_seen: dict[int, float] = {}
        deadline = time.monotonic() + 60
        while not {2, 3} <= set(first_seen) and time.monotonic() < deadline:
            batch = [coordinator.schedule(_which_worker, args=(0.02,)) for _ in range(8)]
            values += batch
            for value in batch:
                first_seen.setdefault(value.fetch(), time.monotonic() - scaled_at)
        assert {2, 3} <= set(first_seen), first_seen
        shards = {coordinator.schedule(shard, args=(iterator,)).fetch() for _ in range(40)}
        assert (2, 4) in shards or (3, 4) in shards  # a joiner's dataset is sharded for the membership of then
        # scale down to 1 while closures run: 1..3 drain, nothing is lost
        values += [coordinator.schedule(_which_worker, args=(0.05,)) for _ in range(20)]
        time.sleep(0.1)
        status = coordinator.apply_membership(Membership(generation=2, workers=addresses[:1]))
        assert status.workers == [0]
        values += [coordinator.schedule(_which_worker, args=(0.0,)) for _ in range(10)]
        coordinator.join()
        results = [value.fetch() for value in values]
        assert len(results) == len(values)
        deadline = time.monotonic() + 30
        while sorted(coordinator.membership_status().drained) != [1, 2, 3] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(coordinator.membership_status().drained) == [1, 2, 3]
        assert coordinator.membership_status().draining == []
        after = [coordinator.schedule(_which_worker, args=(0.0,)) for _ in range(10)]
        assert {value.fetch() for value in after} == {0}
        counts = coordinator._queue.counters()
        assert counts["failed"] == 0 and counts["cancelled"] == 0


def test_a_joining_worker_that_never_answers_does_not_fail_the_job(make_cluster):
    cluster = make_cluster(num_ps=1, num_workers=1)
    with _coordinator(cluster, worker_wait_timeout=0.5) as coordinator:
        nobody = f"127.0.0.1:{free_ports(1)[0]}"
        coordinator.apply_membership([cluster.cluster["worker"][0], nobody])
        values = [coordinator.schedule(_which_worker, args=(0.0,)) for _ in range(10)]
        time.sleep(1.5)  # past worker_wait_timeout
        coordinator.join()
        assert {value.fetch() for value in values} == {0}
        coordinator.apply_membership([cluster.cluster["worker"][0]])
        deadline = time.monotonic() + 10
        while coordinator.membership_status().drained != [1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coordinator.membership_status().drained == [1]


def test_the_chief_follows_its_membership_file(make_cluster, tmp_path):
    cluster = make_cluster(num_ps=1, num_workers=1)
    path, ack = tmp_path / "membership.json", tmp_path / "ack.json"
    with _coordinator(cluster) as coordinator:
        coordinator.watch_membership(str(path), str(ack))
        addresses = _add_workers(cluster, 1)
        write_atomically(str(path), Membership(generation=7, workers=addresses).to_json())
        deadline = time.monotonic() + 60
        seen: set[int] = set()
        while 1 not in seen and time.monotonic() < deadline:
            seen |= {v.fetch() for v in [coordinator.schedule(_which_worker, args=(0.02,)) for _ in range(4)]}
        assert 1 in seen
        assert MembershipAck.model_validate_json(ack.read_text()).generation == 7
        assert np.array_equal(MembershipAck.model_validate_json(ack.read_text()).workers, [0, 1])


def _cycle(records):
    while True:
        yield from records


def _take(iterator):
    return get_current_worker_index(), next(iterator)


def test_the_datasets_are_sharded_again_for_each_membership_so_no_record_is_left_behind(make_cluster):
    records = 24
    cluster = make_cluster(num_ps=1, num_workers=2)
    with _coordinator(cluster) as coordinator:
        dataset = coordinator.create_per_worker_dataset(
            lambda ctx: _cycle(range(ctx.input_pipeline_id, records, ctx.num_input_pipelines)))
        iterator = iter(dataset)
        before = [coordinator.schedule(_take, args=(iterator,)).fetch() for _ in range(8)]
        assert all(r % 2 == w for w, r in before)
        addresses = _add_workers(cluster, 2)
        coordinator.apply_membership(Membership(generation=1, workers=addresses))
        during: list[tuple[int, int]] = []
        deadline = time.monotonic() + 60
        while {w for w, _ in during} != {0, 1, 2, 3} and time.monotonic() < deadline:
            during += [v.fetch() for v in [coordinator.schedule(_take, args=(iterator,)) for _ in range(8)]]
        # every worker reads its quarter from its first closure after the change: the old halves are gone
        assert {w for w, _ in during} == {0, 1, 2, 3}
        for worker in range(4):  # each from the start of its new shard: the four split every record
            mine = [r for w, r in during if w == worker]
            assert mine == [r for _, r in zip(mine, _cycle(range(worker, records, 4)))]
        coordinator.apply_membership(Membership(generation=2, workers=addresses[:1]))
        after = [coordinator.schedule(_take, args=(iterator,)).fetch() for _ in range(records)]
        # worker 0 alone reads the whole dataset again, from its start: none of 1..3's records is lost
        assert after == [(0, r) for r in range(records)]
        assert coordinator.membership.reshards == 2


def _drained(coordinator, workers: set[int]) -> None:
    deadline = time.monotonic() + 30
    while not workers <= set(coordinator.membership_status().drained) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers <= set(coordinator.membership_status().drained)


def test_the_records_read_again_across_churn_are_counted_exactly(make_cluster, caplog):
    """Each reshard makes the workers read their new shards from the start: the records each worker (staying or
    leaving) had taken in the pass under way are read a second time. The chief counts them from the workers'
    answers, exactly, through ``prefetch`` running ahead and batches of a ``repeat`` that straddle passes."""
    from kubeps.runtime.data import Dataset

    records = 24
    cluster = make_cluster(num_ps=1, num_workers=2)
    with _coordinator(cluster) as coordinator:
        dataset = coordinator.create_per_worker_dataset(
            lambda ctx: Dataset.range(ctx.input_pipeline_id, records, ctx.num_input_pipelines).repeat().batch(5)
            .prefetch(3))
        iterator = iter(dataset)

        def take(count: int) -> dict[int, int]:
            """``count`` batches, one at a time; the records each worker took."""
            taken: dict[int, int] = {}
            for worker, batch in [coordinator.schedule(_take, args=(iterator,)).fetch() for _ in range(count)]:
                taken[worker] = taken.get(worker, 0) + len(batch)
            return taken

        def take_until_each_of(workers: set[int], batches: int) -> dict[int, int]:
            """At least ``batches`` batches, and more until each of ``workers`` took one: which idle worker runs a
            function is the scheduler's choice, and under load one worker can run many in a row."""
            taken: dict[int, int] = {}
            deadline = time.monotonic() + 60
            while (set(taken) != workers or sum(taken.values()) < 5 * batches) and time.monotonic() < deadline:
                for worker, n in take(1).items():
                    taken[worker] = taken.get(worker, 0) + n
            assert set(taken) == workers
            return taken

        before = take_until_each_of({0, 1}, 7)
        expected = sum(n % (records // 2) for n in before.values())  # the passes of 12 under way
        with caplog.at_level("WARNING", logger="kubeps.runtime.coordinator.membership_controller"):
            addresses = _add_workers(cluster, 2)
            coordinator.apply_membership(Membership(generation=1, workers=addresses))
            during = take_until_each_of({0, 1, 2, 3}, 8)
            assert coordinator.membership.records.total == expected > 0
            expected += sum(n % (records // 4) for n in during.values())  # the passes of 6 under way
            coordinator.apply_membership(Membership(generation=2, workers=addresses[:1]))
            after = take(3)
            _drained(coordinator, {1, 2, 3})
        assert set(after) == {0}
        assert coordinator.membership.records.total == expected
        metrics = _chief_metrics(coordinator)
        assert metrics["kubeps_dataset_records_reread"] == expected
        assert f"(at-least-once; {expected} record(s) read again in this job so far)" in caplog.text
        for worker in (1, 2, 3):  # a leaver whose pass under way is empty has nothing to say
            assert (f"worker {worker} left after reading" in caplog.text) == (during[worker] % (records // 4) > 0)


def _chief_metrics(coordinator: ClusterCoordinator) -> dict[str, float]:
    """The chief's metric families as its collector yields them at a scrape, by name."""
    return {f.name: f.samples[0].value for f in chief_families(coordinator._queue, coordinator.membership.figures)}


def test_a_restarted_worker_s_pass_is_counted_as_read_again(make_cluster):
    """A worker that restarts gets its iterators built again and reads its shard from the start: what its last
    answer said it had read in the pass under way is read again."""
    from kubeps.runtime.data import Dataset

    cluster = make_cluster(num_ps=1, num_workers=1)
    with _coordinator(cluster) as coordinator:
        dataset = coordinator.create_per_worker_dataset(lambda ctx: Dataset.range(10).repeat().batch(4))
        iterator = iter(dataset)
        firsts = [coordinator.schedule(_take, args=(iterator,)).fetch()[1][0] for _ in range(4)]
        assert firsts == [0, 4, 8, 2]  # 16 records: 6 of the second pass
        cluster.kill("worker", 0)
        cluster.start_task("worker", 0)
        assert coordinator.schedule(_take, args=(iterator,)).fetch()[1][0] == 0  # from the start again
        assert coordinator.membership.records.total == 6


def test_a_membership_change_is_one_line_of_the_chief_s_log(make_cluster, caplog):
    cluster = make_cluster(num_ps=1, num_workers=2)
    with _coordinator(cluster) as coordinator:
        coordinator.create_per_worker_dataset(lambda: [1])
        with caplog.at_level("WARNING", logger="kubeps.runtime.coordinator.membership_controller"):
            coordinator.apply_membership(Membership(generation=5, workers=cluster.cluster["worker"][:1]))
        assert ("membership generation 5: 1 worker(s); joining [], leaving [1] (each finishes what it runs); 1 "
                "per-worker dataset(s) sharded again for 1 workers") in caplog.text


def test_a_checkpoint_request_saves_with_the_programs_newest_manager_once(make_cluster, tmp_path, caplog):
    """The operator's request before a ps count change: the chief saves with the newest CheckpointManager of its
    program while it runs, once per request, and reports it served; the request in the first document a chief
    applies was its predecessor's (served, nothing saved)."""
    from kubeps.runtime.checkpoint import Checkpoint, CheckpointManager, CheckpointReader, StepCounter
    from kubeps.runtime.variables.variable import Variable

    cluster = make_cluster(num_ps=1, num_workers=1)
    workers = cluster.cluster["worker"]
    with _coordinator(cluster) as coordinator:
        assert coordinator.apply_membership(Membership(generation=1, workers=workers, checkpoint=4)).checkpoint == 4
        with coordinator.strategy.scope():
            weights = Variable(np.zeros(3, np.float32), name="w")
        step = StepCounter(30)
        manager = CheckpointManager(Checkpoint(model=[weights], step=step), str(tmp_path / "ckpt"))
        assert manager.checkpoints == []  # the first document's request: nothing saved
        weights.assign(np.full(3, 7.0, np.float32))
        status = coordinator.apply_membership(Membership(generation=2, workers=workers, checkpoint=5))
        assert status.checkpoint == 5 and len(manager.checkpoints) == 1
        reader = CheckpointReader(manager.latest_checkpoint)
        assert np.array_equal(reader.get("model/w"), np.full(3, 7.0)) and reader.step == 30
        assert f"checkpoint request 5: saved {manager.latest_checkpoint} in " in caplog.text
        coordinator.apply_membership(Membership(generation=3, workers=workers, checkpoint=5))  # served already
        assert len(manager.checkpoints) == 1 and coordinator.membership_status().checkpoint == 5
        metrics = _chief_metrics(coordinator)
        assert metrics["kubeps_checkpoint_request"] == 5
