"""Exactly-once input: the chief's shard book (no sockets), a worker's feed under its pipeline (no sockets), and
every record id of an epoch trained once while workers are killed, added and removed (real processes)."""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kubeps.runtime import cli
from kubeps.runtime.cluster import Membership
from kubeps.runtime.coordinator.leases import ShardBook
from kubeps.runtime.data import Dataset
from kubeps.runtime.data.leases import NeedsInput, ShardFeed, leased, plan
from kubeps.runtime.errors import OutOfRangeError, RuntimeConfigError
from kubeps.runtime.observe.chief_metrics import chief_families
from kubeps.runtime.variables.context import get_current_worker_index
from kubeps.runtime.variables.variable import Variable

from .conftest import free_ports, running_coordinator, wait_for

ROOT = Path(__file__).resolve().parents[2]


# -- the chief's book ----------------------------------------------------------------------------------------------
def test_the_book_leases_in_order_commits_positions_and_reissues_from_the_last_commit():
    book = ShardBook([10], epochs=2, shard_records=4)  # shards [0,4) [4,8) [8,10) per epoch
    shards, final = book.lease(worker=0, ahead=2)
    assert [s.grant() for s in shards] == [[0, 0, 0, 4], [0, 1, 4, 8]] and not final
    assert book.commit(0, [[0, 0, 4, 1], [0, 1, 6, 0]]) == 6
    shards, _ = book.lease(worker=1, ahead=1)
    assert [s.grant() for s in shards] == [[0, 2, 8, 10]]
    assert book.release(0) == 1  # worker 0 leaves: [4,8) goes back from 6, to the front
    shards, _ = book.lease(worker=1, ahead=3)
    assert [s.grant() for s in shards] == [[0, 1, 6, 8], [1, 0, 0, 4]]  # then the next epoch
    assert book.commit(1, [[0, 2, 10, 1], [0, 1, 8, 1], [1, 0, 4, 1]]) == 8
    assert book.trained == 14 and book.reread == 0 and book.lost == 0
    shards, final = book.lease(worker=1, ahead=9)
    assert [s.grant() for s in shards] == [[1, 1, 4, 8], [1, 2, 8, 10]] and final


def test_a_report_after_the_shard_was_taken_back_counts_read_again_and_a_bad_one_lost():
    book = ShardBook([8], epochs=None, shard_records=8)
    book.lease(0, 1)
    book.commit(0, [[0, 0, 3, 0]])
    book.release(0)
    book.lease(1, 1)
    book.commit(0, [[0, 0, 5, 0]])  # worker 0's answer came after its shard went to worker 1 (from 3)
    assert book.reread == 2
    book.commit(1, [[0, 0, 2, 0]])  # behind the commit: not applied
    assert book.lost == 1 and book.trained == 3


# -- a worker's feed -----------------------------------------------------------------------------------------------
def _feed_dataset(pipeline):
    dataset = pipeline(Dataset.from_tensor_slices(np.arange(20)))
    feed = ShardFeed()
    return Dataset(leased(dataset._node, feed)), feed


def test_the_feed_reports_what_the_consumer_took_through_batch_and_prefetch():
    dataset, feed = _feed_dataset(lambda d: d.map(lambda x: x * 10).batch(3).prefetch(2))
    feed.grant([[0, 0, 0, 4], [0, 1, 4, 8], [0, 2, 8, 20]], final=False)
    iterator = iter(dataset)
    feed.in_function(True)
    first = next(iterator)
    feed.consumed(len(first))
    assert list(first) == [0, 10, 20]
    assert feed.positions() == [[0, 0, 3, 0]]  # prefetch read ahead; only the consumer's records count
    feed.consumed(len(next(iterator)))
    assert feed.positions() == [[0, 0, 4, 1], [0, 1, 6, 0]]
    assert feed.positions() == [[0, 1, 6, 0]]  # a shard reported done is not reported again
    feed.in_function(False)
    feed.grant([], final=True)
    rest = [list(b) for b in iterator]
    assert rest[0] == [60, 70, 80] and rest[-1] == [180, 190]
    feed.consumed(sum(map(len, rest)))
    assert feed.positions() == [[0, 1, 8, 1], [0, 2, 20, 1]]


def test_a_function_that_runs_out_of_leased_records_needs_input():
    dataset, feed = _feed_dataset(lambda d: d.batch(4))
    feed.grant([[0, 0, 0, 2]], final=False)
    feed.in_function(True)
    with pytest.raises(NeedsInput):
        next(iter(dataset))


@pytest.mark.parametrize("pipeline, named", [
    (lambda d: d.shuffle(4), "shuffle"),
    (lambda d: d.filter(lambda x: x > 0), "filter"),
    (lambda d: d.shard(2, 0), "shard"),
])
def test_a_pipeline_that_reorders_or_drops_records_is_refused_naming_the_step(pipeline, named):
    with pytest.raises(RuntimeConfigError, match=f"dataset_fn.*{named}.*only map, batch, prefetch and repeat"):
        plan(pipeline(Dataset.from_tensor_slices(np.arange(4))))


def test_the_option_is_checked_before_anything_is_built(make_cluster):
    cluster = make_cluster(num_ps=1, num_workers=1)
    with _coordinator(cluster) as coordinator:
        with pytest.raises(RuntimeConfigError, match="exactly_once.*'yes'.*True or False"):
            coordinator.create_per_worker_dataset(lambda: Dataset.range(3), exactly_once="yes")
        with pytest.raises(RuntimeConfigError, match="shard_records.*0"):
            coordinator.create_per_worker_dataset(lambda: Dataset.range(3), exactly_once=True, shard_records=0)
        with pytest.raises(RuntimeConfigError, match="dataset_fn.*range.*from_tensor_slices or from_files"):
            coordinator.create_per_worker_dataset(lambda: Dataset.range(3), exactly_once=True)
        assert not coordinator.workers.leases


def test_the_plan_counts_epochs_and_files(tmp_path):
    for i in range(3):
        (tmp_path / f"part-{i}.txt").write_text("a\nb\n")
    assert plan(Dataset.from_files(str(tmp_path / "*.txt")).batch(2).repeat(3)) == ([None] * 3, 3)
    assert plan(Dataset.from_tensor_slices(np.arange(5)).repeat()) == ([5], None)
    with pytest.raises(RuntimeConfigError, match="shuffle=False"):
        plan(Dataset.from_files(str(tmp_path / "*.txt"), shuffle=True))


# -- a running job (real processes) --------------------------------------------------------------------------------
_coordinator = running_coordinator


def _step(iterator):
    """One training step: the ids of the batch it trained on."""
    time.sleep(0.01)
    return get_current_worker_index(), next(iterator)


def _add_worker(cluster) -> list[str]:
    cluster.cluster["worker"].append(f"127.0.0.1:{free_ports(1)[0]}")
    cluster.start_task("worker", len(cluster.cluster["worker"]) - 1, wait=False)
    return list(cluster.cluster["worker"])


def _train(coordinator, iterator, steps: int) -> list:
    return [coordinator.schedule(_step, args=(iterator,)) for _ in range(steps)]


def _input_metrics(coordinator) -> dict[str, float]:
    families = chief_families(coordinator._queue, coordinator.membership.figures, coordinator.workers.leases.figures)
    return {f.name: f.samples[0].value for f in families if f.name.startswith("kubeps_input_")}


def test_a_new_iterator_goes_on_where_the_epoch_stands(make_cluster):
    cluster = make_cluster(num_ps=1, num_workers=2)
    with _coordinator(cluster) as coordinator:
        dataset = coordinator.create_per_worker_dataset(
            lambda: Dataset.from_tensor_slices(np.arange(100)).batch(5).prefetch(2), exactly_once=True,
            shard_records=20)
        first = [v.fetch()[1] for v in _train(coordinator, iter(dataset), 6)]
        second = [v.fetch()[1] for v in _train(coordinator, iter(dataset), 14)]  # the first one's feed is taken over
        assert sorted(int(i) for ids in first + second for i in ids) == list(range(100))
        with pytest.raises(OutOfRangeError):  # one epoch: the data ended
            coordinator.schedule(_step, args=(iter(dataset),)).fetch()


def _four_steps(iterator, seen, side: str) -> list[int]:
    """Four training steps in one function; each step writes its record count to ``seen`` (its push) and its ids
    to a side file."""
    ids: list[int] = []
    for _ in range(4):
        batch = [int(i) for i in next(iterator)]
        seen.assign_add(np.array([len(batch)], np.int64))
        with open(side, "a") as out:
            out.write(" ".join(map(str, batch)) + "\n")
        ids += batch
    return ids


def _two_datasets(first, second) -> tuple[list[int], list[int]]:
    """One step on a batch of each dataset, writing nothing: cut short when ``second`` runs out."""
    return [int(i) for i in next(first)], [int(i) for i in next(second)]


def test_the_steps_a_function_ran_before_its_records_ran_out_count_and_the_rerun_goes_on_from_there(make_cluster,
                                                                                                    tmp_path):
    cluster = make_cluster(num_ps=1, num_workers=1)
    side = str(tmp_path / "pushed.txt")
    with _coordinator(cluster) as coordinator:
        dataset = coordinator.create_per_worker_dataset(
            lambda: Dataset.from_tensor_slices(np.arange(100)).batch(5).repeat(2), exactly_once=True, shard_records=5)
        with coordinator.strategy.scope():
            seen = Variable(np.zeros(1, np.int64), name="seen")
        iterator = iter(dataset)
        returned = [coordinator.schedule(_four_steps, args=(iterator, seen, side)) for _ in range(5)]
        coordinator.join()
        # the first function got 2 shards of 5 for its 4 batches: it trained 2, ran out, and ran again on new ones
        assert coordinator._queue.counters()["retried"] >= 1
        pushed = [int(i) for line in open(side).read().split("\n") if line for i in line.split()]
        # the first epoch trained once, the ids of the cut-short run too; the re-run went on into the second
        assert sorted(pushed[:100]) == list(range(100)) and pushed[100:] == list(range(len(pushed) - 100))
        assert len(pushed) > 100 and sum(len(value.fetch()) for value in returned) == 100
        assert _input_metrics(coordinator)["kubeps_input_records_trained"] == len(pushed)
        assert int(seen.read_value()[0]) == len(pushed)


def test_a_step_cut_short_before_it_wrote_reads_its_records_again(make_cluster):
    cluster = make_cluster(num_ps=1, num_workers=1)
    with _coordinator(cluster) as coordinator:
        # the second dataset's shards hold one batch: the second step runs out on it after a batch of the first
        first, second = (iter(coordinator.create_per_worker_dataset(
            lambda: Dataset.from_tensor_slices(np.arange(40)).batch(5), exactly_once=True, shard_records=shard))
            for shard in (20, 5))
        values = [coordinator.schedule(_two_datasets, args=(first, second)) for _ in range(8)]
        steps = [value.fetch() for value in values]
        assert coordinator._queue.counters()["retried"] >= 1
        for column in (0, 1):  # no step lost its batch of the first dataset
            assert sorted(i for step in steps for i in step[column]) == list(range(40))


@pytest.mark.parametrize("source", ["tensor_slices", "files"])
def test_every_record_is_trained_once_while_workers_are_killed_added_and_removed(make_cluster, tmp_path, source):
    records, batch = 600, 5
    if source == "files":
        for part in range(6):
            (tmp_path / f"ids-{part}.txt").write_text("".join(f"{i}\n" for i in range(part * 100, part * 100 + 100)))
        pattern = str(tmp_path / "ids-*.txt")

        def dataset_fn():
            return Dataset.from_files(pattern).map(int).batch(batch).prefetch(2).repeat(2)
    else:
        def dataset_fn():
            return Dataset.from_tensor_slices(np.arange(records)).batch(batch).prefetch(2).repeat(2)

    cluster = make_cluster(num_ps=1, num_workers=2)
    with _coordinator(cluster) as coordinator:
        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn, exactly_once=True, shard_records=40))
        values = _train(coordinator, iterator, 20)
        time.sleep(0.15)
        cluster.kill("worker", 1)  # killed while functions run: its shards go back from their last commit
        values += _train(coordinator, iterator, 20)
        cluster.start_task("worker", 1, wait=False)
        addresses = _add_worker(cluster)
        coordinator.apply_membership(Membership(generation=1, workers=addresses))
        values += _train(coordinator, iterator, 40)
        time.sleep(0.3)
        coordinator.apply_membership(Membership(generation=2, workers=addresses[:1]))  # 1 and 2 leave
        steps_left = 2 * records // batch - len(values)
        values += _train(coordinator, iterator, steps_left)
        coordinator.join()
        trained = [(worker, ids) for worker, ids in (value.fetch() for value in values)]
        counts = collections.Counter(int(i) for _, ids in trained for i in ids)
        assert sorted(counts) == list(range(records))
        assert set(counts.values()) == {2}, {i: n for i, n in counts.items() if n != 2}  # two epochs, once each
        metrics = _input_metrics(coordinator)
        assert metrics["kubeps_input_records_trained"] == 2 * records
        assert metrics["kubeps_input_records_lost"] == 0
        # read again: the records of the functions re-run after worker 1 was lost (whether the lost run had pushed
        # its step is not known), whole batches
        retried = coordinator._queue.counters()["retried"]
        assert metrics["kubeps_input_records_reread"] % batch == 0
        assert metrics["kubeps_input_records_reread"] <= batch * retried
        print(f"{source}: {2 * records} records trained, {metrics['kubeps_input_records_reread']:.0f} read again "
              f"(re-runs of a function lost with its worker), {metrics['kubeps_input_records_lost']:.0f} lost")


# -- under kubeps local ----------------------------------------------------------------------------------------------
def _steps(path) -> list[list]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(300)
def test_kubeps_local_trains_every_id_once_while_a_worker_is_killed_one_added_and_two_removed(tmp_path, capsys):
    """A ``kubeps local --restart`` run of two exactly-once datasets (ids of a ``from_tensor_slices``, ids in
    files): worker 1 is killed (SIGKILL) and restarted, the job is scaled 2 -> 3 -> 1, all during the epoch. Every
    id of each dataset is returned by exactly one step; the only records the chief may count read again are those
    of the steps re-run after the kill."""
    from tests.runtime import exactly_once_job as job

    lines, data = tmp_path / "steps.jsonl", tmp_path / "data"
    data.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "1", "--workers", "2", "--restart",
         "--no-metrics", job.__file__, "--", str(lines), str(data)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(launcher.stdout), daemon=True)
    reader.start()
    try:
        victim = wait_for(lambda: next((pid for w, pid, *_ in _steps(lines) if w == 1), None), 120,
                           "a step on worker 1")
        os.kill(victim, signal.SIGKILL)  # while it runs steps: its shards go back from their last commit
        pid = str(launcher.pid)
        assert cli.main(["local", "scale", "--workers", "3", "--pid", pid]) == 0
        wait_for(lambda: (data / "started-2").exists(), 120, "a step on the new worker 2")
        (data / "gate").touch()  # the rest of the epoch may run
        assert cli.main(["local", "scale", "--workers", "1", "--pid", pid]) == 0
        capsys.readouterr()
        assert launcher.wait(timeout=240) == 0, "".join(output)[-3000:]
        reader.join(timeout=10)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = "".join(output)
    steps = _steps(lines)
    assert len(steps) == job.RECORDS // job.BATCH
    for column in (2, 3):  # from_tensor_slices, from_files
        counts = collections.Counter(i for step in steps for i in step[column])
        assert sorted(counts) == list(range(job.RECORDS)) and set(counts.values()) == {1}
    assert re.search(r"restarting worker-1\b", text), text[-3000:]  # the kill was a failure, not a leave
    match = re.search(r"^\[chief-0\] INPUT (.*)$", text, re.M)
    assert match, text[-3000:]
    figures = json.loads(match.group(1))
    assert figures["trained"] == 2 * job.RECORDS and figures["lost"] == 0
    assert figures["reread"] % job.BATCH == 0
    print(f"kubeps local: {figures['trained']} records trained, {figures['reread']} read again, "
          f"{figures['lost']} lost")
