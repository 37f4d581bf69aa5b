"""A built-in method's request is validated against its declaration where the server dispatches it: a malformed one
(an unknown key, a value of another type, a missing key) is refused with INVALID_ARGUMENT naming the field and the
value, before the method runs, so nothing changes on the parameter server; a user's method gets the raw object.
Its answer is validated against its declaration where the client decodes it: a malformed one is an error naming the
method, the peer and the field (never a ``KeyError`` in the caller)."""

from __future__ import annotations

import re

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


# -- answers: validated against their declaration where the client decodes them ----------------------------------
@pytest.fixture()
def peer():
    """A peer that answers each method with the metadata the test sets (``answers[name]``): a parameter server of
    another protocol, or a broken one."""
    from concurrent import futures  # noqa: PLC0415

    import grpc  # noqa: PLC0415

    from kubeps.runtime.rpc import wire  # noqa: PLC0415
    from kubeps.runtime.rpc.protocol import PS_SPECS, UNARY_PREFIX  # noqa: PLC0415

    answers: dict[str, object] = {}

    def handler(name):
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: wire.encode_chunks(answers[name], [])[0],
            request_deserializer=lambda b: b, response_serializer=lambda b: b)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        PS_SERVICE, {f"{UNARY_PREFIX}{name}": handler(name) for name in [*PS_SPECS, "UserMethod"]})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", answers
    server.stop(grace=None)


MALFORMED_ANSWERS = [
    ("Push", {"steps": ["1"]}, "field 'steps[0]' has value '1': input should be a valid integer"),
    ("PushRead", {"steps": [1], "rows": 2}, "field 'rows' (value 2) is not allowed; allowed fields: "
                                            "['dynamic_steps', 'steps']"),
    ("ReadMany", {"steps": [1]}, "field 'steps' (value [1]) is not allowed; allowed fields: []"),
    ("ListVariables", {}, "field 'variables' is missing; it is required (ListVariablesAnswer)"),
    ("Ping", {"incarnation": "x", "job": "ps", "task": True}, "field 'task' has value True: input should be a "
                                                              "valid integer"),
]


@pytest.mark.parametrize(("method", "meta", "message"), MALFORMED_ANSWERS,
                         ids=[m for m, _, _ in MALFORMED_ANSWERS])
def test_a_malformed_answer_is_an_error_naming_method_peer_and_field(peer, method, meta, message):
    from kubeps.runtime.rpc.transport import PSTransport  # noqa: PLC0415
    from kubeps.runtime.rpc.validation import AnswerError  # noqa: PLC0415

    address, answers = peer
    answers[method] = meta
    client = Client(address, PS_SERVICE, TOKEN, timeout=10)
    transport = PSTransport([address], TOKEN, timeout=10)
    try:
        with pytest.raises(AnswerError) as info:
            client.call(method, {})
        assert str(info.value).startswith(f"{PS_SERVICE}.{method} at {address} answered metadata its declaration")
        assert message in str(info.value)
        assert info.value.code == "INTERNAL" and info.value.address == address and info.value.method == method
        # the transport raises it as it is: a malformed answer is not a parameter server that went away
        with pytest.raises(AnswerError, match=re.escape(message)):
            transport.call(0, method, {})
    finally:
        client.close()
        transport.close()


def test_a_well_formed_answer_comes_back_as_its_declaration_types_it_and_a_user_method_unchecked(peer):
    from kubeps.runtime.rpc.protocol import PS  # noqa: PLC0415

    address, answers = peer
    answers.update({"Push": {"steps": [3, 4]}, "ReadMany": {}, "UserMethod": {"anything": ["goes", 1]}})
    client = Client(address, PS_SERVICE, TOKEN, timeout=10)
    try:
        assert client.call(PS.PUSH, {})[0] == {"steps": [3, 4]}
        assert client.call(PS.READ_MANY, {})[0] == {}
        assert client.call("UserMethod", {})[0] == {"anything": ["goes", 1]}
    finally:
        client.close()
