"""A refused call changes nothing, and types are strict (an int is an int).

Each test here failed before the fix, one hostile input at a time, against a ps ``Server`` on
loopback; every refused call is checked by reading every variable (value, update count, slot sets) before and
after.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from kubeps.runtime.checkpoint.shards import restore_items, save_items
from kubeps.runtime.errors import RemoteError
from kubeps.runtime.ops.optimizers import SGD, Adam, ExponentialDecay
from kubeps.runtime.ps.state import ParameterServerState
from kubeps.runtime.rpc import wire
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.protocol import PS, PS_SERVICE, RestoreItem, SaveItem
from kubeps.runtime.rpc.validation import RequestError, RequestShape
from kubeps.runtime.server import Server
from kubeps.runtime.settings import TaskSettings

from .conftest import TOKEN, free_ports

pytestmark = pytest.mark.timeout(120)

SGD_CONFIG = SGD(0.1).get_config()


@pytest.fixture(scope="module")
def ps_server():
    port = free_ports(1)[0]
    server = Server({"ps": [f"127.0.0.1:{port}"]}, "ps", 0, token=TOKEN, bind_host="127.0.0.1")
    client = Client(f"127.0.0.1:{port}", PS_SERVICE, TOKEN, timeout=10)
    yield server, client
    client.close()
    server.stop(grace=None)


@pytest.fixture
def ps(ps_server):
    server, client = ps_server
    for name in server.state.names():
        server.state.variables.pop(name)
    client.call(PS.CREATE_VARIABLES, {"names": ["a", "b", "i32", "i64"]},
                [np.zeros(4, np.float32), np.ones((3, 2), np.float32), np.zeros(2, np.int32), np.zeros(2, np.int64)])
    return server, client


def everything(server: Server) -> dict:
    """Every variable with its update count and slots, as a comparable snapshot."""
    out = {}
    for name in server.state.names():
        value, slots, updates = server.state.snapshot(name)
        out[name] = (value.tobytes(), value.dtype.str, value.shape, updates,
                     {k: {s: a.tobytes() for s, a in g.items()} for k, g in slots.items()})
    return out


def refused(client: Client, method: str, meta: dict, arrays: list, code: str = "INVALID_ARGUMENT") -> RemoteError:
    with pytest.raises(RemoteError) as info:
        client.call(method, meta, arrays)
    assert info.value.code == code, str(info.value)
    assert method in str(info.value)
    return info.value


def test_assign_of_two_names_writes_neither_when_the_second_is_refused(ps):
    server, client = ps
    before = everything(server)
    refused(client, PS.ASSIGN, {"names": ["a", "nope"]}, [np.full(4, 7, np.float32), np.ones(4, np.float32)],
            code="NOT_FOUND")
    refused(client, PS.ASSIGN, {"names": ["a", "b"]}, [np.full(4, 7, np.float32), np.ones(5, np.float32)])
    refused(client, PS.ASSIGN, {"names": ["a", "b"], "ops": ["add", "mul"]},
            [np.full(4, 7, np.float32), np.ones((3, 2), np.float32)])
    assert everything(server) == before


def test_push_to_an_int_variable_is_refused_and_the_counter_stays(ps):
    server, client = ps
    before = everything(server)
    err = refused(client, PS.PUSH, {"optimizer": SGD_CONFIG, "updates": [{"name": "i32"}]}, [np.ones(2, np.int32)])
    assert "floating-point" in str(err)
    # a two-update push whose second update is refused leaves the first unapplied
    refused(client, PS.PUSH, {"optimizer": SGD_CONFIG, "updates": [{"name": "a"}, {"name": "i32"}]},
            [np.ones(4, np.float32), np.ones(2, np.int32)])
    assert everything(server) == before
    meta, _ = client.call(PS.PUSH, {"optimizer": SGD_CONFIG, "updates": [{"name": "a"}, {"name": "a"}]},
                          [np.ones(4, np.float32), np.ones(4, np.float32)])
    assert meta["steps"] == [1, 2]


def test_an_overflowing_schedule_is_refused_when_configured_not_on_the_third_push(ps):
    with pytest.raises(ValueError, match="'ExponentialDecay.decay_rate' has invalid value 1e\\+300"):
        ExponentialDecay(1.0, 1, 1e300)  # client side: the optimizer cannot even be built
    server, client = ps
    bad = {"class_name": "SGD", "config": {"learning_rate": {"class_name": "ExponentialDecay", "config": {
        "initial_learning_rate": 1.0, "decay_steps": 1, "decay_rate": 1e300}}}}
    before = everything(server)
    for _ in range(3):
        err = refused(client, PS.PUSH, {"optimizer": bad, "updates": [{"name": "a"}]}, [np.ones(4, np.float32)])
        assert "decay_rate" in str(err) and "Traceback" not in str(err)
    assert everything(server) == before


def test_nonfinite_complex_and_out_of_range_values_are_refused(ps):
    server, client = ps
    before = everything(server)
    for bad in (np.nan, np.inf, -np.inf):
        grad = np.ones(4, np.float32)
        grad[2] = bad
        refused(client, PS.PUSH, {"optimizer": SGD_CONFIG, "updates": [{"name": "a"}]}, [grad])
        refused(client, PS.PUSH, {"optimizer": SGD_CONFIG, "updates": [{"name": "b", "kind": "sparse"}]},
                [np.array([0]), np.array([[1.0, bad]], np.float32)])
    err = refused(client, PS.PUSH, {"optimizer": SGD_CONFIG, "updates": [{"name": "b", "kind": "sparse"}]},
                  [np.array([1]), np.array([[1 + 2j, 3j]], np.complex64)])
    assert "complex64" in str(err)
    err = refused(client, PS.ASSIGN, {"names": ["i64"]}, [np.array([2**64 - 1, 0], np.uint64)])
    assert "uint64" in str(err) and "int64" in str(err)  # no cast at all, as TensorFlow: uint64 max never becomes -1
    assert everything(server) == before
    client.call(PS.ASSIGN, {"names": ["i64"]}, [np.array([5, 0], np.int64)])  # the variable's own dtype is fine
    np.testing.assert_array_equal(server.state.read("i64"), [5, 0])


def test_nonfinite_gradients_are_applied_when_the_ps_allows_them():
    state = ParameterServerState(allow_nonfinite=True, settings=TaskSettings())
    state.create("x", np.zeros(2, np.float32))
    state.push(SGD_CONFIG, [("dense", "x", np.array([np.nan, 1], np.float32))])
    assert np.isnan(state.read("x")[0])


@pytest.mark.parametrize("dim", ["2", 2.0, True])
def test_an_int_is_an_int_in_frame_shapes(ps, dim):
    header = json.dumps({"meta": {"names": ["a"]}, "tensors": [
        {"dtype": "float32", "shape": [dim], "offset": 0, "nbytes": 8}], "data_bytes": 8}).encode()
    head = struct.pack("<4sI", wire.MAGIC, len(header)) + header
    frame = head + b"\0" * (-len(head) % 8) + b"\0" * 8
    with pytest.raises(wire.WireError, match="shape"):
        wire.decode_message(frame)
    server, client = ps
    before = everything(server)
    unary = client._method(PS.ASSIGN, unary=True)
    import grpc

    with pytest.raises(grpc.RpcError) as info:
        unary(frame, timeout=5, metadata=client._metadata)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert everything(server) == before


def test_create_variables_refuses_the_whole_request(ps):
    server, client = ps
    before = everything(server)
    refused(client, PS.CREATE_VARIABLES, {"names": ["new", "new"]}, [np.zeros(1), np.zeros(1)])
    refused(client, PS.CREATE_VARIABLES, {"names": ["new", ""]}, [np.zeros(1), np.zeros(1)])
    assert everything(server) == before


def test_reads_refuse_repeated_names(ps):
    _, client = ps
    err = refused(client, PS.READ_MANY, {"names": ["a"] * 30}, [])
    assert "more than once" in str(err)


def test_restore_refuses_slots_of_the_wrong_trailing_shape(tmp_path):
    state = ParameterServerState(settings=TaskSettings())
    state.create("emb", np.ones((4, 3), np.float32))
    state.push(Adam(0.1).get_config(), [("dense", "emb", np.ones((4, 3), np.float32))])
    (saved,) = save_items(state, str(tmp_path), [SaveItem(key="emb", name="emb", start=0, stop=4, shape=[4, 3])])
    value = {"shape": [4, 3], "dtype": "float32", "slices": [saved.value.model_dump()]}
    slots = {}
    for okey, group in saved.slots.items():
        for sname, (entry, dtype, trailing) in group.items():
            slots.setdefault(okey, {})[sname] = {"shape": [4, 1], "dtype": dtype, "slices": [entry.model_dump()]}
    before = state.snapshot("emb")
    item = RestoreItem(key="emb", name="emb", start=0, stop=4, value=value, slots=slots)
    with pytest.raises(Exception, match="trailing shape"):
        restore_items(state, str(tmp_path), [item])
    after = state.snapshot("emb")
    assert after[2] == before[2] and set(after[1]) == set(before[1])
    state.push(Adam(0.1).get_config(), [("dense", "emb", np.ones((4, 3), np.float32))])  # pushes still work


def test_strict_ints_in_checkpoint_items():
    shape = RequestShape(SaveItem)
    with pytest.raises(RequestError, match="field 'start' has value '0': input should be a valid integer"):
        shape.validate({"key": "a", "name": "a", "start": "0", "stop": 2, "shape": [2]})
    with pytest.raises(RequestError, match=r"field 'shape\[0\]' has value 2.0: input should be a valid integer"):
        shape.validate({"key": "a", "name": "a", "start": 0, "stop": 2, "shape": [2.0]})


def test_restore_items_refuse_a_malformed_entry_naming_its_field(tmp_path):
    """The manifest entries a RestoreItem carries are the manifest format's to check, field by field."""
    state = ParameterServerState(settings=TaskSettings())
    state.create("emb", np.ones((4, 3), np.float32))
    (saved,) = save_items(state, str(tmp_path), [SaveItem(key="emb", name="emb", start=0, stop=4, shape=[4, 3])])
    value = {"shape": [4, 3], "dtype": "float32", "slices": [saved.value.model_dump()]}
    with pytest.raises(ValueError, match=r"field 'items\[1\]\.value' is not a valid TensorEntry: shape: "):
        restore_items(state, str(tmp_path), [RestoreItem(key="emb", name="emb", start=0, stop=4, value=value),
                                             RestoreItem(key="emb", name="emb", start=0, stop=4,
                                                         value={**value, "shape": "4x3"})])
    with pytest.raises(ValueError, match=r"field 'items\[0\]\.slots\.Adam\.m' is not a valid TensorEntry: dtype"):
        restore_items(state, str(tmp_path), [RestoreItem(key="emb", name="emb", start=0, stop=4, value=value,
                                                         slots={"Adam": {"m": {**value, "dtype": "object"}}})])
