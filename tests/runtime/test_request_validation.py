"""A built-in method's request is validated against its declaration where the server dispatches it: a malformed one
(an unknown key, a value of another type, a missing key) is refused with INVALID_ARGUMENT naming the field and the
value, before the method runs, so nothing changes on the parameter server; a user's method gets the raw object."""

from __future__ import annotations

import numpy as np
import pytest

from kubeps.runtime.errors import RemoteError
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.protocol import PS_SERVICE
from kubeps.runtime.rpc.validation import PS_REQUESTS, RequestError
from kubeps.runtime.server import Server, register_ps_method

from .conftest import TOKEN, free_ports

SGD_CONFIG = SGD(learning_rate=1.0).get_config()


@pytest.fixture()
def ps():
    port = free_ports(1)[0]
    cluster = {"ps": [f"127.0.0.1:{port}"]}
    server = Server(cluster, "ps", 0, token=TOKEN, bind_host="127.0.0.1")
    client = Client(cluster["ps"][0], PS_SERVICE, TOKEN, timeout=10)
    server.state.create("v", np.ones(4, np.float32))
    yield server, client
    client.close()
    server.stop(grace=None)


MALFORMED = [
    # an unknown key, at the top and inside an update
    ("Push", {"optimizer": SGD_CONFIG, "updates": [{"name": "v"}], "names": ["v"]},
     "field 'names' (value ['v']) is not allowed; allowed fields: ['optimizer', 'updates']"),
    ("Push", {"optimizer": SGD_CONFIG, "updates": [{"name": "v", "kind": "dense", "lr": 2}]},
     "field 'updates[0].lr' (value 2) is not allowed; allowed fields: ['kind', 'name']"),
    # a value of another type: no coercion of "1" to 1, nor of 1 to a string
    ("PushRead", {"optimizer": SGD_CONFIG, "updates": [{"name": 1}], "names": []},
     "field 'updates[0].name' has value 1: input should be a valid string"),
    ("Push", {"optimizer": SGD_CONFIG, "updates": [{"name": "v", "kind": "weird"}]},
     "field 'updates[0].kind' has value 'weird': input should be 'dense', 'sparse' or 'dynamic'"),
    ("CreateDynamic", {"name": "t", "config": {"dim": "8"}}, "field 'config.dim' has value '8': input should be a "
                                                             "valid integer"),
    ("Assign", {"names": ["v"], "ops": ["mul"]}, "field 'ops[0]' has value 'mul': input should be 'assign' or 'add'"),
    # a missing key
    ("Push", {"updates": [{"name": "v"}]}, "field 'optimizer' is missing; it is required (PushRequest)"),
    ("Read", {}, "field 'names' is missing; it is required (NamesRequest)"),
]


@pytest.mark.parametrize(("method", "meta", "message"), MALFORMED, ids=[f"{m}-{i}" for i, (m, _, _) in
                                                                         enumerate(MALFORMED)])
def test_a_malformed_request_is_refused_at_dispatch_naming_field_and_value(ps, method, meta, message):
    server, client = ps
    before = server.state.read("v").copy()
    with pytest.raises(RemoteError) as info:
        client.call(method, meta, [np.ones(4, np.float32)] if method in ("Push", "PushRead", "Assign") else [])
    assert info.value.code == "INVALID_ARGUMENT", str(info.value)
    assert f"{method}: {message}" in str(info.value), str(info.value)
    # nothing changed: the method never ran
    np.testing.assert_array_equal(server.state.read("v"), before)
    assert server.state.get("v").updates == 0
    assert server.state.names() == ["v"]


def test_a_well_formed_request_reaches_the_method(ps):
    server, client = ps
    meta, _ = client.call("Push", {"optimizer": SGD_CONFIG, "updates": [{"name": "v"}]}, [np.ones(4, np.float32)])
    assert meta == {"steps": [1]}
    np.testing.assert_array_equal(server.state.read("v"), np.zeros(4, np.float32))


def test_validation_is_strict_and_returns_the_declared_value():
    assert PS_REQUESTS["ReadMany"].validate({"names": ["a"], "rows": []}) == {"names": ["a"], "rows": []}
    with pytest.raises(RequestError, match="field 'names\\[0\\]' has value 1: input should be a valid string"):
        PS_REQUESTS["ReadMany"].validate({"names": [1]})
    with pytest.raises(RequestError, match="field 'dynamic\\[0\\].train' has value 1: input should be a valid "
                                           "boolean"):
        PS_REQUESTS["LookupDynamic"].validate({"dynamic": [{"name": "t", "train": 1}]})
    with pytest.raises(RequestError, match="field 'items\\[0\\].start' has value '0': input should be a valid "
                                           "integer"):
        PS_REQUESTS["SaveShards"].validate({"directory": "/x", "items": [{"key": "a", "name": "a", "start": "0",
                                                                          "stop": 2, "shape": [2]}]})


def _echo_for_test(state, meta, arrays):  # noqa: ARG001
    return {"got": meta}, []


register_ps_method("EchoForValidationTest", _echo_for_test, replace=True)


def test_a_user_method_gets_the_raw_request(ps):
    _, client = ps
    meta, _ = client.call("EchoForValidationTest", {"anything": ["goes", 1]})
    assert meta == {"got": {"anything": ["goes", 1]}}


def test_a_table_config_has_one_shape_both_ways():
    from kubeps.runtime.variables.dynamic_table import TableConfig  # noqa: PLC0415

    config = TableConfig.from_dict({"dim": np.int64(4), "initializer": {"kind": "constant", "value": np.float32(1)}})
    assert config.dim == 4 and type(config.dim) is int  # a user's numpy scalars are numbers
    assert TableConfig.from_dict(config.as_dict()) == config  # what crosses the wire comes back the same
    assert PS_REQUESTS["CreateDynamic"].validate({"name": "t", "config": config.as_dict()})["config"] == config.as_dict()
    with pytest.raises(ValueError, match="config: field 'dim' has value '4': input should be a valid integer"):
        TableConfig.from_dict({"dim": "4"})
    with pytest.raises(ValueError, match="config.dim=0 is not allowed; allowed: an integer >= 1"):
        TableConfig.from_dict({"dim": 0})
