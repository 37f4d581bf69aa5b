"""The chief's metric families, read at each scrape: the closure queue's counters and sizes, the membership (the
workers dispatched to, those draining, the generation and checkpoint request applied) and the data read again after
membership changes.

Observe is below the coordinator: what these families read reaches them through :class:`ClosureCounts` (the closure
queue has those methods) and a function returning :class:`MembershipFigures` (the membership controller's), never
by importing the coordinator. The coordinator registers :func:`chief_families` with
:func:`kubeps.runtime.observe.metrics.add_collector`.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, NamedTuple, Protocol, Union

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ClosureCounts", "InputFigures", "MembershipFigures", "chief_families"]

Family = Union[CounterMetricFamily, GaugeMetricFamily]

#: the closure queue's transitions, counted since the start: name (``kubeps_closures_<name>_total``), help
_COUNTERS = (("scheduled", "Functions scheduled"), ("finished", "Scheduled functions that finished"),
             ("failed", "Scheduled functions that failed (non-retryable)"),
             ("retried", "Scheduled functions re-queued after their worker was lost"),
             ("cancelled", "Scheduled functions cancelled"),
             ("batched", "Scheduled functions sent to a worker in the call of the function before them"))


class ClosureCounts(Protocol):
    """What the families read of the closure queue."""

    def counters(self) -> Mapping[str, int]:
        """Closures by transition since the start: each name of ``_COUNTERS``."""

    def stats(self) -> Mapping[str, int]:
        """Closures now: ``queued``, ``per_worker`` (waiting for a worker) and ``inflight``."""


class MembershipFigures(NamedTuple):
    """The chief's membership, as numbers."""

    workers: int  #: workers dispatched to
    draining: int  #: workers that left and still finish their last function
    generation: int  #: the membership document applied (0: TF_CONFIG's workers)
    checkpoint: int  #: the last checkpoint request served
    reshards: int  #: times the per-worker datasets were sharded again
    records_reread: int  #: records a reshard, a leaving or a restarted worker made read again


class InputFigures(NamedTuple):
    """The exactly-once input (:mod:`kubeps.runtime.coordinator.leases`), all its datasets together."""

    trained: int  #: records committed as trained
    reread: int  #: records trained twice: a function re-run after its worker was lost, or a report come too late
    lost: int  #: records a report would have skipped or rewound (not applied)


#: the exactly-once input's counters: field, help
_INPUT = (("trained", "Records of exactly-once datasets committed as trained"),
          ("reread", "Records of exactly-once datasets trained twice: a function re-run after its worker was lost "
                     "(an upper bound) or a report that came after its shard was taken back"),
          ("lost", "Records of exactly-once datasets that a worker's report would have skipped (not applied)"))


def chief_families(closures: ClosureCounts, membership: Callable[[], MembershipFigures],
                   inputs: Callable[[], InputFigures] | None = None) -> Iterator[Family]:
    """Every metric family of the chief, as of now."""
    counts = closures.counters()
    for name, text in _COUNTERS:
        yield _family(CounterMetricFamily, f"kubeps_closures_{name}", text, counts[name])
    stats = closures.stats()
    yield _family(GaugeMetricFamily, "kubeps_closures_queued", "Scheduled functions waiting for a worker",
                  stats["queued"] + stats["per_worker"])
    yield _family(GaugeMetricFamily, "kubeps_closures_in_flight", "Scheduled functions running on a worker",
                  stats["inflight"])
    now = membership()
    yield _family(GaugeMetricFamily, "kubeps_workers", "Workers the chief dispatches to", now.workers)
    yield _family(GaugeMetricFamily, "kubeps_workers_draining",
                  "Workers that left and still finish their last function", now.draining)
    yield _family(GaugeMetricFamily, "kubeps_membership_generation", "Generation of the membership document applied",
                  now.generation)
    yield _family(GaugeMetricFamily, "kubeps_checkpoint_request",
                  "The last checkpoint request of the membership document served", now.checkpoint)
    yield _family(CounterMetricFamily, "kubeps_dataset_reshards",
                  "Times the per-worker datasets were sharded again for a new membership", now.reshards)
    yield _family(CounterMetricFamily, "kubeps_dataset_records_reread",
                  "Records read in a pass that a reshard, a worker leaving or a worker restarting cut short, which "
                  "the new shards read again (at-least-once)", now.records_reread)
    if inputs is not None:
        records = inputs()
        for name, text in _INPUT:
            yield _family(CounterMetricFamily, f"kubeps_input_records_{name}", text, getattr(records, name))


def _family(kind: type[Family], name: str, text: str, value: float) -> Family:
    family = kind(name, text)
    family.add_metric([], value)
    return family
