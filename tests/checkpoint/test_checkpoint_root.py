"""A ps reads and writes checkpoint shards only below its checkpoint root (``KUBEPS_CHECKPOINT_ROOT``,
given by ``kubeps local`` and by the operator); paths are normalised the same way on the chief and on a ps; a refused
``SaveShards`` writes nothing; a refusal says the same whether or not the path exists."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import numpy as np
import pytest

from kubeps.operator.api.models import ReplicaType, parse_spec
from kubeps.operator.core import children
from kubeps.runtime.contract import CHECKPOINT_DIR_ENV, CHECKPOINT_ROOT_ENV
from kubeps.runtime.errors import RemoteError
from kubeps.runtime.local.launcher import LocalCluster as Launcher
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.protocol import PS, PS_SERVICE
from kubeps.runtime.server import Server
from kubeps.runtime.util.storage import StorageError, confine, normalize_path

pytestmark = pytest.mark.timeout(60)
TOKEN = "kubeps-test-token-0123456789abcdef"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rooted_ps(tmp_path: Path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    with _ps_confined_to(str(root), root, tmp_path, monkeypatch) as ps:
        yield ps


@contextlib.contextmanager
def _ps_confined_to(value: str, root: Path, tmp_path: Path, monkeypatch):
    """A ps server in this process with ``KUBEPS_CHECKPOINT_ROOT=value``, and a client of it."""
    monkeypatch.setenv(CHECKPOINT_ROOT_ENV, value)
    monkeypatch.chdir(tmp_path)
    port = _port()
    server = Server({"ps": [f"127.0.0.1:{port}"]}, "ps", 0, token=TOKEN, bind_host="127.0.0.1")
    server.state.create("w", np.arange(6, dtype=np.float32).reshape(3, 2))
    client = Client(f"127.0.0.1:{port}", PS_SERVICE, TOKEN, timeout=10)
    try:
        yield root, client
    finally:
        client.close()
        server.stop(grace=None)


def _files(top: Path) -> set[str]:
    return {str(p.relative_to(top)) for p in top.rglob("*")}


ITEM = {"key": "w", "name": "w", "start": 0, "stop": 3, "shape": [3, 2]}


def test_save_shards_outside_the_root_is_refused_and_writes_nothing(rooted_ps, tmp_path: Path):
    root, client = rooted_ps
    before = _files(tmp_path)
    for directory in ("../../x", f"{root}/../escaped", "file://" + str(tmp_path / "x"), "file:x", "file:" + str(root),
                      str(tmp_path / "elsewhere"), "relative/dir", f"{root}x"):
        with pytest.raises(RemoteError) as info:
            client.call(PS.SAVE_SHARDS, {"directory": directory, "items": [ITEM]})
        assert info.value.code == "INVALID_ARGUMENT", directory
        assert "SaveShards" in str(info.value) and "'directory'" in str(info.value)
    assert _files(tmp_path) == before  # no 'file:' folder, no escaped file
    meta, _ = client.call(PS.SAVE_SHARDS, {"directory": f"file://{root}/ckpt-1", "items": [ITEM]})
    assert meta["saved"] and (root / "ckpt-1").is_dir()


def test_a_symlink_out_of_the_root_is_refused(rooted_ps, tmp_path: Path):
    root, client = rooted_ps
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "link")
    with pytest.raises(RemoteError, match="confined to"):
        client.call(PS.SAVE_SHARDS, {"directory": str(root / "link" / "ckpt"), "items": [ITEM]})
    assert not any((tmp_path / "outside").iterdir())


def test_a_refused_save_leaves_no_file(rooted_ps):
    root, client = rooted_ps
    bad = dict(ITEM, key="w", name="w2", stop=2)  # the second item's rows do not match the shard
    with pytest.raises(RemoteError) as info:
        client.call(PS.SAVE_SHARDS, {"directory": str(root / "ckpt-2"), "items": [ITEM, bad]})
    assert info.value.code == "INVALID_ARGUMENT"
    assert not (root / "ckpt-2").exists() or not any((root / "ckpt-2").iterdir())


def test_refusals_do_not_tell_whether_a_path_exists(rooted_ps, tmp_path: Path):
    _, client = rooted_ps
    (tmp_path / "exists").mkdir()
    messages = []
    for name in ("exists", "missing"):
        with pytest.raises(RemoteError) as info:
            client.call(PS.RESTORE_SHARDS, {"directory": str(tmp_path / name), "items": []})
        messages.append(str(info.value).replace(name, "NAME"))
    assert messages[0] == messages[1]


def test_paths_are_normalised_the_same_way_on_both_sides(tmp_path: Path):
    assert normalize_path(f"file://{tmp_path}/a/") == str(tmp_path / "a")
    assert normalize_path("S3://bucket//run/") == "s3://bucket/run"
    for bad in ("file:x", "file://host/x", "s3://bucket/../other"):
        with pytest.raises(StorageError):
            normalize_path(bad)
    # what the chief sends (normalised) is what the ps accepts (confined)
    assert confine(normalize_path(f"file://{tmp_path}/a"), [str(tmp_path)]) == str(tmp_path / "a")
    assert confine("s3://bucket/run/ckpt-1", ["s3://bucket/run"]) == "s3://bucket/run/ckpt-1"
    with pytest.raises(StorageError):
        confine("s3://bucket/runaway", ["s3://bucket/run"])


def test_kubeps_local_gives_each_task_a_checkpoint_root(tmp_path: Path, monkeypatch):
    monkeypatch.delenv(CHECKPOINT_ROOT_ENV, raising=False)
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    launcher = Launcher(str(script), num_ps=1, num_workers=1)
    assert launcher.task_env("ps", 0)[CHECKPOINT_ROOT_ENV].split(",")[0] == os.getcwd()


def test_a_dynamic_tables_shards_keep_to_the_root_too(rooted_ps, tmp_path: Path):
    root, client = rooted_ps
    client.call(PS.CREATE_DYNAMIC, {"name": "t", "config": {"dim": 2}})
    client.call(PS.LOOKUP_DYNAMIC, {"names": [], "rows": [], "dynamic": [{"name": "t", "train": True}]},
                [np.array([5, 9], dtype=np.int64), np.ones(2, dtype=np.int64)])
    item = {"key": "t", "name": "t", "shard": 0}
    before = _files(tmp_path)
    for method in (PS.SAVE_DYNAMIC, PS.RESTORE_DYNAMIC):
        with pytest.raises(RemoteError) as info:
            client.call(method, {"directory": str(tmp_path / "elsewhere"), "items": [item]})
        assert info.value.code == "INVALID_ARGUMENT" and f"{method}: " in str(info.value)
    assert _files(tmp_path) == before
    meta, _ = client.call(PS.SAVE_DYNAMIC, {"directory": f"{root}/ckpt-1", "items": [item]})
    assert [s["rows"] for s in meta["saved"]] == [2] and (root / "ckpt-1").is_dir()


def _operator_ps_container(volumes: list[dict], mounts: list[dict], env: list[dict] | None = None) -> dict:
    """The main container of ps 0 as the operator makes it, from a PS template with these volumes and mounts."""
    container = {"name": "kubeps", "env": env or [], "volumeMounts": mounts}
    job = {"apiVersion": "kubeps.dev/v1alpha1", "kind": "PSTrainingJob",
           "metadata": {"name": "ckpt", "namespace": "ns", "uid": "uid-1", "generation": 1},
           "spec": {"replicaSpecs": {
               "Chief": {"replicas": 1, "template": {"spec": {"containers": [{"name": "kubeps"}]}}},
               "PS": {"replicas": 1, "template": {"spec": {"volumes": volumes, "containers": [container]}}},
               "Worker": {"replicas": 1, "template": {"spec": {"containers": [{"name": "kubeps"}]}}}}}}
    pod = children.pod_body(job, parse_spec(job["spec"]), ReplicaType.PS, 0, 0, children.PlanConfig())
    return children.main_container(pod["spec"]["containers"])


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def test_the_operator_gives_each_ps_its_checkpoint_dir_and_data_volumes_as_root():
    volumes = [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}}, {"name": "cfg", "configMap": {"name": "x"}},
               {"name": "scratch", "emptyDir": {}}]
    mounts = [{"name": "ckpt", "mountPath": "/ckpt"}, {"name": "cfg", "mountPath": "/etc/cfg"},
              {"name": "scratch", "mountPath": "/scratch"}]
    main = _operator_ps_container(volumes, mounts, [{"name": CHECKPOINT_DIR_ENV, "value": "s3://bucket/run"}])
    # the data volumes and the checkpoint directory; not the ConfigMap, not the operator's TLS mount
    assert _env(main)[CHECKPOINT_ROOT_ENV]["value"] == "s3://bucket/run,/ckpt,/scratch"
    assert children.TLS_VOLUME in {m["name"] for m in main["volumeMounts"]}
    # no data volume, no checkpoint directory: the container's scratch directory only
    assert _env(_operator_ps_container([], []))[CHECKPOINT_ROOT_ENV]["value"] == children.SCRATCH_CHECKPOINT_ROOT
    # a directory from a ConfigMap or Secret: the kubelet expands the reference (defined before it in env)
    by_ref = [{"name": CHECKPOINT_DIR_ENV, "valueFrom": {"configMapKeyRef": {"name": "run", "key": "dir"}}}]
    env = _operator_ps_container([], [], by_ref)["env"]
    names = [e["name"] for e in env]
    root = next(e["value"] for e in env if e["name"] == CHECKPOINT_ROOT_ENV)
    assert root == f"$({CHECKPOINT_DIR_ENV})" and names.index(CHECKPOINT_DIR_ENV) < names.index(CHECKPOINT_ROOT_ENV)
    # the template's own root is kept as written, once
    own = _operator_ps_container(volumes, mounts, [{"name": CHECKPOINT_ROOT_ENV, "value": "gs://b/x"}])
    assert [e for e in own["env"] if e["name"] == CHECKPOINT_ROOT_ENV] == [{"name": CHECKPOINT_ROOT_ENV,
                                                                             "value": "gs://b/x"}]


def test_a_ps_with_the_operators_root_saves_on_its_volume_and_nowhere_else(tmp_path: Path, monkeypatch):
    volume = tmp_path / "volume"
    volume.mkdir()
    main = _operator_ps_container([{"name": "ckpt", "emptyDir": {}}], [{"name": "ckpt", "mountPath": str(volume)}])
    value = _env(main)[CHECKPOINT_ROOT_ENV]["value"]
    assert value == str(volume)
    with _ps_confined_to(value, volume, tmp_path, monkeypatch) as (_, client):
        before = _files(tmp_path)
        with pytest.raises(RemoteError, match="confined to") as info:
            client.call(PS.SAVE_SHARDS, {"directory": str(tmp_path / "image-filesystem"), "items": [ITEM]})
        assert info.value.code == "INVALID_ARGUMENT" and _files(tmp_path) == before
        meta, _ = client.call(PS.SAVE_SHARDS, {"directory": str(volume / "ckpt-1"), "items": [ITEM]})
        assert meta["saved"] and (volume / "ckpt-1").is_dir()
