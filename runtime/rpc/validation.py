"""Messages checked against their method's declaration (:mod:`kubeps.runtime.rpc.protocol`) at the edges: a
request once, where a server dispatches it; an answer once, where a client decodes it.

One :class:`RequestShape` and one :class:`AnswerShape` per built-in method, built at import from the protocol's
method tables, wrap a pydantic ``TypeAdapter`` over the method's ``TypedDict``. Every declaration of the protocol is
closed and strict here (the protocol itself may not import pydantic, so this module gives its declarations
pydantic's config): a key the declaration does not list, a missing key, a value of another JSON type (``"1"`` for an
integer, ``1`` for a string, ``1`` for ``true``) are refused -- a request with a :class:`RequestError` (a
``ValueError``: ``INVALID_ARGUMENT``), an answer with an :class:`AnswerError` (a
:class:`~kubeps.runtime.errors.RemoteError` with code ``INTERNAL``: the peer speaks another protocol) -- naming the
method, the field's path, the value and what the declaration allows (and, for an answer, the peer).
"""

from __future__ import annotations

from typing import Any, Mapping, Union, get_args, get_origin

from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config
from typing_extensions import NotRequired, Required, get_type_hints, is_typeddict

from kubeps.runtime.errors import RemoteError, short_repr
from kubeps.runtime.rpc import protocol
from kubeps.runtime.rpc.protocol import COLLECT_SPEC, PS_SERVICE, PS_SPECS, WORKER_SERVICE, WORKER_SPECS, MethodSpec

__all__ = ["ANSWERS", "COLLECT_REQUEST", "PS_REQUESTS", "WIRE_CONFIG", "WORKER_REQUESTS", "AnswerError", "AnswerShape",
           "RequestError", "RequestShape", "answer_shapes", "describe", "request_shapes"]

#: what every declaration of the protocol is on the wire: closed (unknown keys refused) and strict (no coercion)
WIRE_CONFIG = ConfigDict(extra="forbid", strict=True)
#: the most problems one refusal lists
_MAX_PROBLEMS = 5
#: the most characters of a refused value a message quotes
_MAX_VALUE_CHARS = 80

for _declaration in vars(protocol).values():
    if is_typeddict(_declaration):
        with_config(WIRE_CONFIG)(_declaration)


class RequestError(ValueError):
    """A request whose metadata does not have its method's declared shape."""


class AnswerError(RemoteError):
    """An answer whose metadata does not have its method's declared shape: the peer runs another protocol (another
    kubeps) or is broken. Code ``INTERNAL``, as a server's own failure; never retried by the client."""


def _field_type(declaration: Any, loc: tuple[int | str, ...]) -> Any:
    """The declared type at ``loc`` inside ``declaration``, or None where the path leaves the declarations."""
    current = declaration
    for part in loc:
        while get_origin(current) in (NotRequired, Required):
            current = get_args(current)[0]
        if isinstance(part, str) and is_typeddict(current):
            current = get_type_hints(current, include_extras=True).get(part)
        elif isinstance(part, int) and get_origin(current) is list:
            current = get_args(current)[0]
        elif isinstance(part, str) and get_origin(current) is dict:
            current = get_args(current)[1]
        else:
            return None
    while get_origin(current) in (NotRequired, Required, Union):
        current = get_args(current)[0]
    return current


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<request>"


def _value(value: Any) -> str:
    return short_repr(value, _MAX_VALUE_CHARS)


def describe(declaration: type, err: ValidationError) -> str:
    """``err`` in words: per problem, the field's path, the value and what the declaration allows."""
    problems = []
    errors = err.errors(include_url=False)
    for e in errors[:_MAX_PROBLEMS]:
        loc = tuple(e["loc"])
        field = _path(loc)
        if e["type"] == "missing":
            problems.append(f"field '{field}' is missing; it is required ({declaration.__name__})")
        elif e["type"] == "extra_forbidden":
            parent = _field_type(declaration, loc[:-1])
            allowed = sorted(get_type_hints(parent)) if is_typeddict(parent) else []
            problems.append(f"field '{field}' (value {_value(e['input'])}) is not allowed; allowed fields: {allowed}")
        else:
            problems.append(f"field '{field}' has value {_value(e['input'])}: {e['msg'][:1].lower()}{e['msg'][1:]}")
    if len(errors) > _MAX_PROBLEMS:
        problems.append(f"and {len(errors) - _MAX_PROBLEMS} more problem(s)")
    return "; ".join(problems)


class Shape:
    """One declaration's validator: :meth:`parse` returns the message as the declaration types it (a new ``dict``),
    or raises pydantic's ``ValidationError`` (:func:`describe` puts it in words)."""

    def __init__(self, declaration: type):
        self.declaration = declaration
        self._adapter: TypeAdapter[Any] = TypeAdapter(declaration)

    def parse(self, meta: object) -> Any:
        return self._adapter.validate_python(meta)


class RequestShape(Shape):
    """The validator of one method's request metadata: :meth:`validate` returns the request as its declaration
    types it, or raises :class:`RequestError`."""

    def validate(self, meta: object) -> Any:
        try:
            return self.parse(meta)
        except ValidationError as err:
            raise RequestError(describe(self.declaration, err)) from None


class AnswerShape(Shape):
    """The validator of one method's answer metadata: :meth:`validate` returns the answer as its declaration types
    it, or raises :class:`AnswerError` naming the method, the peer and the field."""

    def validate(self, meta: object, service: str, method: str, peer: str) -> Any:
        try:
            return self.parse(meta)
        except ValidationError as err:
            error = AnswerError(f"{service}.{method} at {peer} answered metadata its declaration "
                                f"({self.declaration.__name__}) refuses: {describe(self.declaration, err)}",
                                code="INTERNAL", address=peer)
            error.method, error.reason = method, None
            raise error from None


def request_shapes(specs: Mapping[str, MethodSpec]) -> dict[str, RequestShape]:
    """One request validator per method of a service's table."""
    return {name: RequestShape(spec.request) for name, spec in specs.items()}


def answer_shapes(specs: Mapping[str, MethodSpec]) -> dict[str, AnswerShape]:
    """One answer validator per method of a service's table."""
    return {name: AnswerShape(spec.answer) for name, spec in specs.items()}


#: the validators of the parameter-server service's methods, of the worker service's, and of ``Collect``
PS_REQUESTS = request_shapes(PS_SPECS)
WORKER_REQUESTS = request_shapes(WORKER_SPECS)
COLLECT_REQUEST = RequestShape(COLLECT_SPEC.request)
#: the answer validators of each service's methods, by service (a client looks its own up)
ANSWERS: dict[str, dict[str, AnswerShape]] = {PS_SERVICE: answer_shapes(PS_SPECS),
                                              WORKER_SERVICE: answer_shapes(WORKER_SPECS)}
