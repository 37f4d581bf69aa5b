"""Issue 24: a ps reads and writes checkpoint shards only below its checkpoint root (``KUBEPS_CHECKPOINT_ROOT``);
paths are normalised the same way on the chief and on a ps; a refused ``SaveShards`` writes nothing; a refusal
says the same whether or not the path exists."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest

from kubeps.runtime.contract import CHECKPOINT_ROOT_ENV
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
    monkeypatch.setenv(CHECKPOINT_ROOT_ENV, str(root))
    monkeypatch.chdir(tmp_path)
    port = _port()
    server = Server({"ps": [f"127.0.0.1:{port}"]}, "ps", 0, token=TOKEN, bind_host="127.0.0.1")
    server.state.create("w", np.arange(6, dtype=np.float32).reshape(3, 2))
    client = Client(f"127.0.0.1:{port}", PS_SERVICE, TOKEN, timeout=10)
    yield root, client
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
