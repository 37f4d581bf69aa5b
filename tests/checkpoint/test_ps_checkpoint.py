"""Checkpoints with real parameter servers: every PS writes its shards, restore re-partitions into another
number of PS and shards, slots and update counts come back, corrupt files are refused by the PS."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kubeps.runtime.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointReader,
    StepCounter,
    verify_checkpoint,
)
from kubeps.runtime.errors import RemoteError, RuntimeConfigError
from kubeps.runtime.ops.optimizers import Adagrad, AdamW, Nadam, RMSprop
from kubeps.runtime.variables.partitioners import FixedShardsPartitioner
from kubeps.runtime.variables.push import IndexedSlices
from kubeps.runtime.variables.variable import Variable

pytestmark = pytest.mark.timeout(120)


def _train(emb, w, opt, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, emb.shape[0], size=6)
        opt.apply_gradients([
            (IndexedSlices(rng.normal(size=(6, emb.shape[1])).astype(np.float32), ids), emb),
            (rng.normal(size=w.shape).astype(np.float32), w),
        ])


def test_save_on_ps_restore_into_other_ps_and_shard_counts(ps_cluster, tmp_path):
    ckdir = tmp_path / "ckpt"
    first = ps_cluster(2)
    strategy = first.strategy(variable_partitioner=FixedShardsPartitioner(5))
    init = np.random.default_rng(0).normal(size=(13, 4)).astype(np.float32)
    with strategy.scope():
        emb = Variable(init, name="emb")
        w = Variable(np.ones(3, np.float32), name="w")
    opt = Adagrad(0.1)
    step = StepCounter()
    _train(emb, w, opt, 5, seed=1)
    step.assign(5)
    mgr = CheckpointManager(Checkpoint(model=[emb, w], step=step), str(ckdir))
    path = mgr.save()
    saved_emb, saved_w = emb.numpy(), w.numpy()
    manifest = verify_checkpoint(path)
    assert manifest.step == 5
    assert [(s.start, s.stop) for s in manifest.variables["model/emb"].slices] == \
        [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]
    (slot_group,) = manifest.variables["model/emb"].slots.values()
    assert set(slot_group) == {"accumulator"}
    assert [s.updates for s in manifest.variables["model/w"].slices] == [5, 5, 5]
    acc = CheckpointReader(path).get("model/emb", slot="accumulator")
    assert acc.shape == (13, 4) and (acc > 0.1).any()
    strategy.close()
    first.stop()

    # a new cluster: 3 PS, 2 shards
    second = ps_cluster(3)
    strategy2 = second.strategy(variable_partitioner=FixedShardsPartitioner(2))
    with strategy2.scope():
        emb2 = Variable(np.zeros((13, 4), np.float32), name="emb")
        w2 = Variable(np.zeros(3, np.float32), name="w")
    assert emb2.num_shards == 2
    step2 = StepCounter()
    mgr2 = CheckpointManager(Checkpoint(model=[emb2, w2], step=step2), str(ckdir))
    assert mgr2.restore() == 5 and step2.value == 5
    np.testing.assert_array_equal(emb2.numpy(), saved_emb)
    np.testing.assert_array_equal(w2.numpy(), saved_w)
    listing = {}
    for ps in range(3):
        meta, _ = strategy2.transport.call(ps, "ListVariables")
        listing.update({v["name"]: v["updates"] for v in meta["variables"]})
    # update counts come back (learning-rate schedules and Adam's bias correction depend on them)
    assert sorted(listing) == ["emb/part_0", "emb/part_1", "w/part_0", "w/part_1"]
    assert listing["w/part_0"] == listing["w/part_1"] == 5
    # the slots came back too: a second save from the new layout holds the same accumulator
    path2 = mgr2.save()
    np.testing.assert_array_equal(CheckpointReader(path2).get("model/emb", slot="accumulator"), acc)
    # and training continues from the restored slots exactly as it would have in the first cluster
    _train(emb2, w2, opt, 2, seed=7)
    assert not np.array_equal(emb2.numpy(), saved_emb)
    strategy2.close()


@pytest.mark.parametrize("opt", [
    RMSprop(0.01, rho=0.8, momentum=0.5, centered=True, weight_decay=0.01),
    Nadam(0.01, beta_1=0.8),
    AdamW(0.01, weight_decay=0.1),
], ids=lambda o: type(o).__name__)
def test_slots_of_keras_optimizers_are_saved_and_repartitioned_so_training_goes_on_as_if_uninterrupted(
        ps_cluster, tmp_path, opt):
    """Slots and update counts (Nadam's momentum schedule and the bias corrections read them) saved from 2 ps in 3
    shards, restored into 1 ps in 2 shards: the next updates equal those of the run that was not interrupted."""
    init = np.random.default_rng(0).normal(size=(11, 3)).astype(np.float32)
    first = ps_cluster(2)
    strategy = first.strategy(variable_partitioner=FixedShardsPartitioner(3))
    with strategy.scope():
        emb = Variable(init, name="emb")
        w = Variable(np.ones((4, 2), np.float32), name="w")
    _train(emb, w, opt, 4, seed=1)
    path = CheckpointManager(Checkpoint(model=[emb, w]), str(tmp_path / "ckpt")).save()
    (group,) = verify_checkpoint(path).variables["model/emb"].slots.values()
    assert set(group) == set(opt.slot_names())
    _train(emb, w, opt, 3, seed=2)
    want_emb, want_w = emb.numpy(), w.numpy()
    strategy.close()
    first.stop()

    second = ps_cluster(1)
    strategy2 = second.strategy(variable_partitioner=FixedShardsPartitioner(2))
    with strategy2.scope():
        emb2 = Variable(np.zeros((11, 3), np.float32), name="emb")
        w2 = Variable(np.zeros((4, 2), np.float32), name="w")
    Checkpoint(model=[emb2, w2]).restore(path)
    _train(emb2, w2, opt, 3, seed=2)
    np.testing.assert_allclose(emb2.numpy(), want_emb, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(w2.numpy(), want_w, rtol=1e-6, atol=1e-7)
    strategy2.close()

def test_ps_refuses_corrupt_and_mismatched_checkpoints(ps_cluster, tmp_path):
    cluster = ps_cluster(1)
    strategy = cluster.strategy(variable_partitioner=FixedShardsPartitioner(2))
    with strategy.scope():
        emb = Variable(np.arange(20, dtype=np.float32).reshape(10, 2), name="emb")
    path = CheckpointManager(Checkpoint(emb=emb), str(tmp_path)).save()
    emb.assign(np.zeros((10, 2), np.float32))
    files = json.loads(open(os.path.join(path, "manifest.json")).read())["variables"]["emb"]["slices"]
    victim = os.path.join(path, files[1]["file"])
    raw = bytearray(open(victim, "rb").read())
    raw[-1] ^= 0x55
    open(victim, "wb").write(bytes(raw))
    with pytest.raises(RemoteError, match=r"RestoreShards: .*variable 'emb'.*sha256"):
        Checkpoint(emb=emb).restore(path)
    with pytest.raises(CheckpointCorruptError):
        verify_checkpoint(path)
    with strategy.scope():
        other = Variable(np.zeros((9, 2), np.float32), name="emb9")
    with pytest.raises(CheckpointMismatchError, match=r"'emb': expected shape \[9, 2\].*shape \[10, 2\]"):
        Checkpoint(emb=other).restore(path)
    strategy.close()


def test_a_checkpoint_of_ps_variables_refuses_a_directory_outside_the_roots_before_anything_is_written(
        ps_cluster, tmp_path, monkeypatch):
    """The chief's KUBEPS_CHECKPOINT_ROOT (the ps's roots, as kubeps local and the operator give it) is checked when
    a CheckpointManager is made and when a plain Checkpoint writes or restores, not at the parameter servers' first
    refusal; the error names the field, the value and the roots. A checkpoint of local arrays only is not confined."""
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    monkeypatch.setenv("KUBEPS_CHECKPOINT_ROOT", str(root))
    strategy = ps_cluster(1).strategy()
    with strategy.scope():
        w = Variable(np.ones(3, np.float32), name="w")
    checkpoint = Checkpoint(w=w)
    with pytest.raises(RuntimeConfigError, match=rf"'CheckpointManager directory' has invalid value '{outside}'.*"
                                                  rf"checkpoint roots \['{root}'\]"):
        CheckpointManager(checkpoint, str(outside))
    with pytest.raises(RuntimeConfigError, match=r"'CheckpointManager directory' has invalid value 'relative'.*"
                                                  r"confined to"):  # resolved against the chief's directory
        CheckpointManager(checkpoint, "relative")
    with pytest.raises(RuntimeConfigError, match=r"'Checkpoint.write path'.*KUBEPS_CHECKPOINT_ROOT"):
        checkpoint.write(str(outside / "ckpt-0"))
    with pytest.raises(RuntimeConfigError, match=r"'Checkpoint.restore path'.*KUBEPS_CHECKPOINT_ROOT"):
        checkpoint.restore(str(outside / "ckpt-0"))
    assert not outside.exists() and not os.path.exists("relative")
    path = CheckpointManager(checkpoint, str(root / "ckpt")).save()
    assert checkpoint.restore(path) is None
    local = Checkpoint(arrays={"a": np.zeros(2, np.float32)})
    CheckpointManager(local, str(outside)).save()  # written by this process: the ps's roots do not apply
    strategy.close()
