"""Fuzzing every RPC handler of a real ps and worker process on loopback: random, truncated, oversized
and wrong-dtype frames, wrong and missing tokens, unknown variables and methods, hostile checkpoint paths.

For every input: no answer is UNKNOWN (nor INTERNAL from a ps: that would be a bug, not a refusal); a refused call
changes no variable (every variable -- value, update count, slot sets -- is read before and after it); both
servers keep answering a correct client; and at the end nothing was written outside the ps's checkpoint root."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kubeps.runtime.cluster import TFConfig
from kubeps.runtime.local.launcher import free_ports
from kubeps.runtime.ops.optimizers import SGD, Adam
from kubeps.runtime.rpc import wire
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.protocol import PS, PS_SERVICE, UNARY_PREFIX, WORKER, WORKER_SERVICE

from .test_fuzz_parsers import json_values

pytestmark = pytest.mark.timeout(600)
TOKEN = "kubeps-fuzz-token-0123456789abcdef"
VARIABLES = {"f": np.arange(12, dtype=np.float32).reshape(4, 3), "i": np.arange(3, dtype=np.int32),
             "s": np.array(2.0), "e": np.ones((10, 2), np.float32)}


def _tree(top: Path, skip: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in top.rglob("*") if skip not in p.parents and p != skip}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    sandbox = tmp_path_factory.mktemp("sandbox")
    root = sandbox / "root"
    root.mkdir()
    ps_port, worker_port = free_ports(2)
    cluster = {"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{worker_port}"]}
    procs = []
    for job in ("ps", "worker"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEPS_")}
        env.update(TF_CONFIG=TFConfig.for_task(cluster, job, 0).to_json(), KUBEPS_JOB_TOKEN=TOKEN,
                   KUBEPS_BIND_HOST="127.0.0.1", KUBEPS_CHECKPOINT_ROOT=str(root), KUBEPS_LOG_LEVEL="ERROR",
                   KUBEPS_STREAM_IDLE_TIMEOUT_S="2", KUBEPS_MAX_REQUEST_BYTES=str(8 << 20))
        log = open(sandbox.parent / f"{sandbox.name}-{job}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "kubeps.runtime.server"], env=env, cwd=sandbox,
                                      stdout=log, stderr=subprocess.STDOUT))
    ps = Client(cluster["ps"][0], PS_SERVICE, TOKEN, timeout=10)
    worker = Client(cluster["worker"][0], WORKER_SERVICE, TOKEN, timeout=10)
    deadline = time.monotonic() + 60
    for client in (ps, worker):
        while True:
            try:
                client.call("Ping", timeout=2)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    ps.call(PS.CREATE_VARIABLES, {"names": list(VARIABLES)}, list(VARIABLES.values()))
    ps.call(PS.PUSH, {"optimizer": Adam(0.1).get_config(), "updates": [{"name": "f"}]}, [np.ones((4, 3), np.float32)])
    channels = {job: grpc.insecure_channel(cluster[job][0]) for job in cluster}
    before = _tree(sandbox, root)
    yield SimpleNamespace(ps=ps, worker=worker, channels=channels, root=root, counts={})
    try:
        assert _tree(sandbox, root) == before, "a fuzzed call wrote outside the checkpoint root"
    finally:
        for channel in channels.values():
            channel.close()
        ps.close()
        worker.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


#: what ListVariables says of a variable that is its traffic, not its state: reading it to compare changes it
TRAFFIC = {"rows_read", "bytes_read", "rows_pushed", "bytes_pushed"}


def everything(ps: Client) -> list:
    meta, _ = ps.call(PS.LIST_VARIABLES)
    names = sorted(v["name"] for v in meta["variables"])
    _, values = ps.call(PS.READ, {"names": names})
    state = [{k: v for k, v in info.items() if k not in TRAFFIC} for info in meta["variables"]]
    return [state, [(v.dtype.str, v.shape, v.tobytes()) for v in values]]


names = st.one_of(st.sampled_from(list(VARIABLES) + ["nope", "", "f/part_0"]), st.text(max_size=6))
name_lists = st.one_of(st.lists(names, max_size=4), json_values)
directories = st.one_of(st.sampled_from(["../../x", "root/../escaped", "file://x", "file:y", "/tmp", "relative",
                                         "s3://bucket/x", "memory://m", ""]),
                        st.builds(lambda rest: f"{{root}}/{rest}", st.sampled_from(["ckpt", "../out", "a/../../b",
                                                                                     "./c", "d/"])), json_values)
optimizers = st.one_of(st.sampled_from([SGD(0.1).get_config(), Adam(0.01).get_config(),
                                        {"class_name": "SGD", "config": {"learning_rate": {
                                            "class_name": "ExponentialDecay", "config": {
                                                "initial_learning_rate": 1.0, "decay_steps": 1,
                                                "decay_rate": 1e300}}}}]), json_values)
updates = st.lists(st.one_of(st.fixed_dictionaries({"name": names}, optional={"kind": st.sampled_from(
    ["dense", "sparse", "other"])}), json_values), max_size=3)
items = st.lists(st.one_of(st.fixed_dictionaries({
    "key": names, "name": names, "start": st.one_of(st.integers(-1, 5), json_values),
    "stop": st.one_of(st.integers(0, 11), json_values), "shape": st.one_of(st.lists(st.integers(0, 12), max_size=2),
                                                                           json_values)}), json_values), max_size=2)
metas = st.fixed_dictionaries({}, optional={
    "names": name_lists, "rows": name_lists, "ops": st.one_of(st.lists(st.sampled_from(["assign", "add", "x"]),
                                                                       max_size=3), json_values),
    "optimizer": optimizers, "updates": updates, "directory": directories, "items": items, "id": json_values,
    "resource_id": json_values, "junk": json_values, "name": st.one_of(names, json_values),
    "config": st.one_of(st.fixed_dictionaries({"dim": st.sampled_from([1, 8, 2**14, 2**22, 2**31, 2**63 - 1])},
                                              optional={"bloom_counters": st.sampled_from([0, 64, 2**30]),
                                                        "bloom_hashes": st.sampled_from([1, 3, 1000])}),
                        json_values)})
arrays = st.lists(hnp.arrays(st.sampled_from(["float32", "float64", "int32", "int64", "uint64", "complex64", "bool",
                                              "uint8"]),
                             hnp.array_shapes(min_dims=0, max_dims=2, max_side=5)), max_size=3)
PS_METHODS = [PS.CREATE_VARIABLES, PS.READ, PS.READ_ROWS, PS.READ_MANY, PS.ASSIGN, PS.PUSH, PS.PUSH_READ,
              PS.LIST_VARIABLES, PS.SAVE_SHARDS, PS.RESTORE_SHARDS, PS.SAVE_DYNAMIC, PS.RESTORE_DYNAMIC,
              PS.CREATE_DYNAMIC, "Ping",
              "Collect", "Nope"]
MUTATING = {PS.CREATE_VARIABLES, PS.ASSIGN, PS.PUSH, PS.PUSH_READ, PS.RESTORE_SHARDS, PS.RESTORE_DYNAMIC}
WORKER_METHODS = [WORKER.RUN_CLOSURE, WORKER.RUN_CLOSURES, WORKER.CREATE_RESOURCE, "Ping", "Collect", "Nope"]


def _mutate(frame: bytes, how: str, data) -> list[bytes]:
    if how == "truncate":
        return [frame[: data.draw(st.integers(0, max(0, len(frame) - 1)))]]
    if how == "oversize":  # declare a far bigger data section than what is sent
        length = struct.unpack_from("<4sI", frame)[1]
        header = json.loads(frame[8 : 8 + length])
        header["data_bytes"] = data.draw(st.sampled_from([1 << 20, 1 << 30, 1 << 40, 2**63 - 1]))
        text = json.dumps(header).encode()
        head = struct.pack("<4sI", wire.MAGIC, len(text)) + text
        return [head + b"\0" * (-len(head) % 8)]
    if how == "dtype":
        return [frame.replace(b'"float32"', b'"object"').replace(b'"int64"', b'"float32"')]
    if how == "deep":  # nested past any parser's recursion limit
        depth = data.draw(st.sampled_from([100, 1000, 5000]))
        text = b'{"meta":{"a":' + b"[" * depth + b"]" * depth + b"}}"
        return [struct.pack("<4sI", wire.MAGIC, len(text)) + text]
    if how == "garbage":
        return [data.draw(st.binary(max_size=64))]
    if how == "split":
        cut = data.draw(st.integers(0, len(frame)))
        return [frame[:cut], frame[cut:]]
    return [frame]


def _like(data, name: str) -> np.ndarray:
    """A tensor for variable ``name``: mostly its shape and dtype, sometimes a near miss."""
    value = VARIABLES.get(name, np.zeros(2, np.float32))
    how = data.draw(st.sampled_from(["same", "same", "nan", "dtype", "shape", "huge"]))
    out = np.full_like(value, data.draw(st.integers(2, 100)))
    if how == "nan" and out.dtype.kind == "f":
        out.flat[0] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    elif how == "dtype":
        out = out.astype(data.draw(st.sampled_from(["complex64", "uint64", "int8", "bool", "float64"])))
        if out.dtype == np.uint64:
            out[...] = 2**64 - 1
    elif how == "shape":
        out = np.ones(out.shape + (1,), out.dtype)
    elif how == "huge" and out.dtype.kind == "f":
        out[...] = np.finfo(out.dtype).max
    return out


@st.composite
def plausible(draw, method: str) -> tuple[dict, list]:
    """A request close to a valid one for ``method``: existing names, tensors shaped like the variables, with one
    thing off (a name unknown or repeated, a NaN, a cast that loses values, a wrong shape, a bad schedule)."""
    data = SimpleNamespace(draw=draw)
    chosen = draw(st.lists(st.sampled_from(list(VARIABLES) + ["nope"]), min_size=1, max_size=3))
    if method in (PS.ASSIGN, PS.CREATE_VARIABLES):
        meta = {"names": chosen}
        if method == PS.ASSIGN and draw(st.booleans()):
            meta["ops"] = [draw(st.sampled_from(["assign", "add"])) for _ in chosen]
        return meta, [_like(data, n) for n in chosen]
    if method in (PS.PUSH, PS.PUSH_READ):
        ups, tensors = [], []
        for name in chosen:
            if draw(st.booleans()) and VARIABLES.get(name, np.zeros(1)).ndim:
                rows = VARIABLES.get(name, np.zeros((2, 2))).shape[0]
                idx = np.array(draw(st.lists(st.integers(-1, rows), min_size=1, max_size=3)))
                vals = np.ones((len(idx),) + VARIABLES.get(name, np.zeros((2, 2))).shape[1:], np.float32)
                if draw(st.booleans()):
                    vals = vals.astype(draw(st.sampled_from(["complex64", "float64", "int64"])))
                ups.append({"name": name, "kind": "sparse"})
                tensors += [idx, vals]
            else:
                ups.append({"name": name})
                tensors.append(_like(data, name))
        meta = {"optimizer": draw(optimizers), "updates": ups}
        if method == PS.PUSH_READ:
            meta["names"] = draw(st.lists(st.sampled_from(list(VARIABLES)), max_size=2))
        return meta, tensors
    if method == PS.READ_ROWS:
        return {"names": chosen}, [np.array(draw(st.lists(st.integers(-1, 11), max_size=3))) for _ in chosen]
    if method in (PS.SAVE_DYNAMIC, PS.RESTORE_DYNAMIC):  # no such table, or a shard or checkpoint entry off
        item: dict = {"key": draw(names), "name": draw(names), "shard": draw(st.integers(-1, 3))}
        if method == PS.RESTORE_DYNAMIC:
            item.update(num_shards=draw(st.integers(0, 3)), table=draw(json_values))
        return {"directory": draw(directories), "items": [item]}, []
    return {"names": chosen, "directory": draw(directories), "items": draw(items)}, []


@given(data=st.data())
def fuzz_one_call(servers, data):
    job = data.draw(st.sampled_from(["ps", "ps", "ps", "worker"]))
    method = data.draw(st.sampled_from(PS_METHODS if job == "ps" else WORKER_METHODS))
    if job == "ps" and data.draw(st.booleans()):
        meta, tensors = data.draw(plausible(method))
    else:
        meta, tensors = data.draw(metas), data.draw(arrays)
    if isinstance(meta.get("directory"), str):
        meta["directory"] = meta["directory"].replace("{root}", str(servers.root))
    frame = b"".join(bytes(s) for s in wire.encode_message(meta, tensors))
    chunks = _mutate(frame, data.draw(st.sampled_from(["none", "none", "truncate", "oversize", "dtype", "garbage",
                                                        "split", "deep"])), data)
    token = data.draw(st.sampled_from([TOKEN, TOKEN, TOKEN, None, "wrong-token-0123456789", TOKEN[:-1] + "X"]))
    metadata = (("x-kubeps-job-token", token),) if token else ()
    unary = len(chunks) == 1 and data.draw(st.booleans())
    service = PS_SERVICE if job == "ps" else WORKER_SERVICE
    channel = servers.channels[job]
    snapshot = everything(servers.ps) if job == "ps" and method in MUTATING else None
    identity = lambda b: b  # noqa: E731
    try:
        if unary:
            channel.unary_unary(f"/{service}/{UNARY_PREFIX}{method}", request_serializer=identity,
                                response_deserializer=identity)(chunks[0], timeout=10, metadata=metadata)
        else:
            for _ in channel.stream_stream(f"/{service}/{method}", request_serializer=identity,
                                           response_deserializer=identity)(iter(chunks), timeout=10,
                                                                           metadata=metadata):
                pass
        code = "OK"
    except grpc.RpcError as err:
        code = err.code().name
        details = err.details() or ""
        assert code != "UNKNOWN", f"{method}: UNKNOWN: {details}"
        assert not (job == "ps" and code == "INTERNAL"), f"{method}: INTERNAL: {details}"
        assert code != "DEADLINE_EXCEEDED", f"{method}: the server did not answer"
        if token != TOKEN:
            assert code == "UNAUTHENTICATED"
        if snapshot is not None:
            assert everything(servers.ps) == snapshot, f"refused {method} ({code}: {details}) changed a variable"
    servers.counts[code] = servers.counts.get(code, 0) + 1
    servers.ps.call("Ping", timeout=5)  # still serving correct clients
    servers.worker.call("Ping", timeout=5)


def test_fuzzed_calls_are_refused_cleanly_and_change_nothing(servers):
    """Hypothesis's calls, each checked as it is answered (above); then, over all of them: the inputs were not all
    refused at the door. (One test, not two that share the module's counts: a test must not depend on another
    having run before it in the same process, which pytest-xdist does not promise.)"""
    fuzz_one_call(servers)
    print("\nstatus codes of the fuzzed calls:", dict(sorted(servers.counts.items())))
    assert sum(servers.counts.values()) >= 20
    assert servers.counts.get("OK", 0) and servers.counts.get("INVALID_ARGUMENT", 0)
    assert servers.counts.get("UNAUTHENTICATED", 0)
