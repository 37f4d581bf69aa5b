"""Checkpoint format with plain numpy arrays: save/restore, re-partitioning, atomic commit, corruption, GC."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kubeps.runtime import checkpoint as ck
from kubeps.runtime.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointReader,
    StepCounter,
    verify_checkpoint,
)
from kubeps.runtime.errors import RuntimeConfigError


def _div_ranges(rows: int, n: int) -> list[tuple[int, int]]:
    base, extra = divmod(rows, n)
    out, pos = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append((pos, pos + size))
        pos += size
    return out


class ShardedArrays:
    """A stand-in sharded variable: a logical array held as n shards, each with optional slots."""

    def __init__(self, name: str, full: np.ndarray, n: int, slots: dict | None = None, updates: int = 0):
        self.name = name
        self.shape = full.shape
        self.dtype = full.dtype
        self.ranges = _div_ranges(full.shape[0], n)
        self.access = ck.ArrayAccess()
        for i, (a, b) in enumerate(self.ranges):
            key = f"{name}/part_{i}"
            self.access.arrays[key] = full[a:b].copy()
            if slots:
                self.access.slots[key] = {ok: {s: v[a:b].copy() for s, v in g.items()} for ok, g in slots.items()}
            self.access.updates[key] = updates + i
        self.executor = ck.LocalExecutor(self.access)

    def full(self) -> np.ndarray:
        return np.concatenate([self.access.arrays[f"{self.name}/part_{i}"] for i in range(len(self.ranges))])

    def full_slot(self, okey: str, slot: str) -> np.ndarray:
        return np.concatenate(
            [self.access.slots[f"{self.name}/part_{i}"][okey][slot] for i in range(len(self.ranges))]
        )


def _adapter(obj: ShardedArrays, path: str):
    return [ck.Saveable(path, tuple(obj.shape), obj.dtype,
                        [ck.ShardRef(a, b, f"{obj.name}/part_{i}", obj.executor)
                         for i, (a, b) in enumerate(obj.ranges)])]


ck.register_saveable(ShardedArrays, _adapter)


def test_round_trip_arrays_scalars_and_step(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(7, 3)).astype(np.float32)
    b = np.arange(3, dtype=np.int64)
    scale = np.array(2.5)
    step = StepCounter(41)
    mgr = CheckpointManager(Checkpoint(model={"w": w, "b": b, "scale": scale}, step=step), tmp_path)
    path = mgr.save()
    assert os.path.basename(path) == "ckpt-0"
    assert mgr.latest_checkpoint == path
    w0, b0 = w.copy(), b.copy()
    w[:] = 0
    b[:] = 0
    scale[...] = 0
    step.assign(0)
    assert mgr.restore() == 41
    np.testing.assert_array_equal(w, w0)
    np.testing.assert_array_equal(b, b0)
    assert float(scale) == 2.5
    assert step.value == 41
    # files are plain .npy
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    assert manifest["format_version"] == ck.FORMAT_VERSION
    f = manifest["variables"]["model/w"]["slices"][0]["file"]
    np.testing.assert_array_equal(np.load(os.path.join(path, f)), w0)


@pytest.mark.parametrize("n_save,n_restore", [(5, 2), (2, 5), (3, 3), (1, 4), (4, 1), (13, 5)])
def test_repartition_between_shard_counts(tmp_path, n_save, n_restore):
    rng = np.random.default_rng(n_save * 10 + n_restore)
    full = rng.normal(size=(13, 4)).astype(np.float32)
    acc = rng.random(size=(13, 4)).astype(np.float32)
    src = ShardedArrays("emb", full, n_save, slots={"adagrad": {"accumulator": acc}}, updates=10)
    path = CheckpointManager(Checkpoint(emb=src), tmp_path).save(step=7)
    dst = ShardedArrays("emb", np.zeros_like(full), n_restore, slots=None)
    assert Checkpoint(emb=dst).restore(path) == 7
    np.testing.assert_array_equal(dst.full(), full)
    np.testing.assert_array_equal(dst.full_slot("adagrad", "accumulator"), acc)
    # the restored update count is the max of the overlapping saved shards'
    for i, (a, b) in enumerate(dst.ranges):
        src_over = [j for j, (c, d) in enumerate(src.ranges) if max(a, c) < min(b, d)]
        assert dst.access.updates[f"emb/part_{i}"] == 10 + max(src_over)
    reader = CheckpointReader(path)
    np.testing.assert_array_equal(reader.get("emb"), full)
    np.testing.assert_array_equal(reader.get("emb", slot="accumulator"), acc)
    np.testing.assert_array_equal(reader.get_rows("emb", 4, 9), full[4:9])


def test_overlapping_math():
    slices = [ck.SliceEntry(start=a, stop=b, file=f"f{a}.npy", sha256="0" * 64, nbytes=0)
              for a, b in _div_ranges(13, 5)]
    got = [(s.start, a, b) for s, a, b in ck.overlapping(slices, 2, 10)]
    assert got == [(0, 2, 3), (3, 3, 6), (6, 6, 9), (9, 9, 10)]
    assert ck.overlapping(slices, 5, 5) == []


def test_manager_numbering_max_to_keep_and_partial_gc(tmp_path):
    x = np.zeros(4)
    mgr = CheckpointManager(Checkpoint(x=x), tmp_path, max_to_keep=2)
    paths = []
    for i in range(4):
        x[:] = i
        paths.append(mgr.save())
    assert [os.path.basename(p) for p in mgr.checkpoints] == ["ckpt-2", "ckpt-3"]
    assert not os.path.exists(paths[0]) and not os.path.exists(paths[1])
    # an interrupted save: a directory with data files but no manifest
    partial = tmp_path / "ckpt-4"
    partial.mkdir()
    (partial / "x-deadbeef.value.0-4.npy").write_bytes(b"half")
    (tmp_path / ".manifest.json.tmp-1-abc").write_bytes(b"{")
    assert mgr.latest_checkpoint == paths[3]  # the partial one is ignored
    x[:] = 99
    assert mgr.restore() is None  # no step counter and no step= given
    np.testing.assert_array_equal(x, np.full(4, 3.0))
    p = mgr.save(10)
    assert os.path.basename(p) == "ckpt-10"
    assert not partial.exists(), "the next save garbage-collects partial checkpoints"
    assert not (tmp_path / ".manifest.json.tmp-1-abc").exists()
    with pytest.raises(CheckpointError, match="already exists"):
        mgr.save(10)


def test_save_number_is_one_more_than_newest(tmp_path):
    x = np.zeros(2)
    mgr = CheckpointManager(Checkpoint(x=x), tmp_path)
    mgr.save(5)
    assert os.path.basename(mgr.save()) == "ckpt-6"


def _saved(tmp_path, **kw):
    rng = np.random.default_rng(3)
    w = rng.normal(size=(6, 2))
    path = CheckpointManager(Checkpoint(w=w), tmp_path).save(**kw)
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    return w, path, os.path.join(path, manifest["variables"]["w"]["slices"][0]["file"])


def test_checksum_mismatch_names_file_and_digests(tmp_path):
    w, path, data = _saved(tmp_path)
    raw = bytearray(open(data, "rb").read())
    raw[-3] ^= 0xFF
    open(data, "wb").write(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=r"variable 'w'.*sha256 [0-9a-f]{64}; the manifest expects"):
        Checkpoint(w=np.zeros_like(w)).restore(path)
    with pytest.raises(CheckpointCorruptError):
        verify_checkpoint(path)


def test_truncated_file(tmp_path):
    w, path, data = _saved(tmp_path)
    raw = open(data, "rb").read()
    open(data, "wb").write(raw[: len(raw) - 10])
    target = np.zeros_like(w)
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        Checkpoint(w=target).restore(path)
    assert not target.any(), "nothing is loaded when a file is corrupt"


def test_missing_data_file(tmp_path):
    w, path, data = _saved(tmp_path)
    os.unlink(data)
    with pytest.raises(CheckpointNotFoundError, match="missing"):
        Checkpoint(w=np.zeros_like(w)).restore(path)


def test_bad_manifest_json_and_schema(tmp_path):
    w, path, _ = _saved(tmp_path)
    mpath = os.path.join(path, "manifest.json")
    good = open(mpath).read()
    open(mpath, "w").write(good[:40])
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        Checkpoint(w=w).restore(path)
    bad = json.loads(good)
    bad["format_version"] = 99
    open(mpath, "w").write(json.dumps(bad))
    with pytest.raises(CheckpointCorruptError, match="format_version 99 is not supported"):
        Checkpoint(w=w).restore(path)
    bad = json.loads(good)
    bad["variables"]["w"]["slices"][0]["stop"] = 4
    open(mpath, "w").write(json.dumps(bad))
    with pytest.raises(CheckpointCorruptError, match="variables.w.*cover rows 0..3.*6 rows"):
        Checkpoint(w=w).restore(path)


def test_incompatible_shape_dtype_missing(tmp_path):
    w, path, _ = _saved(tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"'w': expected shape \[5, 2\] dtype float64.*shape \[6, 2\]"):
        Checkpoint(w=np.zeros((5, 2))).restore(path)
    with pytest.raises(CheckpointMismatchError, match=r"expected shape \[6, 2\] dtype float32.*dtype float64"):
        Checkpoint(w=np.zeros((6, 2), np.float32)).restore(path)
    with pytest.raises(CheckpointMismatchError, match=r"variable 'v' is not in checkpoint .* it holds 'w'"):
        Checkpoint(v=np.zeros((6, 2))).restore(path)
    with pytest.raises(CheckpointMismatchError, match="object 'step' is not in checkpoint"):
        Checkpoint(w=np.zeros((6, 2)), step=StepCounter()).restore(path)


def test_bad_arguments_name_the_value(tmp_path):
    with pytest.raises(RuntimeConfigError, match=r"'CheckpointManager.max_to_keep' has invalid value 0: None \(keep all\) "
                                                 r"or an int >= 1"):
        CheckpointManager(Checkpoint(x=np.zeros(1)), tmp_path, max_to_keep=0)
    with pytest.raises(RuntimeConfigError, match="'CheckpointManager.checkpoint_number' has invalid value -1: an integer >= 0"):
        CheckpointManager(Checkpoint(x=np.zeros(1)), tmp_path).save(-1)
    with pytest.raises(CheckpointError, match="dtype object cannot be checkpointed"):
        CheckpointManager(Checkpoint(x=np.array([object()])), tmp_path).save()
    with pytest.raises(CheckpointError, match="'x' of type set cannot be checkpointed"):
        CheckpointManager(Checkpoint(x={1}), tmp_path).save()


def test_crash_between_data_and_manifest_keeps_previous(tmp_path, monkeypatch):
    x = np.arange(5.0)
    mgr = CheckpointManager(Checkpoint(x=x), tmp_path)
    first = mgr.save()
    x += 1

    def boom(path, manifest):
        raise OSError("disk full")

    monkeypatch.setattr(ck.api, "commit_manifest", boom)
    with pytest.raises(OSError):
        mgr.save()
    monkeypatch.undo()
    assert mgr.latest_checkpoint == first
    x[:] = 0
    mgr.restore()
    np.testing.assert_array_equal(x, np.arange(5.0))
    verify_checkpoint(first)


def test_final_flag_and_reader_objects(tmp_path):
    step = StepCounter(100)
    path = CheckpointManager(Checkpoint(x=np.ones(3), step=step), tmp_path).save(final=True)
    r = CheckpointReader(path)
    assert r.final and r.step == 100
    assert r.objects() == {"step": {"value": 100}}
    assert r.names() == ["x"]


def test_fsspec_memory_filesystem():
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    url = "memory://kubeps-test/run1"
    if fs.exists("/kubeps-test"):
        fs.rm("/kubeps-test", recursive=True)
    full = np.random.default_rng(5).normal(size=(11, 3))
    src = ShardedArrays("emb", full, 3)
    step = StepCounter(9)
    mgr = CheckpointManager(Checkpoint(emb=src, step=step), url, max_to_keep=1)
    mgr.save()
    path = mgr.save(final=True)
    assert path == "memory://kubeps-test/run1/ckpt-1"
    assert mgr.checkpoints == [path]
    assert not fs.exists("/kubeps-test/run1/ckpt-0")
    dst = ShardedArrays("emb", np.zeros_like(full), 2)
    assert Checkpoint(emb=dst).restore(path) == 9
    np.testing.assert_array_equal(dst.full(), full)
    assert verify_checkpoint(path).final
    # corrupt one object in the store
    name = fs.ls("/kubeps-test/run1/ckpt-1", detail=False)
    data = [n for n in name if n.endswith(".npy")][0]
    raw = bytearray(fs.cat(data))
    raw[-1] ^= 1
    fs.pipe(data, bytes(raw))
    with pytest.raises(CheckpointCorruptError, match="sha256"):
        verify_checkpoint(path)
    fs.rm("/kubeps-test", recursive=True)


def test_save_refuses_a_number_below_the_newest_so_max_to_keep_never_deletes_it(tmp_path):
    """Checkpoints are ordered by number (``latest_checkpoint``, ``max_to_keep``, the evaluator): a save numbered
    below the newest committed one would not become the latest and, with ``max_to_keep`` reached, was deleted by
    the sweep right after its own save -- ``save()`` returned the path of a checkpoint that no longer existed."""
    x = np.arange(4.0)
    mgr = CheckpointManager(Checkpoint(x=x), tmp_path, max_to_keep=2)
    mgr.save(checkpoint_number=5)
    newest = mgr.save(checkpoint_number=6)
    with pytest.raises(CheckpointError, match=r"checkpoint_number=3 is invalid.*newest committed checkpoint is 6"):
        mgr.save(checkpoint_number=3)
    assert [os.path.basename(p) for p in mgr.checkpoints] == ["ckpt-5", "ckpt-6"]
    assert mgr.latest_checkpoint == newest
    path = mgr.save(checkpoint_number=9)  # above the newest: fine, and the oldest (ckpt-5) goes
    assert os.path.exists(os.path.join(path, "manifest.json"))
    assert [os.path.basename(p) for p in mgr.checkpoints] == ["ckpt-6", "ckpt-9"]


class _CountingLock:
    """Stands in for npyfiles' lock: counts acquisitions and checks no two threads ever hold it at once."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self.acquired = 0

    def __enter__(self):
        assert self._lock.acquire(timeout=10), "two header parses at once"
        self.acquired += 1
        return self

    def __exit__(self, *exc):
        self._lock.release()


def test_restore_parses_every_npy_header_under_the_process_wide_lock(tmp_path, monkeypatch):
    """numpy parses .npy headers with ast.literal_eval, which races between threads on CPython < 3.11.8
    (SystemError: AST constructor recursion depth mismatch, seen in CI); restores read files from thread pools."""
    from kubeps.runtime.util import npyfiles

    lock = _CountingLock()
    monkeypatch.setattr(npyfiles, "_HEADER_LOCK", lock)
    full = np.arange(13 * 4, dtype=np.float32).reshape(13, 4)
    src = ShardedArrays("emb", full, 5, slots={"adagrad": {"accumulator": full + 1}}, updates=3)
    path = CheckpointManager(Checkpoint(emb=src), tmp_path).save(step=2)
    dst = ShardedArrays("emb", np.zeros_like(full), 2, slots=None)
    assert Checkpoint(emb=dst).restore(path) == 2
    assert lock.acquired >= 5  # one per data file read, at least


def test_no_module_parses_npy_headers_outside_npyfiles():
    from pathlib import Path

    runtime = Path(ck.__file__).parents[1]
    offenders = [p.name for p in runtime.rglob("*.py") if p.name != "npyfiles.py"
                 and any(s in p.read_text() for s in ("np.load(", "read_array_header", "literal_eval"))]
    assert not offenders, f"parse .npy headers through kubeps.runtime.util.npyfiles (thread-safe): {offenders}"


def test_a_file_streamed_chunk_by_chunk_is_byte_for_byte_the_whole_array_s(tmp_path):
    from kubeps.runtime.checkpoint.format import write_array, write_streamed
    from kubeps.runtime.util.storage import storage_for

    storage = storage_for(str(tmp_path))
    value = np.arange(60, dtype=np.float32).reshape(20, 3)
    slot = np.arange(20, dtype=np.float64).reshape(20, 1)
    whole = [write_array(storage, str(tmp_path / "a.npy"), value), write_array(storage, str(tmp_path / "b.npy"), slot)]
    chunks = ([value[i:i + 7], slot[i:i + 7]] for i in range(0, 20, 7))
    streamed = write_streamed(storage, [str(tmp_path / "c.npy"), str(tmp_path / "d.npy")],
                              [(value.shape, value.dtype), (slot.shape, slot.dtype)], chunks)
    assert streamed == whole
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), value)
