"""A save that runs out of space: a real small file system (tmpfs of 1 MiB, mounted for the test and unmounted after
it) filled during a save on a real parameter server. The save fails with the file and the bytes, leaves nothing
behind, the previous checkpoint restores bit-exactly, training goes on and the next save, with space again, succeeds."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kubeps.runtime.checkpoint import Checkpoint, CheckpointManager, verify_checkpoint
from kubeps.runtime.errors import RemoteError
from kubeps.runtime.ops.optimizers import Adagrad
from kubeps.runtime.variables.partitioners import FixedShardsPartitioner
from kubeps.runtime.variables.push import IndexedSlices
from kubeps.runtime.variables.variable import Variable

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted (lazily, if busy) however the test ends; skipped where mounting is not allowed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], check=True)


def _fill(directory: Path, leave: int) -> Path:
    """A file taking all the space of ``directory``'s file system but ``leave`` bytes."""
    filler = directory / "filler"
    st = os.statvfs(directory)
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler


def test_a_save_out_of_space_fails_clearly_keeps_the_previous_checkpoint_and_the_next_save_retries(ps_cluster,
                                                                                                   small_fs):
    cluster = ps_cluster(1)
    strategy = cluster.strategy(variable_partitioner=FixedShardsPartitioner(2))
    with strategy.scope():
        emb = Variable(np.random.default_rng(0).normal(size=(2000, 16)).astype(np.float32), name="emb")
    opt = Adagrad(0.1)

    def train(ids) -> None:
        grads = np.random.default_rng(len(ids)).normal(size=(len(ids), 16)).astype(np.float32)
        opt.apply_gradients([(IndexedSlices(grads, np.asarray(ids)), emb)])

    train(np.arange(2000))  # 128 KB of values and 128 KB of accumulators
    mgr = CheckpointManager(Checkpoint(emb=emb), str(small_fs / "ckpt"), max_to_keep=3)
    first = mgr.save()
    saved = emb.numpy()
    filler = _fill(small_fs, 100_000)  # less than the next save needs
    train(np.arange(0, 2000, 3))
    with pytest.raises(RemoteError) as caught:
        mgr.save()
    message = str(caught.value)
    assert "no space to save the checkpoint" in message and "ENOSPC" in message, message
    assert str(small_fs / "ckpt" / "ckpt-1") in message and "bytes" in message
    assert sorted(os.listdir(small_fs / "ckpt")) == ["ckpt-0"]  # nothing of the failed save is left
    assert mgr.checkpoints == [first]
    # an asynchronous save fails the same way: its error comes with the next save, which is not started
    assert mgr.save(wait=False).endswith("ckpt-1")
    train(np.arange(5))
    with pytest.raises(RemoteError, match="no space to save the checkpoint"):
        mgr.save()
    assert sorted(os.listdir(small_fs / "ckpt")) == ["ckpt-0"]

    verify_checkpoint(first)
    latest = emb.numpy()
    emb.assign(np.zeros((2000, 16), np.float32))
    mgr.restore(first)
    np.testing.assert_array_equal(emb.numpy(), saved)  # bit-exact

    emb.assign(latest)
    train(np.arange(10))  # training goes on
    filler.unlink()
    retried = mgr.save()
    assert os.path.basename(retried) == "ckpt-1"
    verify_checkpoint(retried)
    now = emb.numpy()
    emb.assign(np.zeros((2000, 16), np.float32))
    mgr.restore(retried)
    np.testing.assert_array_equal(emb.numpy(), now)
    strategy.close()
