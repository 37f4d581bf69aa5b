"""The RPC protocol's declarations are the ones in use: every built-in method a server serves has a request and an
answer declaration (``rpc.protocol``'s method tables), its handler is annotated with exactly those, and every
declaration is named by code outside the protocol (a handler or a client), so none is decoration that drifts."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from typing_extensions import is_typeddict

from kubeps.runtime.rpc import protocol
from kubeps.runtime.rpc.protocol import COLLECT, PING, PS_SPECS, WORKER_SPECS
from kubeps.runtime.server.methods import BUILTIN_PS_METHODS, BUILTIN_WORKER_METHODS, compose
from kubeps.runtime.errors import RuntimeConfigError

REPO = Path(__file__).resolve().parents[2]
SERVICES = [("ps", BUILTIN_PS_METHODS, PS_SPECS), ("worker", BUILTIN_WORKER_METHODS, WORKER_SPECS)]


@pytest.mark.parametrize(("service", "served", "specs"), SERVICES, ids=[s for s, _, _ in SERVICES])
def test_every_served_method_is_declared_and_every_declared_one_served(service, served, specs):
    undeclared = sorted(set(served) - set(specs))
    unserved = sorted(set(specs) - set(served) - {PING})  # Ping: the service answers it itself
    assert not undeclared, f"{service} methods served without a declaration in rpc.protocol: {undeclared}"
    assert not unserved, f"{service} methods declared in rpc.protocol but served by no handler: {unserved}"


@pytest.mark.parametrize(("service", "served", "specs"), SERVICES, ids=[s for s, _, _ in SERVICES])
def test_every_handler_takes_its_request_and_answers_its_answer_declaration(service, served, specs):
    wrong = []
    for name, fn in sorted(served.items()):
        hints = typing.get_type_hints(fn)
        params = [p for p in fn.__code__.co_varnames[: fn.__code__.co_argcount]]
        request = hints.get(params[1]) if len(params) > 1 else None
        answer = typing.get_args(hints.get("return"))[:1]
        if request is not specs[name].request or answer != (specs[name].answer,):
            wrong.append(f"{service}.{name}: {fn.__module__}.{fn.__qualname__} takes {request} and answers "
                         f"{answer}; its declaration is {specs[name].request.__name__} -> "
                         f"{specs[name].answer.__name__}")
    assert not wrong, "\n".join(wrong)


def test_every_declaration_is_named_outside_the_protocol():
    declarations = sorted(n for n, v in vars(protocol).items() if is_typeddict(v) and v.__module__ == protocol.__name__)
    sources = "\n".join(p.read_text() for p in sorted((REPO / "runtime").rglob("*.py"))
                        if p != REPO / "runtime" / "rpc" / "protocol.py")
    unused = [n for n in declarations if not re.search(rf"\b{n}\b", sources)]
    assert not unused, f"declarations in rpc.protocol that no handler or client names: {unused}"


def test_methods_without_tensors_come_from_the_declarations():
    from kubeps.runtime.server.service import _NO_TENSORS  # noqa: PLC0415

    for service, specs in ((protocol.PS_SERVICE, PS_SPECS), (protocol.WORKER_SERVICE, WORKER_SPECS)):
        assert _NO_TENSORS[service] == {n for n, s in specs.items() if not s.tensors} | {COLLECT}
    assert {protocol.PS.CREATE_DYNAMIC, protocol.PS.DYNAMIC_INFO, protocol.PS.EXPORT_DYNAMIC,
            protocol.PS.SAVE_DYNAMIC, protocol.PS.RESTORE_DYNAMIC} <= _NO_TENSORS[protocol.PS_SERVICE]


def test_two_packages_defining_one_method_is_an_error():
    def one(state, request, arrays):  # noqa: ARG001
        return {}, []

    def other(state, request, arrays):  # noqa: ARG001
        return {}, []

    assert compose(a={"M": one}, b={"N": other}) == {"M": one, "N": other}
    with pytest.raises(RuntimeConfigError, match="'method' has invalid value 'M': is defined by both a and b"):
        compose(a={"M": one}, b={"M": other})
