"""Dynamic embedding tables in checkpoints, with real parameter servers: only live rows are saved (with slots,
counts, last-update steps and admission state), a restore re-hashes every key onto another number of ps, training
goes on exactly as it would have, the sidecar evaluator reads the table, and a corrupt or mismatched checkpoint is
refused naming the table while the table keeps its rows."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import kubeps.runtime as kp
from kubeps.runtime.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointReader,
    StepCounter,
    verify_checkpoint,
)
from kubeps.runtime.checkpoint.evaluator import SidecarEvaluator
from kubeps.runtime.errors import RemoteError
from kubeps.runtime.rpc.protocol import PS, RestoreTableItem
from kubeps.runtime.util.keyhash import shard_of
from kubeps.runtime.variables.indexed_slices import IndexedSlices

pytestmark = pytest.mark.timeout(180)

SETTINGS = {"dim": 4, "initializer": {"kind": "normal", "stddev": 0.1, "seed": 3}, "filter_freq": 2,
            "steps_to_live": 6, "sweep_every": 1}


def _rows(table) -> dict[int, tuple]:
    """key -> (value, accumulator, count) of every live row, over all shards."""
    out = {}
    for keys, values, freqs, _, slots, _ in table.export_shards():
        (acc,) = [group["accumulator"] for group in slots.values()]
        for i, k in enumerate(keys.tolist()):
            out[k] = (values[i].tobytes(), acc[i].tobytes(), int(freqs[i]))
    return out


def _ages(table) -> dict[int, int]:
    """key -> updates of its shard since the row was last updated."""
    return {k: updates - int(s) for keys, _, _, steps, _, updates in table.export_shards()
            for k, s in zip(keys.tolist(), steps)}


def _step(table, opt, keys, seed) -> None:
    """A training step: a training lookup (counts, admission) and an Adagrad update of the keys' rows."""
    keys = np.asarray(keys, dtype=np.int64)
    table.lookup(keys, train=True)
    grads = np.random.default_rng(seed).normal(size=(keys.size, 4)).astype(np.float32)
    opt.apply_gradients([(IndexedSlices(grads, keys), table)])


@pytest.fixture
def trained(ps_cluster, tmp_path):
    """A table trained on 2 ps and saved: ``(strategy, table, opt, path, evicted keys, pending keys)``."""
    cluster = ps_cluster(2)
    strategy = cluster.strategy()
    with strategy.scope():
        table = kp.DynamicEmbedding("dyn", **SETTINGS)
    opt = kp.Adagrad(0.1)
    old = 2**40 + np.arange(20) * 7919  # trained once, then left alone: evicted by steps_to_live
    hot = np.arange(1, 200, dtype=np.int64) * 1_000_003
    _step(table, opt, old, 0)
    _step(table, opt, old, 1)  # admitted at the second sighting
    for i in range(8):
        _step(table, opt, hot, 10 + i)
    pending = np.array([5, 6, 7, 2**50 + 1], dtype=np.int64)  # seen once: counted, not admitted
    table.lookup(pending, train=True)
    live = _rows(table)
    assert not set(old.tolist()) & set(live) and set(hot.tolist()) <= set(live)
    assert not set(pending.tolist()) & set(live)
    step = StepCounter(8)
    path = CheckpointManager(Checkpoint(model=[table], step=step), str(tmp_path / "ckpt")).save()
    yield strategy, table, opt, path, old, pending
    strategy.close()


def test_only_live_rows_are_saved_and_restore_into_1_and_3_ps(trained, ps_cluster):
    strategy, table, opt, path, old, pending = trained
    manifest = verify_checkpoint(path)  # every file checked against its sha256
    assert manifest.format_version == 2 and not manifest.variables
    entry = manifest.dynamic["model/dyn"]
    assert entry.num_shards == 2 and entry.dim == 4 and entry.config["filter_freq"] == 2
    saved = CheckpointReader(path).table("model/dyn")
    keys, values, freqs, _ = saved.export(with_metadata=True)
    assert sorted(keys.tolist()) == sorted(_rows(table))  # the live rows, and nothing evicted
    assert not set(old.tolist()) & set(keys.tolist())
    for shard in entry.shards:  # every shard holds the keys the hash gives it
        k = CheckpointReader(path).table("model/dyn")
        assert shard.rows == int(np.count_nonzero(shard_of(k.keys, 2) == shard.shard))
    expected, ages = _rows(table), _ages(table)

    for num_ps in (1, 3):
        cluster = ps_cluster(num_ps)
        other = cluster.strategy()
        with other.scope():
            restored = kp.DynamicEmbedding("dyn", **SETTINGS)
        step = StepCounter()
        assert CheckpointManager(Checkpoint(model=[restored], step=step), os.path.dirname(path)).restore() == 8
        assert restored.num_shards == num_ps and step.value == 8
        # every live row: the same value, accumulator and count, on the ps its key hashes to now
        assert _rows(restored) == expected
        assert _ages(restored) == ages  # LRU and steps_to_live see the same ages
        for ps, (keys_ps, *_rest) in enumerate(restored.export_shards()):
            assert (shard_of(keys_ps, num_ps) == ps).all()
        # admission state came back: a key seen once before the save is admitted at its second sighting
        restored.lookup(pending[:2], train=True)
        table.lookup(pending[:2], train=True)
        # and training goes on exactly as it would have on the 2 ps
        hot = np.array(sorted(expected)[:50], dtype=np.int64)
        for t in (table, restored):
            _step(t, opt, np.concatenate([hot, pending[:2]]), 99)
        assert _rows(restored) == _rows(table)
        other.close()
        cluster.stop()
        # the 2-ps table is put back to the checkpoint for the next round
        Checkpoint(model=[table]).restore(path)
        assert _rows(table) == expected


def test_sidecar_evaluator_reads_the_table(trained, tmp_path):
    _, table, _, path, old, _ = trained
    keys, values = table.export()
    unseen = np.array([123, 456], dtype=np.int64)

    def eval_fn(checkpoint, batches):
        saved = checkpoint["model/dyn"]  # the rows straight from the files
        rows = saved.lookup(np.concatenate([keys, unseen, old[:1]]))
        # restored into a table in this process, as an evaluator task restores its local model
        local = kp.DynamicEmbedding("dyn", **SETTINGS)
        Checkpoint(model=[local]).restore(checkpoint.path)
        layer_rows = kp.nn.DynamicEmbeddingLayer(local).forward(np.concatenate([keys, unseen]))
        return {"rows": int(saved.size()), "same": bool(np.array_equal(rows[: keys.size], values)),
                "default": bool((rows[keys.size:] == 0).all()),
                "local_same": bool(np.array_equal(layer_rows[: keys.size], values)),
                "local_default": bool((layer_rows[keys.size:] == 0).all()), "local_rows": local.size()}

    ev = SidecarEvaluator(eval_fn, [0], os.path.dirname(path), max_evaluations=1, poll_interval=0.05, timeout=20,
                          metrics_path=str(tmp_path / "metrics.jsonl"))
    (record,) = ev.start()
    assert record["metrics"] == {"rows": keys.size, "same": True, "default": True, "local_same": True,
                                 "local_default": True, "local_rows": keys.size}  # unseen ids created nothing


def test_corrupt_and_mismatched_checkpoints_are_refused_naming_the_table(trained, tmp_path):
    strategy, table, _, path, _, _ = trained
    before = _rows(table)
    with strategy.scope():
        wide = kp.DynamicEmbedding("dyn3", **{**SETTINGS, "dim": 3})
    with pytest.raises(CheckpointMismatchError, match=r"dynamic table 'model/dyn': expected dim 3 .* has dim 4"):
        Checkpoint(model={"dyn": wide}).restore(path)
    with strategy.scope():
        stranger = kp.DynamicEmbedding("other", **SETTINGS)
    with pytest.raises(CheckpointMismatchError, match=r"dynamic table 'model/other' is not in checkpoint .*'model/dyn'"):
        Checkpoint(model=[stranger]).restore(path)
    with pytest.raises(CheckpointMismatchError, match=r"'model/dyn' .* is a dynamic embedding table"):
        CheckpointReader(path).get("model/dyn")

    # a value file of shard 1 damaged: refused before any ps changes, naming the table, the shard and the part
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    victim = os.path.join(path, manifest["dynamic"]["model/dyn"]["shards"][1]["values"]["slices"][0]["file"])
    good = open(victim, "rb").read()
    raw = bytearray(good)
    raw[-1] ^= 0x55
    open(victim, "wb").write(bytes(raw))
    table.lookup(np.array([1_000_003], dtype=np.int64), train=True)  # something to lose
    live = _rows(table)
    with pytest.raises(CheckpointCorruptError, match=r"dynamic table 'model/dyn' shard 1 values: .*sha256"):
        Checkpoint(model=[table]).restore(path)
    assert _rows(table) == live
    with pytest.raises(CheckpointCorruptError, match="dynamic table 'model/dyn' shard 1 values"):
        verify_checkpoint(path)
    # the ps checks what it reads too: asked directly, it refuses and keeps its rows
    entry = CheckpointReader(path).manifest.dynamic["model/dyn"].model_dump(mode="json")
    item = RestoreTableItem(key=table.key, name="model/dyn", shard=1, num_shards=2, table=entry)
    with pytest.raises(RemoteError, match=r"RestoreDynamic: .*dynamic table 'model/dyn' shard 1 values.*sha256"):
        strategy.transport.call(1, PS.RESTORE_DYNAMIC, {"directory": path, "items": [item]})
    assert _rows(table) == live
    open(victim, "wb").write(good)

    # the shards' entries swapped in the manifest: keys on the wrong shard are refused, not silently misplaced
    shards = manifest["dynamic"]["model/dyn"]["shards"]
    shards[0], shards[1] = {**shards[1], "shard": 0}, {**shards[0], "shard": 1}
    open(os.path.join(path, "manifest.json"), "w").write(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match=r"dynamic table 'model/dyn': shard 0 of 2 holds key .* puts on shard 1"):
        Checkpoint(model=[table]).restore(path)
    assert _rows(table) == live
    assert before != live  # the lookup after the save changed a count; no refused restore took it back


# -- in this process: no parameter servers ---------------------------------------------------------------------
def _local_table(**kwargs):
    return kp.DynamicEmbedding("dyn", **{**SETTINGS, "steps_to_live": 0, **kwargs})


@pytest.mark.parametrize("counting", ["exact", "bloom"])
def test_a_local_table_keeps_its_admission_state(tmp_path, counting):
    extra = {"bloom_counters": 4096} if counting == "bloom" else {}
    table = _local_table(**extra)
    opt = kp.Adagrad(0.1)
    _step(table, opt, [1, 2, 3], 0)
    _step(table, opt, [1, 2], 1)  # 1 and 2 admitted; 3 seen once
    path = Checkpoint(t=table).write(str(tmp_path / "ckpt-0"))
    entry = CheckpointReader(path).manifest.dynamic["t"]
    assert (entry.shards[0].bloom is not None) == (counting == "bloom")
    assert (entry.shards[0].pending_keys is not None) == (counting == "exact")
    restored = _local_table(**extra)
    Checkpoint(t=restored).restore(path)
    assert _rows(restored) == _rows(table) and restored.size() == 2
    for t in (table, restored):
        t.lookup(np.array([3]), train=True)  # its second sighting: admitted in both
    assert _rows(restored) == _rows(table) and restored.size() == 3


def test_a_smaller_capacity_keeps_the_most_recently_updated_rows(tmp_path):
    table = _local_table()
    opt = kp.Adagrad(0.1)
    for i in range(4):
        _step(table, opt, [10 + i], i)
        _step(table, opt, [10 + i], i)  # admitted at the second sighting, updated at the second update
    path = Checkpoint(t=table).write(str(tmp_path / "ckpt-0"))
    small = _local_table(capacity=2)
    Checkpoint(t=small).restore(path)
    assert sorted(small.export()[0].tolist()) == [12, 13]


def test_manifest_versions_and_export_name_the_table(tmp_path):
    from kubeps.runtime.checkpoint import CheckpointCorruptError as Corrupt
    from kubeps.runtime.checkpoint.format import read_manifest
    from kubeps.runtime.models import export

    table = _local_table()
    for i in range(2):
        _step(table, kp.Adagrad(0.1), [1, 2], i)
    fixed = kp.Variable(np.ones(2, np.float32), name="w")
    path = Checkpoint(model={"dyn": table, "w": fixed}).write(str(tmp_path / "ckpt-0"))
    assert export.dynamic_tables(path) == ["model/dyn"]
    fn = export.ServingFunction(lambda p, x: x, {"emb": "model/dyn"}, [("x", (None, 2), "float32")])
    with pytest.raises(CheckpointMismatchError, match="'model/dyn' .* is a dynamic embedding table"):
        export.load_params(fn, path)
    raw = json.loads(open(os.path.join(path, "manifest.json")).read())
    assert raw["format_version"] == 2
    # a checkpoint without tables stays version 1: every kubeps reads it
    plain = Checkpoint(w=fixed).write(str(tmp_path / "ckpt-1"))
    assert json.loads(open(os.path.join(plain, "manifest.json")).read())["format_version"] == 1
    raw["format_version"] = 1
    open(os.path.join(path, "manifest.json"), "w").write(json.dumps(raw))
    with pytest.raises(Corrupt, match="format_version 1 cannot hold dynamic tables"):
        read_manifest(path)
    raw["format_version"] = 2
    raw["dynamic"]["model/dyn"]["shards"][0]["rows"] += 1
    open(os.path.join(path, "manifest.json"), "w").write(json.dumps(raw))
    with pytest.raises(Corrupt, match="dynamic.model/dyn.shards.0: .*keys has shape"):
        read_manifest(path)


def test_a_corrupt_table_changes_no_variable_either(tmp_path):
    table = _local_table(filter_freq=1)
    weights = np.arange(4, dtype=np.float32)
    _step(table, kp.Adagrad(0.1), [1, 2, 3], 0)
    path = Checkpoint(t=table, w=weights).write(str(tmp_path / "ckpt-0"))
    shard = CheckpointReader(path).manifest.dynamic["t"].shards[0]
    victim = os.path.join(path, shard.freqs.slices[0].file)
    raw = bytearray(open(victim, "rb").read())
    raw[-1] ^= 0x01
    open(victim, "wb").write(bytes(raw))
    weights[:] = -1
    rows = _rows(table)
    with pytest.raises(CheckpointCorruptError, match="dynamic table 't' shard 0 freqs: .*sha256"):
        Checkpoint(t=table, w=weights).restore(path)
    assert (weights == -1).all() and _rows(table) == rows


def _narrow(shard: dict, dim: int) -> dict:
    """A saved shard's entry claiming rows of ``dim`` (values and slots), consistent in itself."""
    def narrow(t: dict) -> dict:
        return {**t, "shape": [t["shape"][0], dim]}

    slots = {o: {n: narrow(t) for n, t in g.items()} for o, g in shard["slots"].items()}
    init = {o: {n: v[:dim] for n, v in g.items()} for o, g in shard["slot_init"].items()}
    return {**shard, "values": narrow(shard["values"]), "slots": slots, "slot_init": init}


def test_hostile_restore_requests_are_refused_and_change_nothing(trained):
    """RestoreDynamic asked directly with one thing off: refused with a message naming it; the table keeps its rows."""
    strategy, table, _, path, _, _ = trained
    table.lookup(np.array([1_000_003], dtype=np.int64), train=True)
    live = _rows(table)
    good = CheckpointReader(path).manifest.dynamic["model/dyn"].model_dump(mode="json")
    shard0 = good["shards"][0]
    okey = next(iter(shard0["slot_init"]))
    cases = [
        ({"shard": 2}, "shard 2 of 2 does not exist"),
        ({"num_shards": 0}, "shard 0 of 0 does not exist"),
        ({"key": "nope"}, "no dynamic table named 'nope'"),
        ({"table": {**good, "dim": 3, "shards": [_narrow(s, 3) for s in good["shards"]]}}, "holds rows of dim 3"),
        ({"table": {**good, "shards": [{**shard0, "slot_init": {okey: {"accumulator": [0.1]}}},
                                       good["shards"][1]]}}, r"initial row of slot .*accumulator has 1 values"),
        ({"table": {**good, "shards": [{**shard0, "rows": shard0["rows"] + 1}, good["shards"][1]]}},
         "keys has shape"),
    ]
    for change, message in cases:
        raw = {"key": table.key, "name": "model/dyn", "shard": 0, "num_shards": 2, "table": good, **change}
        with pytest.raises(RemoteError, match=message):
            strategy.transport.call(0, "RestoreDynamic", {"directory": path, "items": [raw]})
        assert _rows(table) == live, change
    item = RestoreTableItem(key=table.key, name="model/dyn", shard=0, num_shards=2, table=good)
    with pytest.raises(RemoteError, match="names a shard more than once"):
        strategy.transport.call(0, PS.RESTORE_DYNAMIC, {"directory": path, "items": [item] * 2})
    # the table the item carries is the manifest format's to check: the message names the item's field
    with pytest.raises(RemoteError, match=r"field 'items\[0\]\.table' is not a valid DynamicTableEntry: num_shards"):
        strategy.transport.call(0, PS.RESTORE_DYNAMIC, {"directory": path, "items": [{**item, "table": {
            key: value for key, value in good.items() if key != "num_shards"}}]})
    assert _rows(table) == live
