"""One validation dialect for every argument and setting: annotated types, and :func:`check` for plain code.

Each type here is an ``Annotated`` pydantic type. A pydantic model (the task's settings, the operator's settings, a
CRD model) names it as a field's annotation; a constructor or function checks an argument with :func:`check`::

    self.closure_timeout = check("closure_timeout", closure_timeout, Seconds)
    self.shards = check("num_shards", num_shards, PositiveInt)
    rate = check("learning_rate", learning_rate, number(gt=0), owner="SGD")

The task's and the operator's settings read their variables' text with :func:`from_text` (``" 3 "`` is 3, ``"1.5"``
is no integer), so a variable both read, such as ``KUBEPS_METRICS_PORT`` (:data:`MetricsPort`), means one thing.

A refusal raises :class:`~kubeps.runtime.errors.RuntimeConfigError` (a ``ValueError``), whose message names the
field, the value and what is allowed, in the same words for every caller. Numbers are strict: ``True`` is not 1,
``"3"`` is not 3, NaN and infinities are not numbers; numpy scalars are accepted as the Python number they hold.

This module is at the bottom of the runtime (beside the settings): pydantic and the errors only.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Annotated, Any, Callable, TypeVar

from pydantic import AfterValidator, BeforeValidator, TypeAdapter, ValidationError

from kubeps.runtime.errors import RuntimeConfigError

__all__ = [
    "Allowed",
    "Flag",
    "Fraction",
    "MetricsPort",
    "NonNegativeFloat",
    "NonNegativeInt",
    "NonNegativeSeconds",
    "Port",
    "PortOrZero",
    "PositiveFloat",
    "PositiveInt",
    "RealNumber",
    "Seconds",
    "allowed_text",
    "check",
    "check_callable",
    "from_text",
    "index_in",
    "integer",
    "number",
]

T = TypeVar("T")


class Allowed(str):
    """The words a refusal uses for what a type allows (its ``Annotated`` metadata)."""


def _strict_int(value: Any) -> int:
    if type(value) is int:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError("not an integer")
    return int(value)


def _strict_number(value: Any) -> float:
    if type(value) is float and math.isfinite(value):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError("not a number")
    number_ = float(value)
    if not math.isfinite(number_):
        raise ValueError("not a finite number")
    return number_


def _strict_real(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError("not a real number")
    return float(value)


def _strict_bool(value: Any) -> bool:
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise ValueError("not True or False")


def _bounds_text(gt: float | None, ge: float | None, lt: float | None, le: float | None) -> str:
    parts = [f"{op} {bound:g}" for op, bound in ((">", gt), (">=", ge), ("<", lt), ("<=", le)) if bound is not None]
    return " and ".join(parts)


def _bounded(gt: float | None, ge: float | None, lt: float | None, le: float | None) -> Callable[[Any], Any]:
    def inside(value: Any) -> Any:
        if ((gt is not None and not value > gt) or (ge is not None and not value >= ge)
                or (lt is not None and not value < lt) or (le is not None and not value <= le)):
            raise ValueError(f"out of range: {_bounds_text(gt, ge, lt, le)}")
        return value
    return inside


@functools.lru_cache(maxsize=None)
def integer(*, ge: int | None = None, gt: int | None = None, le: int | None = None, lt: int | None = None,
            allowed: str | None = None) -> Any:
    """An integer type within the given bounds (``PositiveInt`` is ``integer(ge=1)``)."""
    text = allowed or f"an integer {_bounds_text(gt, ge, lt, le)}".rstrip()
    return Annotated[int, BeforeValidator(_strict_int), AfterValidator(_bounded(gt, ge, lt, le)), Allowed(text)]


@functools.lru_cache(maxsize=None)
def number(*, ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
           allowed: str | None = None) -> Any:
    """A finite number type within the given bounds (``Seconds`` is ``number(gt=0, allowed=...)``)."""
    text = allowed or f"a finite number {_bounds_text(gt, ge, lt, le)}".rstrip()
    return Annotated[float, BeforeValidator(_strict_number), AfterValidator(_bounded(gt, ge, lt, le)), Allowed(text)]


#: an integer >= 1 (a count of shards, workers, steps)
PositiveInt = integer(ge=1)
#: an integer >= 0
NonNegativeInt = integer(ge=0)
#: a finite number > 0
PositiveFloat = number(gt=0)
#: a finite number >= 0
NonNegativeFloat = number(ge=0)
#: a duration: a finite number of seconds > 0
Seconds = number(gt=0, allowed="a number of seconds > 0")
#: a duration that may be zero: a finite number of seconds >= 0
NonNegativeSeconds = number(ge=0, allowed="a number of seconds >= 0")
#: a share: a finite number in (0, 1]
Fraction = number(gt=0, le=1, allowed="a number in (0, 1]")
#: a TCP port to listen on or connect to
Port = integer(ge=1, le=65535, allowed="a port number in 1..65535")
#: a TCP port, or 0 (off, or any free port: the field's documentation says which)
PortOrZero = integer(ge=0, le=65535, allowed="a port number in 1..65535, or 0")
#: where a process serves its Prometheus metrics, in a task and in the operator alike: 0 is off, else a port
MetricsPort = integer(ge=0, le=65535, allowed="a port number in 1..65535, or 0 (no metrics)")
#: any real number, NaN and the infinities too (a diverging loss is still a value to record)
RealNumber = Annotated[float, BeforeValidator(_strict_real), Allowed("a real number")]
#: True or False (not 1, not "yes")
Flag = Annotated[bool, BeforeValidator(_strict_bool), Allowed("True or False")]


def index_in(count: int, count_name: str) -> Any:
    """An integer in ``0..count-1``: the position of one of ``count`` things (``count_name`` says which)."""
    return integer(ge=0, lt=count, allowed=f"an integer in 0..{count - 1} ({count_name}={count})")


def _parse_text(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip()
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return value


@functools.lru_cache(maxsize=None)
def from_text(type_: Any) -> Any:
    """``type_`` that also takes its value as text, as an environment variable or a flag gives it (``" 3 "`` is 3,
    ``"2.5"`` is 2.5); the text is then checked as the number it spells (``"1.5"`` is no integer)."""
    return Annotated[type_, BeforeValidator(_parse_text)]


def allowed_text(type_: Any) -> str:
    """What ``type_`` allows, in a refusal's words (its :class:`Allowed` metadata, else its name)."""
    for item in reversed(getattr(type_, "__metadata__", ())):
        if isinstance(item, Allowed):
            return str(item)
    return f"a value of type {getattr(type_, '__name__', type_)}"


@functools.lru_cache(maxsize=None)
def _adapter(type_: Any) -> TypeAdapter[Any]:
    return TypeAdapter(type_)


def _plain(type_: Any) -> Callable[[Any], Any] | None:
    """The validators of one of this module's ``Annotated`` types as one plain function (what pydantic would run:
    the before validators, then the after ones), so a check on a hot path (an optimizer's update count) costs a
    function call, not a pydantic validation; None for any other type."""
    metadata = getattr(type_, "__metadata__", None)
    if metadata is None or type_.__origin__ not in (int, float, bool):
        return None
    before: list[Callable[[Any], Any]] = []
    after: list[Callable[[Any], Any]] = []
    for item in metadata:
        if isinstance(item, BeforeValidator):
            before.append(item.func)  # type: ignore[arg-type]  # ours take the value alone
        elif isinstance(item, AfterValidator):
            after.append(item.func)  # type: ignore[arg-type]  # ours take the value alone
        elif not isinstance(item, Allowed):
            return None
    steps = [*reversed(before), *after]

    def run(value: Any) -> Any:
        for step in steps:
            value = step(value)
        return value
    return run


#: id(type) -> (the type, kept alive so its id is not reused; its validator): hashing an ``Annotated`` type hashes
#: its validators, which cost more than the check itself
_VALIDATORS: dict[int, tuple[Any, Callable[[Any], Any]]] = {}


def _validator(type_: Any) -> Callable[[Any], Any]:
    known = _VALIDATORS.get(id(type_))
    if known is not None and known[0] is type_:
        return known[1]
    validator = _make_validator(type_)
    _VALIDATORS[id(type_)] = (type_, validator)
    return validator


def _optional_of(type_: Any) -> list[Any] | None:
    """The types ``T | None`` allows besides None; None when ``type_`` is not such a union."""
    args = getattr(type_, "__args__", None)
    if args and type(None) in args and getattr(type_, "__metadata__", None) is None:
        return [a for a in args if a is not type(None)]
    return None


def _make_validator(type_: Any) -> Callable[[Any], Any]:
    """One function that returns the checked value or raises: plain for this module's types and ``T | None`` of
    one, else pydantic's ``TypeAdapter``."""
    plain = _plain(type_)
    if plain is not None:
        return plain
    inner = _optional_of(type_)
    plain_inner = _plain(inner[0]) if inner is not None and len(inner) == 1 else None
    if plain_inner is not None:
        return lambda value: None if value is None else plain_inner(value)
    return _adapter(type_).validate_python


def check(field: str, value: Any, type_: Any, *, owner: str | None = None, allowed: str | None = None) -> Any:
    """``value`` as ``type_`` accepts it, or :class:`RuntimeConfigError` naming ``field`` (as ``owner.field`` when
    an owner is given, e.g. the class whose constructor checks it), the value and what is allowed.

    ``type_`` is one of this module's types, ``T | None`` of one (None passes), or any type pydantic validates."""
    try:
        return _validator(type_)(value)
    except (ValidationError, ValueError, TypeError):
        name = f"{owner}.{field}" if owner else field
        raise RuntimeConfigError(name, value, allowed or _allowed_of(type_)) from None


def _allowed_of(type_: Any) -> str:
    inner = _optional_of(type_)
    return allowed_text(type_) if inner is None else " or ".join(allowed_text(a) for a in inner) + ", or None"


def check_callable(field: str, value: T, *, owner: str | None = None, allowed: str = "a callable") -> T:
    """``value`` if it is callable, else :class:`RuntimeConfigError` naming the field (``allowed`` says what)."""
    if not callable(value):
        raise RuntimeConfigError(f"{owner}.{field}" if owner else field, value, allowed)
    return value
