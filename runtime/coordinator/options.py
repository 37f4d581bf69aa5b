"""The coordinator's options: every keyword argument of :class:`~kubeps.runtime.ClusterCoordinator` but the
strategy and a :class:`~kubeps.runtime.coordinator.watchdog.Watchdog`, validated once, in one object.

Each field's annotation is a type of :mod:`kubeps.runtime.checks`; :class:`CoordinatorOptions` checks every field
against it when it is made, so a refusal names the option, the value and what is allowed, in the words every other
argument check of kubeps uses. The parts of the chief (the worker set, the failure detector, the hot-ps detector)
read their settings from it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Optional

from kubeps.runtime.checks import NonNegativeInt, NonNegativeSeconds, PositiveInt, Seconds, check, number

__all__ = ["DEFAULT_CLOSURES_PER_CALL", "DEFAULT_GIL_SWITCH_INTERVAL", "DEFAULT_HOTSPOT_THRESHOLD",
           "CoordinatorOptions"]

#: the most queued functions one call to a worker carries (``max_closures_per_call``)
DEFAULT_CLOSURES_PER_CALL = 8
#: the GIL switch interval the coordinator holds while it runs (seconds; ``gil_switch_interval``, util/gil.py)
DEFAULT_GIL_SWITCH_INTERVAL = 0.05
#: a ps serving more than this many times the others' mean traffic is reported (``hotspot_threshold``)
DEFAULT_HOTSPOT_THRESHOLD = 2.0

#: a GIL switch interval the coordinator may hold: longer than 0, at most a second
SwitchInterval = number(gt=0, le=1, allowed="a number of seconds in (0, 1]")
#: how much busier than the others' mean a ps may be before it is reported
HotspotThreshold = number(gt=1, allowed="a number > 1 (the busiest ps's traffic over the others' mean)")


@dataclasses.dataclass(frozen=True)
class CoordinatorOptions:
    """The options of one coordinator (docs/runtime.md explains each); made from keyword arguments, checked."""

    closure_timeout: Annotated[float, Seconds] = 3600.0
    heartbeat_interval: Annotated[float, Seconds] = 1.0
    heartbeat_failures: Annotated[int, PositiveInt] = 3
    ping_timeout: Annotated[float, Seconds] = 1.0
    max_transient_ps_errors: Annotated[int, NonNegativeInt] = 3
    ps_error_interval: Annotated[float, NonNegativeSeconds] = 1.0
    ps_error_window: Annotated[float, Seconds] = 60.0
    worker_wait_timeout: Annotated[float, Seconds] = 3600.0
    #: None: no watchdog made here (a Watchdog passed to the coordinator may still be there)
    watchdog_timeout: Annotated[Optional[float], Optional[Seconds]] = None
    #: None: the task settings' ``hotspot_interval_s``
    hotspot_interval: Annotated[Optional[float], Optional[Seconds]] = None
    hotspot_threshold: Annotated[float, HotspotThreshold] = DEFAULT_HOTSPOT_THRESHOLD
    max_closures_per_call: Annotated[int, PositiveInt] = DEFAULT_CLOSURES_PER_CALL
    gil_switch_interval: Annotated[Optional[float], Optional[SwitchInterval]] = DEFAULT_GIL_SWITCH_INTERVAL

    def __post_init__(self) -> None:
        for name, type_ in _field_types().items():
            object.__setattr__(self, name, check(name, getattr(self, name), type_))


def _field_types() -> dict[str, Any]:
    """Each field's checking type: the last argument of its ``Annotated`` annotation."""
    global _FIELD_TYPES
    if _FIELD_TYPES is None:
        hints = typing.get_type_hints(CoordinatorOptions, include_extras=True)
        _FIELD_TYPES = {field.name: hints[field.name].__metadata__[-1]
                        for field in dataclasses.fields(CoordinatorOptions)}
    return _FIELD_TYPES


_FIELD_TYPES: dict[str, Any] | None = None
