"""How many CPUs a task may use, and math thread pools sized to it.

numpy's BLAS (OpenBLAS, MKL) and OpenMP start one thread per core of the *machine* by default. A parameter-server
job runs several tasks per machine (``kubeps local``) or pods with CPU limits far below the node's core count, so
those pools oversubscribe the CPUs the task really has and spin against each other: on 2 cores with 2 ps and 2
workers the same training ran ~3x slower with OpenBLAS' default than with one thread per task.

:func:`cpu_budget` finds the CPUs this task may use, the smallest of:

* ``KUBEPS_CPUS`` (a positive integer) when set -- ``kubeps local`` sets it to each task's share of the machine;
* the CPU quota of the task's cgroup (a pod's ``resources.limits.cpu``: cgroup v2 ``cpu.max``, v1
  ``cpu.cfs_quota_us / cpu.cfs_period_us``), rounded up;
* the CPUs the process may run on (``sched_getaffinity``; ``cpuset`` / static CPU manager).

:func:`limit_math_threads` caps every loaded BLAS/OpenMP pool to that number with ``threadpoolctl``. Servers and the
strategy call it when they start, so ps, worker and chief processes are sized wherever they run (``kubeps
local``, the runtime image under the operator, or a plain ``python train.py``).
"""

from __future__ import annotations

import logging
import math
import os
import threading

from threadpoolctl import threadpool_limits

from kubeps.runtime.contract import CPUS_ENV
from kubeps.runtime.settings import TaskSettings

__all__ = ["CPUS_ENV", "CpuBudget", "cpu_budget", "limit_math_threads"]

_CGROUP_ROOT = "/sys/fs/cgroup"

_log = logging.getLogger("kubeps.threads")
_applied_lock = threading.Lock()
_applied: "CpuBudget | None" = None


class CpuBudget(int):
    """An ``int`` number of CPUs that remembers where it came from (``.source``)."""

    source: str

    def __new__(cls, value: int, source: str) -> "CpuBudget":
        obj = super().__new__(cls, value)
        obj.source = source
        return obj


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpu_limit(root: str = _CGROUP_ROOT) -> float | None:
    """CPUs allowed by the cgroup quota (``2.5`` for a 2500m limit), or None without a quota."""
    v2 = _read(os.path.join(root, "cpu.max"))
    if v2:
        quota, _, period = v2.partition(" ")
        if quota != "max":
            try:
                q, p = int(quota), int(period or 100_000)
                if q > 0 and p > 0:
                    return q / p
            except ValueError:
                pass
        return None
    for folder in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
        quota_us = _read(os.path.join(root, folder, "cpu.cfs_quota_us"))
        period_us = _read(os.path.join(root, folder, "cpu.cfs_period_us"))
        if quota_us is None or period_us is None:
            continue
        try:
            q, p = int(quota_us), int(period_us)
        except ValueError:
            return None
        return q / p if q > 0 and p > 0 else None
    return None


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_budget(settings: TaskSettings | None = None, cgroup_root: str = _CGROUP_ROOT) -> CpuBudget:
    """The number of CPUs this task may use (see the module docstring); at least 1. ``settings`` default to
    :meth:`TaskSettings.from_env() <kubeps.runtime.settings.TaskSettings.from_env>`."""
    settings = TaskSettings.from_env() if settings is None else settings
    candidates = [(_affinity(), "affinity")]
    limit = cgroup_cpu_limit(cgroup_root)
    if limit is not None:
        candidates.append((max(1, math.ceil(limit - 1e-9)), "cgroup quota"))
    if settings.cpus is not None:
        candidates.append((settings.cpus, CPUS_ENV))
    value, source = min(candidates, key=lambda c: c[0])
    return CpuBudget(max(1, value), source)


def limit_math_threads(cpus: int | None = None, settings: TaskSettings | None = None) -> CpuBudget:
    """Cap the BLAS/OpenMP thread pools of this process to ``cpus`` (default: :func:`cpu_budget` of ``settings``).

    Idempotent: a second call with no argument returns the first result. Pools of libraries loaded later are
    capped by the next explicit call."""
    global _applied
    with _applied_lock:
        if cpus is None and _applied is not None:
            return _applied
        budget = cpu_budget(settings) if cpus is None else CpuBudget(int(cpus), "argument")
        threadpool_limits(limits=int(budget))
        _applied = budget
        _log.info("math thread pools capped at %d thread(s) (%s)", int(budget), budget.source)
        return budget
