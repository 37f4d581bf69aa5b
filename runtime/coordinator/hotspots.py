"""Hot parameter servers: the chief compares the traffic each ps served and says when one serves far more.

Every ``interval`` seconds the :class:`HotSpotDetector` thread asks every ps for its variables' counters
(``ListVariables``: rows and bytes read and pushed per variable shard, since the ps started) and compares the
bytes each ps served in that window. :func:`assess` is the pure rule: the *imbalance ratio* is the busiest ps's
bytes over the mean of the others'; above ``threshold`` (default 2: one ps serves more than twice what each other
one does -- with 2 ps, more than two thirds of the traffic) the job is imbalanced, and the verdict names the ps and
its busiest variable shard. A window with less than ``min_bytes`` of traffic in all is no evidence either way.

The detector logs a warning when a job becomes imbalanced (and an info line when it no longer is) and sets the
metrics ``kubeps_ps_traffic_share{ps}``, ``kubeps_ps_imbalance_ratio`` and ``kubeps_ps_imbalanced{ps,variable}``
(1 while imbalanced), which the operator reads from the chief's metrics to set the job's ``PSImbalance``
condition. The usual cause is skewed ids on range shards (``FixedShardsPartitioner``: popular ids are small ids,
all on the first shard); the remedy (docs/observability.md): more shards than ps, or hashing ids before the lookup.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from kubeps.runtime.checks import Seconds, check, number
from kubeps.runtime.observe import metrics as _metrics
from kubeps.runtime.settings import TaskSettings

__all__ = ["DEFAULT_HOTSPOT_INTERVAL_S", "DEFAULT_HOTSPOT_THRESHOLD", "HotSpotDetector", "Imbalance", "assess",
           "traffic_of"]

log = logging.getLogger("kubeps.runtime.coordinator.hotspots")

#: seconds between two looks at the ps' traffic (a task's default is its settings', ``KUBEPS_HOTSPOT_INTERVAL_S``)
DEFAULT_HOTSPOT_INTERVAL_S = TaskSettings.model_fields["hotspot_interval_s"].default
#: the busiest ps's traffic over the others' mean above which the job is imbalanced
DEFAULT_HOTSPOT_THRESHOLD = 2.0
#: the least traffic (bytes, all ps together) a window needs to count as evidence
DEFAULT_MIN_BYTES = 1 << 20

#: ``{ps index: {variable shard name: bytes served since the ps started}}``
Traffic = Mapping[int, Mapping[str, int]]


@dataclass(frozen=True)
class Imbalance:
    """The verdict of one window: each ps's share, the ratio, and (when imbalanced) the hot ps and shard."""

    shares: dict[int, float]
    ratio: float
    imbalanced: bool
    ps: int
    variable: str


def traffic_of(variables: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """``{name: bytes read + bytes pushed}`` of a ``ListVariables`` answer's variables."""
    return {v["name"]: int(v.get("bytes_read", 0)) + int(v.get("bytes_pushed", 0)) for v in variables}


def assess(before: Traffic, after: Traffic, threshold: float = DEFAULT_HOTSPOT_THRESHOLD,
           min_bytes: int = DEFAULT_MIN_BYTES) -> Imbalance | None:
    """The verdict on the window between two looks, or None when it holds less than ``min_bytes`` in all, when
    there are fewer than 2 ps, or when a counter went back: a variable was created again (a new coordinator) or its
    ps restarted, and the window mixes two lives of it (the next window starts from the new counts)."""
    if len(after) < 2:
        return None
    per_var: dict[int, dict[str, int]] = {}
    for ps, now in after.items():
        then = before.get(ps, {})
        if any(count < then.get(name, 0) for name, count in now.items()):
            return None
        per_var[ps] = {name: count - then.get(name, 0) for name, count in now.items()}
    per_ps = {ps: sum(v.values()) for ps, v in per_var.items()}
    total = sum(per_ps.values())
    if total < min_bytes:
        return None
    hot = max(per_ps, key=lambda ps: per_ps[ps])
    others = [count for ps, count in per_ps.items() if ps != hot]
    mean = sum(others) / len(others)
    ratio = per_ps[hot] / mean if mean > 0 else float("inf")
    variable = max(per_var[hot], key=lambda name: per_var[hot][name]) if per_var[hot] else ""
    return Imbalance(shares={ps: count / total for ps, count in per_ps.items()}, ratio=ratio,
                     imbalanced=ratio > threshold, ps=hot, variable=variable)


class HotSpotDetector:
    """Looks at the ps' traffic every ``interval`` seconds from a daemon thread (``start()``, ``stop()``).

    ``read(ps) -> list of variable infos`` asks one ps (the coordinator passes its transport's ``ListVariables``);
    ``on_verdict`` gets every verdict (tests, the coordinator's status). ``latest`` is the last verdict."""

    def __init__(self, num_ps: int, read: Callable[[int], Sequence[Mapping[str, Any]]], *,
                 interval: float = DEFAULT_HOTSPOT_INTERVAL_S, threshold: float = DEFAULT_HOTSPOT_THRESHOLD,
                 min_bytes: int = DEFAULT_MIN_BYTES, on_verdict: Callable[[Imbalance], None] | None = None):
        self.interval = check("hotspot_interval", interval, Seconds)
        self.threshold = check("hotspot_threshold", threshold,
                               number(gt=1, allowed="a number > 1 (the busiest ps's traffic over the others' mean)"))
        self.num_ps = num_ps
        self.read = read
        self.min_bytes = min_bytes
        self.on_verdict = on_verdict
        self.latest: Imbalance | None = None
        self._last: dict[int, dict[str, int]] = {}
        self._flagged: tuple[int, str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.num_ps < 2 or self._thread is not None:
            return  # one ps cannot be hotter than the others
        self._thread = threading.Thread(target=self._loop, name="kubeps-hotspots", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        self._last = self._look() or {}
        while not self._stop.wait(self.interval):
            now = self._look()
            if now is None:
                continue  # a ps did not answer: the failure detector deals with it; next window
            verdict = assess(self._last, now, self.threshold, self.min_bytes)
            self._last = now
            if verdict is not None:
                self.observe(verdict)

    def _look(self) -> dict[int, dict[str, int]] | None:
        try:
            return {ps: traffic_of(self.read(ps)) for ps in range(self.num_ps)}
        except Exception as err:  # noqa: BLE001 - a detector never fails the job
            log.debug("hot-spot detector: a ps did not answer ListVariables: %s", err)
            return None

    def observe(self, verdict: Imbalance) -> None:
        """Publish a verdict: metrics (when recorded), a log line on every change, ``on_verdict``."""
        self.latest = verdict
        if _metrics.ENABLED:
            for ps, share in verdict.shares.items():
                _metrics.PS_TRAFFIC_SHARE.labels(str(ps)).set(share)
            _metrics.PS_IMBALANCE_RATIO.set(min(verdict.ratio, 1e9))
        flagged = (verdict.ps, verdict.variable) if verdict.imbalanced else None
        if flagged != self._flagged:
            if self._flagged is not None and _metrics.ENABLED:
                _metrics.PS_IMBALANCED.remove(str(self._flagged[0]), self._flagged[1])
            if flagged is not None:
                log.warning("PSImbalance: ps %d serves %.1fx the mean of the other ps (threshold %.1fx); its "
                            "busiest variable shard is %r. Remedy: more shards than ps, or hash the ids "
                            "(docs/observability.md)", verdict.ps, verdict.ratio, self.threshold, verdict.variable)
                if _metrics.ENABLED:
                    _metrics.PS_IMBALANCED.labels(str(verdict.ps), verdict.variable).set(1)
            else:
                log.info("the ps serve balanced traffic again (ratio %.1fx)", verdict.ratio)
            self._flagged = flagged
        if self.on_verdict is not None:
            self.on_verdict(verdict)
