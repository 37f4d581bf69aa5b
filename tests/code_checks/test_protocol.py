"""The RPC protocol's declarations are the ones in use, and the only ones: every built-in method a server serves has
a request and an answer declaration (``rpc.protocol``'s method tables), its handler is annotated with exactly those,
every declaration is named by code outside the protocol (a handler or a client), so none is decoration that drifts,
and no pydantic model of the runtime mirrors one (a second declaration of a message, which would drift from it)."""

from __future__ import annotations

import ast
import pickle
import re
import typing
from pathlib import Path

import pytest
from typing_extensions import get_type_hints, is_typeddict

from kubeps.runtime.rpc import protocol
from kubeps.runtime.rpc.protocol import COLLECT, PING, PS, PS_SPECS, WORKER, WORKER_SPECS, Method
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


def test_every_method_constant_is_in_its_services_table_with_its_own_declarations():
    for service, specs in ((PS, PS_SPECS), (WORKER, WORKER_SPECS)):
        methods = [m for m in vars(service).values() if isinstance(m, Method)]
        assert methods and all(specs[m] is m.spec for m in methods), service.__name__
        assert set(specs) == {*methods, PING}
    assert protocol.COLLECT_SPEC is COLLECT.spec


def test_a_method_is_its_name_and_keeps_its_declarations_through_pickle():
    again = pickle.loads(pickle.dumps(PS.PUSH))
    assert again == "Push" and {"Push": 1}[again] == 1 and f"/{again}" == "/Push"
    assert type(again) is Method and again.spec == PS.PUSH.spec


def _holds_any(declaration: object, seen: tuple[object, ...] = ()) -> bool:
    if declaration is typing.Any:
        return True
    if is_typeddict(declaration):
        return declaration not in seen and any(_holds_any(t, (*seen, declaration))
                                               for t in get_type_hints(declaration).values())
    return any(_holds_any(arg, seen) for arg in typing.get_args(declaration))


def test_no_answer_declaration_holds_any():
    """A client's call of a Method is typed as its answer declaration by an overload; an ``Any`` inside the
    declaration would make mypy give up on the overloads and type every answer of the method ``Any`` (``object`` is
    the declaration of any JSON value there)."""
    holding = sorted({spec.answer.__name__ for specs in (PS_SPECS, WORKER_SPECS) for spec in specs.values()
                      if _holds_any(spec.answer)})
    assert not holding, f"answer declarations holding Any (their clients' answers would be untyped): {holding}"
    assert _holds_any(protocol.PushRequest)  # the check sees an Any inside a declaration


# -- one declaration per message: no pydantic twin of a protocol declaration ----------------------------------------
def _keys(declaration: type) -> frozenset[str]:
    return frozenset(declaration.__required_keys__ | declaration.__optional_keys__)  # type: ignore[attr-defined]


#: every declaration of the protocol with at least two keys, by its keys (a one-key shape such as ``{"name"}`` says
#: too little to call a model with that field a twin)
DECLARATIONS = {n: _keys(v) for n, v in vars(protocol).items()
                if is_typeddict(v) and v.__module__ == protocol.__name__ and len(_keys(v)) >= 2}


def mirrors(fields: set[str], keys: frozenset[str]) -> bool:
    """Whether a model with ``fields`` mirrors a declaration with ``keys``: the same names, or (three or more of
    them shared) all but one, so that a field added to a twin or dropped from it does not hide it."""
    return fields == keys or (len(fields & keys) >= 3 and len(fields ^ keys) <= 1)


def pydantic_twins(sources: dict[str, str]) -> list[str]:
    """The pydantic models in ``sources`` (path -> text) whose fields mirror a protocol declaration's keys
    (:func:`mirrors`): a second declaration of that message. A model is a class deriving from ``BaseModel`` or from
    such a model (in any of the sources); its fields are its annotated class attributes and its bases'."""
    classes: dict[str, list[tuple[str, list[str], set[str]]]] = {}  # name -> (path, bases, fields) per class
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases]
                fields = {a.target.id for a in node.body if isinstance(a, ast.AnnAssign)
                          and isinstance(a.target, ast.Name) and "ClassVar" not in ast.unparse(a.annotation)}
                classes.setdefault(node.name, []).append((path, bases, fields))

    def model_fields(bases: list[str], fields: set[str], seen: frozenset[str]) -> set[str] | None:
        """The fields of a class with ``bases`` and ``fields`` of its own, or None when it is not a pydantic model
        (a base is looked up by name: a model of that name in any of the sources)."""
        inherited = []
        for base in bases:
            if base == "BaseModel":
                inherited.append(set())
            elif base not in seen:
                found = [model_fields(b, f, seen | {base}) for _, b, f in classes.get(base, [])]
                inherited += [f for f in found if f is not None][:1]
        return fields.union(*inherited) - {"model_config"} if inherited else None

    twins = []
    for name, found in sorted(classes.items()):
        for path, bases, own in found:
            fields = model_fields(bases, own, frozenset({name}))
            for declaration, keys in DECLARATIONS.items():
                if fields is not None and mirrors(fields, keys):
                    twins.append(f"{path}: pydantic model {name} mirrors protocol.{declaration} (fields "
                                 f"{sorted(fields)}, declared keys {sorted(keys)}): declare the message once, in "
                                 f"rpc.protocol, and use that")
    return twins


def test_no_pydantic_model_of_the_runtime_mirrors_a_protocol_declaration():
    sources = {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "runtime").rglob("*.py"))}
    twins = pydantic_twins(sources)
    assert not twins, "\n".join(twins)


def test_a_pydantic_twin_is_found_however_it_is_dressed():
    """The checker above finds a twin: a model with the declaration's fields, one with a field more that inherits
    some of them from another model (and not a plain class, nor a model sharing two fields of a declaration, nor
    one holding a small declaration's fields among many others)."""
    twin = """
from pydantic import BaseModel, ConfigDict, StrictInt
import pydantic

class SaveItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str
    name: str
    start: StrictInt
    stop: StrictInt
    shape: list[StrictInt]

class Keyed(pydantic.BaseModel):
    key: str

class TableItem(Keyed):
    name: str
    shard: int
    note: str = ""

class Plain:
    key: str
    name: str
    shard: int

class Fewer(BaseModel):
    key: str
    name: str

class Bigger(BaseModel):
    shard: int
    rows: int
    slots: dict
    updates: int
"""
    found = pydantic_twins({"runtime/x.py": twin})
    assert [line.split(":")[1].split(" mirrors ")[0].strip() for line in found] == [
        "pydantic model SaveItem", "pydantic model TableItem"]
    assert "protocol.SaveItem" in found[0] and "protocol.SaveTableItem" in found[1]
