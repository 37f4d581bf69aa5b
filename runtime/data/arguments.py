"""Argument checks for the data package's public functions: a bad argument raises an error that names the
argument, the value and what would be accepted."""

from __future__ import annotations

import numbers
from typing import Any, Callable


def int_arg(name: str, value: Any, minimum: int, allowed: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ValueError(f"argument `{name}` must be {allowed or f'an integer >= {minimum}'}, got {value!r}")
    return int(value)


def index_arg(name: str, value: Any, count: int, count_name: str) -> int:
    """An integer in ``0..count-1``, the position of one of ``count`` shards or workers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) < count:
        raise ValueError(
            f"argument `{name}` must be an integer in 0..{count - 1} ({count_name}={count}), got {value!r}"
        )
    return int(value)


def callable_arg(name: str, value: Any) -> Callable:
    if not callable(value):
        raise TypeError(f"argument `{name}` must be callable, got {value!r} ({type(value).__name__})")
    return value
