"""A job's training progress from its chief's Prometheus metrics and its membership ack: pure, no I/O (the
controller's :mod:`~kubeps.operator.controller.progress` fetches both and writes the status).

:func:`read_chief` picks what people are shown out of the chief's ``/metrics`` text (``kubeps_train_step``,
``kubeps_train_examples_total``, ``kubeps_checkpoint_step``, the hot ps ``kubeps_ps_imbalanced{ps,variable}``);
:func:`progress` turns two readings and the chief's :class:`~kubeps.runtime.cluster.MembershipAck` into
``status.progress``: the step, the examples per second between them, the last checkpoint's step, and, from the
ack, the membership generation, the draining workers and the checkpoint request served. Metrics are for people:
no decision is taken on them. The planner decides from the ack itself (``status.membershipAck``, :mod:`.scale`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kubeps.runtime.cluster import MembershipAck

__all__ = ["ChiefReading", "progress", "read_chief"]

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
#: the metrics read as they are (besides the hot ps)
_READ = ("kubeps_train_step", "kubeps_train_examples_total", "kubeps_checkpoint_step")


@dataclass(frozen=True)
class ChiefReading:
    """What one read of the chief's metrics said, at ``at`` (seconds on the reader's monotonic clock)."""

    at: float
    step: int | None = None
    examples: float | None = None
    checkpoint_step: int | None = None
    #: ``(ps, variable shard)`` of every hot ps the chief's detector flags
    hot: tuple[tuple[str, str], ...] = ()


def read_chief(text: str, at: float) -> ChiefReading:
    """The reading of the chief's exposition ``text`` (Prometheus text format); absent metrics stay None."""
    values: dict[str, float] = {}
    hot: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name = match["name"]
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if name == "kubeps_ps_imbalanced":
            if value == 1:
                labels = dict(_LABEL.findall(match["labels"] or ""))
                hot.append((labels.get("ps", ""), labels.get("variable", "")))
        elif name in _READ:
            values[name] = value
    ints = {name: None if values.get(name) is None else int(values[name]) for name in _READ}
    return ChiefReading(at=at, step=ints["kubeps_train_step"], examples=values.get("kubeps_train_examples_total"),
                        checkpoint_step=ints["kubeps_checkpoint_step"], hot=tuple(sorted(hot)))


def progress(previous: ChiefReading | None, now: ChiefReading | None, when: str,
             ack: MembershipAck | None = None) -> dict[str, Any] | None:
    """``status.progress`` from the reading ``now`` (and ``previous``, for the rate) and the chief's membership
    ``ack``; None when the chief has reported neither a step nor a membership yet. Examples per second need two
    readings with the examples counter going up; a counter that went back (the chief restarted) gives no rate this
    time."""
    if (now is None or now.step is None) and ack is None:
        return None
    out: dict[str, Any] = {"lastUpdateTime": when}
    if ack is not None:
        out["membershipGeneration"] = ack.generation
        out["workersDraining"] = len(ack.draining)
        out["checkpointRequest"] = ack.checkpoint
    if now is None:
        return out
    if now.step is not None:
        out["step"] = now.step
    if now.checkpoint_step is not None and now.checkpoint_step > 0:
        out["lastCheckpointStep"] = now.checkpoint_step
    if (previous is not None and previous.examples is not None and now.examples is not None
            and now.examples >= previous.examples and now.at > previous.at):
        out["examplesPerSecond"] = f"{(now.examples - previous.examples) / (now.at - previous.at):.0f}"
    return out
