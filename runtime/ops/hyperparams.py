"""Checks of the hyperparameters that optimizers and learning-rate schedules take, and rebuilding either from
its JSON config: each refusal names the owner, the field, the value and what is allowed."""

from __future__ import annotations

import inspect
import math
from typing import Any, Mapping

import numpy as np

__all__ = ["build", "boolean", "integer", "number"]


def number(owner: str, name: str, value: Any, *, lo: float | None = None, lo_open: bool = False,
            hi: float | None = None, hi_open: bool = False) -> float:
    """``value`` as a finite float within the given bounds, or a ValueError naming owner, argument and range."""
    allowed = _range_text(lo, lo_open, hi, hi_open)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{owner}: {name}={value!r} is not a number; allowed: a finite number {allowed}".rstrip())
    v = float(value)
    ok = math.isfinite(v)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    if not ok:
        raise ValueError(f"{owner}: {name}={value!r} is out of range; allowed: a finite number {allowed}".rstrip())
    return v


def _range_text(lo: float | None, lo_open: bool, hi: float | None, hi_open: bool) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi:g}")
    return " and ".join(parts)


def integer(owner: str, name: str, value: Any, *, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < lo:
        raise ValueError(f"{owner}: {name}={value!r} is not allowed; allowed: an integer >= {lo}")
    return int(value)


def boolean(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{owner}: {name}={value!r} is not allowed; allowed: True or False")
    return bool(value)


def build(kind: str, registry: Mapping[str, type], config: Any) -> Any:
    """Shared body of ``optimizer_from_config`` and ``schedule_from_config``."""
    if not isinstance(config, Mapping) or "class_name" not in config:
        raise ValueError(f"{kind} config must be a mapping {{'class_name': ..., 'config': {{...}}}}, got {config!r}")
    name = config["class_name"]
    if name not in registry:
        raise ValueError(f"unknown {kind} class_name={name!r}; allowed: {sorted(registry)}")
    cls = registry[name]
    args = config.get("config", {}) or {}
    if not isinstance(args, Mapping):
        raise ValueError(f"{kind} {name}: 'config' must be a mapping of arguments, got {args!r}")
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]  # cls is a class: its own __init__
    accepted = [p for p in params if p != "self"]
    unknown = sorted(set(args) - set(accepted))
    if unknown:
        raise ValueError(f"{kind} {name} does not accept argument(s) {unknown}; allowed: {accepted}")
    missing = [p for p, spec in params.items()
               if p != "self" and spec.default is inspect.Parameter.empty and p not in args]
    if missing:
        raise ValueError(f"{kind} {name} is missing required argument(s) {missing}")
    return cls(**args)
