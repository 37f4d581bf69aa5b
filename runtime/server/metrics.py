"""What a ps or worker task's state tells Prometheus, read at each scrape (:func:`state_collector`).

A parameter server counts its traffic per variable anyway (:class:`~kubeps.runtime.ps.state.PSVariable`: rows and
bytes read and pushed, lock wait, updates) and its dynamic tables count lookups, hits, admissions and evictions;
these families turn those counters into metrics when Prometheus asks, so serving them costs the step path nothing.
A sharded variable's parts (``name/part_i``) are one ``variable`` label with a ``shard`` label each; an unsharded
variable is shard ``0``. A worker reports the closures it ran.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kubeps.runtime.ps.dynamic import tables_of
from kubeps.runtime.ps.state import ParameterServerState
from kubeps.runtime.worker.state import WorkerState

__all__ = ["split_shard", "state_collector"]

#: (metric name without ``_total``, help, PSVariable attribute) of the per-variable counters of a ps
_VARIABLE_COUNTERS = (
    ("kubeps_ps_variable_read_rows", "Rows read from a variable shard", "rows_read"),
    ("kubeps_ps_variable_read_bytes", "Bytes read from a variable shard", "bytes_read"),
    ("kubeps_ps_variable_pushed_rows", "Gradient rows applied to a variable shard", "rows_pushed"),
    ("kubeps_ps_variable_pushed_bytes", "Gradient bytes applied to a variable shard", "bytes_pushed"),
    ("kubeps_ps_variable_lock_wait_seconds", "Seconds reads and pushes waited for a variable shard's lock",
     "lock_wait_s"),
    ("kubeps_ps_variable_updates", "Optimizer updates applied to a variable shard", "updates"),
)
#: (metric name, help, DynamicTable attribute) of a dynamic table's counters
_TABLE_COUNTERS = (
    ("kubeps_dynamic_table_lookups", "Keys looked up in this ps's shard of a dynamic table", "lookups"),
    ("kubeps_dynamic_table_hits", "Looked-up keys that had a row", "hits"),
    ("kubeps_dynamic_table_admissions", "Keys admitted (given a row)", "admitted"),
    ("kubeps_dynamic_table_evictions", "Rows evicted", "evicted"),
)


def split_shard(name: str) -> tuple[str, str]:
    """``("emb", "3")`` for the shard ``emb/part_3``; ``(name, "0")`` for an unsharded variable."""
    base, sep, part = name.rpartition("/part_")
    return (base, part) if sep and part.isdigit() else (name, "0")


def _ps_families(state: ParameterServerState) -> Iterable[Any]:
    variables = list(state.variables.values())
    for metric, text, attr in _VARIABLE_COUNTERS:
        family = CounterMetricFamily(metric, text, labels=["variable", "shard"])
        for var in variables:
            family.add_metric(list(split_shard(var.name)), getattr(var, attr))
        yield family
    count = GaugeMetricFamily("kubeps_ps_variables", "Variable shards this ps holds")
    count.add_metric([], len(variables))
    yield count
    tables = list(tables_of(state).tables.values())
    size = GaugeMetricFamily("kubeps_dynamic_table_rows", "Rows in this ps's shard of a dynamic table",
                             labels=["table"])
    for table in tables:
        size.add_metric([table.name], table.size)
    yield size
    for metric, text, attr in _TABLE_COUNTERS:
        family = CounterMetricFamily(metric, text, labels=["table"])
        for table in tables:
            family.add_metric([table.name], getattr(table, attr))
        yield family


def _worker_families(state: WorkerState) -> Iterable[Any]:
    closures = CounterMetricFamily("kubeps_worker_closures", "Scheduled functions this worker ran")
    closures.add_metric([], state.closures_run)
    yield closures


def state_collector(state: Any) -> Any:
    """A scrape-time function of a ps's or a worker's state, for :func:`kubeps.runtime.observe.metrics.add_collector`."""
    if isinstance(state, ParameterServerState):
        return lambda: _ps_families(state)
    return lambda: _worker_families(state)
