"""A job's training progress from its chief's Prometheus metrics: pure, no I/O (the controller's
:mod:`~kubeps.operator.controller.progress` fetches the text and writes the status).

:func:`read_chief` picks what the status needs out of the chief's ``/metrics`` text (``kubeps_train_step``,
``kubeps_train_examples_total``, ``kubeps_checkpoint_step``, the hot ps ``kubeps_ps_imbalanced{ps,variable}``);
:func:`progress` turns two readings into ``status.progress``: the step, the examples per second between them, the
last checkpoint's step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["ChiefReading", "progress", "read_chief"]

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


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
        elif name in ("kubeps_train_step", "kubeps_train_examples_total", "kubeps_checkpoint_step"):
            values[name] = value
    step, ckpt = values.get("kubeps_train_step"), values.get("kubeps_checkpoint_step")
    return ChiefReading(at=at, step=None if step is None else int(step), examples=values.get("kubeps_train_examples_total"),
                        checkpoint_step=None if ckpt is None else int(ckpt), hot=tuple(sorted(hot)))


def progress(previous: ChiefReading | None, now: ChiefReading, when: str) -> dict[str, Any] | None:
    """``status.progress`` from the reading ``now`` (and ``previous``, for the rate); None when the chief has
    reported no step yet. Examples per second need two readings with the examples counter going up; a counter
    that went back (the chief restarted) gives no rate this time."""
    if now.step is None:
        return None
    out: dict[str, Any] = {"step": now.step, "lastUpdateTime": when}
    if now.checkpoint_step is not None and now.checkpoint_step > 0:
        out["lastCheckpointStep"] = now.checkpoint_step
    if (previous is not None and previous.examples is not None and now.examples is not None
            and now.examples >= previous.examples and now.at > previous.at):
        out["examplesPerSecond"] = f"{(now.examples - previous.examples) / (now.at - previous.at):.0f}"
    return out
