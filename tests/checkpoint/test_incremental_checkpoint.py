"""Incremental checkpoints with real parameter servers: a save writes only the rows changed since the last one (as
deltas over a base in an earlier checkpoint), restore reads base + deltas into any number of ps and shards,
``max_to_keep`` never deletes a base a kept checkpoint needs, and chains are compacted by full saves."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kubeps.runtime.checkpoint import (Checkpoint, CheckpointCorruptError, CheckpointManager, StepCounter,
                                       verify_checkpoint)
from kubeps.runtime.checkpoint.incremental import IncrementalPolicy
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.ops.optimizers import Adagrad
from kubeps.runtime.variables.partitioners import FixedShardsPartitioner
from kubeps.runtime.variables.push import IndexedSlices
from kubeps.runtime.variables.variable import Variable

pytestmark = pytest.mark.timeout(180)


def _touch(emb, opt, ids) -> None:
    """One sparse Adagrad update of rows ``ids`` (the only rows it changes, with their slot)."""
    ids = np.asarray(ids)
    grads = np.random.default_rng(int(ids.sum())).normal(size=(len(ids), emb.shape[1])).astype(np.float32)
    opt.apply_gradients([(IndexedSlices(grads, ids), emb)])


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _model(cluster, rows=1000, dim=8, shards=4):
    strategy = cluster.strategy(variable_partitioner=FixedShardsPartitioner(shards))
    with strategy.scope():
        emb = Variable(np.random.default_rng(0).normal(size=(rows, dim)).astype(np.float32), name="emb")
    return strategy, emb


def _trained(ps_cluster, tmp_path, rows: int, shards: int, **manager):
    """One ps, ``emb`` trained on every row (its accumulators exist), an incremental manager over it."""
    strategy, emb = _model(ps_cluster(1), rows=rows, shards=shards)
    opt = Adagrad(0.1)
    _touch(emb, opt, np.arange(rows))
    mgr = CheckpointManager(Checkpoint(emb=emb), str(tmp_path / "ckpt"), incremental=True, **manager)
    return strategy, emb, opt, mgr


def test_a_save_writes_only_changed_rows_and_restores_base_plus_deltas_into_other_shard_counts(ps_cluster, tmp_path):
    ckdir = str(tmp_path / "ckpt")
    cluster = ps_cluster(2)
    strategy, emb = _model(cluster, rows=20000, dim=16)
    opt = Adagrad(0.1)
    _touch(emb, opt, np.arange(20000))  # every row and its accumulator exist
    step = StepCounter(1)
    mgr = CheckpointManager(Checkpoint(emb=emb, step=step), ckdir, max_to_keep=None, incremental=True)
    base = mgr.save()
    full_bytes = _dir_bytes(base)

    unchanged = mgr.save()  # nothing changed: no data file at all
    assert _dir_bytes(unchanged) <= 0.01 * full_bytes, (_dir_bytes(unchanged), full_bytes)

    _touch(emb, opt, np.arange(0, 20000, 100))  # 1% of the rows, on every shard
    step.assign(2)
    one_percent = mgr.save()
    assert _dir_bytes(one_percent) <= 0.05 * full_bytes, (_dir_bytes(one_percent), full_bytes)
    manifest = verify_checkpoint(one_percent)
    assert manifest.format_version == 3
    entry = manifest.variables["emb"]
    assert all(s.checkpoint == 0 and [d.checkpoint for d in s.deltas] == [2] for s in entry.slices)
    (group,) = entry.slots.values()
    assert all(len(s.deltas) == 1 for s in group["accumulator"].slices)
    _touch(emb, opt, [5, 6, 7, 19999])
    saved = emb.numpy()
    mgr.save()
    strategy.close()
    cluster.stop()

    # restore into 3 ps and 3 shards: base (ckpt-0) + deltas (ckpt-2, ckpt-3), every row where it was
    second = ps_cluster(3)
    strategy2, emb2 = _model(second, rows=20000, dim=16, shards=3)
    step2 = StepCounter()
    mgr2 = CheckpointManager(Checkpoint(emb=emb2, step=step2), ckdir, incremental=True)
    assert mgr2.restore() == 2
    np.testing.assert_array_equal(emb2.numpy(), saved)
    strategy2.close()


def test_max_to_keep_never_deletes_a_base_a_kept_checkpoint_reads(ps_cluster, tmp_path):
    strategy, emb, opt, mgr = _trained(ps_cluster, tmp_path, 200, 2, max_to_keep=2)
    values = []
    for i in range(6):
        _touch(emb, opt, [i, 100 + i])
        mgr.save()
        values.append(emb.numpy())
    assert [os.path.basename(p) for p in mgr.checkpoints] == ["ckpt-4", "ckpt-5"]
    assert sorted(os.listdir(mgr.directory)) == ["ckpt-4", "ckpt-5"]
    for number, path in zip((4, 5), mgr.checkpoints):  # each kept checkpoint restores alone
        manifest = verify_checkpoint(path)
        assert {s.checkpoint for s in manifest.variables["emb"].slices} <= {4, 5, None}
        emb.assign(np.zeros((200, 8), np.float32))
        mgr.restore(path)
        np.testing.assert_array_equal(emb.numpy(), values[number])
    strategy.close()


def test_chains_are_compacted_by_a_full_save_and_a_restored_ps_saves_in_full(ps_cluster, tmp_path):
    strategy, emb, opt, mgr = _trained(ps_cluster, tmp_path, 100, 1, max_to_keep=None,
                                       policy=IncrementalPolicy(max_deltas=2, compact_fraction=1.0))
    chains = []
    for i in range(5):
        _touch(emb, opt, [i])
        path = mgr.save()
        (s,) = verify_checkpoint(path).variables["emb"].slices
        chains.append((s.checkpoint, len(s.deltas)))
    # ckpt-0 full; 1, 2: deltas over 0; 3: full again (two deltas); 4: a delta over 3
    assert chains == [(None, 0), (0, 1), (0, 2), (None, 0), (3, 1)]
    mgr.restore()  # a restore gives the ps a new change record: the next save is a full one
    _touch(emb, opt, [7])
    (s,) = verify_checkpoint(mgr.save()).variables["emb"].slices
    assert (s.checkpoint, s.deltas) == (None, [])
    strategy.close()


def test_a_corrupt_delta_is_refused_by_name_and_nothing_is_loaded(ps_cluster, tmp_path):
    strategy, emb, opt, mgr = _trained(ps_cluster, tmp_path, 100, 1)
    mgr.save()
    _touch(emb, opt, [3])
    path = mgr.save()
    (s,) = verify_checkpoint(path).variables["emb"].slices
    target = os.path.join(path, s.deltas[0].file)
    data = bytearray(open(target, "rb").read())
    data[-1] ^= 0xFF
    open(target, "wb").write(bytes(data))
    before = emb.numpy()
    with pytest.raises(Exception, match="sha256") as caught:
        mgr.restore(path)
    assert "changed rows of checkpoint 1" in str(caught.value)
    np.testing.assert_array_equal(emb.numpy(), before)
    with pytest.raises(CheckpointCorruptError, match="changed rows of checkpoint 1"):
        verify_checkpoint(path)
    strategy.close()


def test_a_plain_manager_writes_manifests_every_kubeps_reads_and_bad_options_are_refused(tmp_path):
    arr = np.arange(12, dtype=np.float32).reshape(6, 2)
    mgr = CheckpointManager(Checkpoint(arr=arr), str(tmp_path / "a"))
    raw = json.loads(open(os.path.join(mgr.save(), "manifest.json")).read())
    assert raw["format_version"] == 1
    assert set(raw["variables"]["arr"]["slices"][0]) == {"start", "stop", "file", "sha256", "nbytes", "updates"}
    # local arrays keep no change record: an incremental manager saves them in full, as format 1
    inc = CheckpointManager(Checkpoint(arr=arr), str(tmp_path / "b"), incremental=True)
    inc.save()
    assert verify_checkpoint(inc.save()).format_version == 1
    with pytest.raises(RuntimeConfigError, match="CheckpointManager.incremental"):
        CheckpointManager(Checkpoint(arr=arr), str(tmp_path / "c"), incremental="yes")
    with pytest.raises(RuntimeConfigError, match="IncrementalPolicy.max_deltas"):
        IncrementalPolicy(max_deltas=0)
    with pytest.raises(RuntimeConfigError, match="IncrementalPolicy.compact_fraction"):
        IncrementalPolicy(compact_fraction=2.0)


def test_a_delta_whose_slots_the_parent_lacks_is_saved_again_in_full(ps_cluster, tmp_path):
    cluster = ps_cluster(1)
    strategy, emb = _model(cluster, rows=100, shards=2)
    opt = Adagrad(0.1)
    _touch(emb, opt, [1, 2])  # only shard 0 has accumulators: the checkpoint holds no slot of emb
    mgr = CheckpointManager(Checkpoint(emb=emb), str(tmp_path / "ckpt"), incremental=True)
    assert verify_checkpoint(mgr.save()).variables["emb"].slots == {}
    _touch(emb, opt, [3])  # shard 0's delta carries accumulator rows its parent does not hold
    _touch(emb, opt, [60])  # shard 1's first push makes its accumulators: every row changed, a full save
    manifest = verify_checkpoint(mgr.save())
    entry = manifest.variables["emb"]
    assert [(s.checkpoint, s.deltas) for s in entry.slices] == [(None, []), (None, [])]
    (group,) = entry.slots.values()
    assert [(s.checkpoint, s.deltas) for s in group["accumulator"].slices] == [(None, []), (None, [])]
    saved = emb.numpy()
    emb.assign(np.zeros((100, 8), np.float32))
    mgr.restore()
    np.testing.assert_array_equal(emb.numpy(), saved)
    strategy.close()


def test_an_asynchronous_save_returns_at_once_takes_the_step_of_its_call_and_the_next_save_waits_for_it(ps_cluster,
                                                                                                        tmp_path):
    strategy, emb, opt, mgr = _trained(ps_cluster, tmp_path, 400, 2)
    step = StepCounter(7)
    mgr = CheckpointManager(Checkpoint(emb=emb, step=step), mgr.directory, incremental=True)
    path = mgr.save(wait=False)
    step.assign(8)  # after the call: not in that checkpoint
    _touch(emb, opt, [1, 2])  # training goes on meanwhile
    mgr.wait()
    assert verify_checkpoint(path).step == 7 and mgr.latest_checkpoint == path
    second = mgr.save(wait=False)
    third = mgr.save()  # waits for the second first
    assert [verify_checkpoint(p).step for p in (second, third)] == [8, 8]
    with pytest.raises(RuntimeConfigError, match="CheckpointManager.save.wait"):
        mgr.save(wait="no")
    strategy.close()
