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
local``, the runtime image under the operator, or a plain ``python train.py``). A worker then sizes its pools by
benefit within that cap (:class:`MathThreadTuner`): more threads only where they make its closures faster without
costing more CPU per closure.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from threadpoolctl import threadpool_limits

from kubeps.runtime.contract import CPUS_ENV
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.settings import TaskSettings

__all__ = ["CPUS_ENV", "CpuBudget", "MathThreadTuner", "cpu_budget", "limit_math_threads"]

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


def cpu_budget(settings: TaskSettings, cgroup_root: str = _CGROUP_ROOT) -> CpuBudget:
    """The number of CPUs this task may use (see the module docstring) under the task's ``settings``; at least 1."""
    candidates = [(_affinity(), "affinity")]
    limit = cgroup_cpu_limit(cgroup_root)
    if limit is not None:
        candidates.append((max(1, math.ceil(limit - 1e-9)), "cgroup quota"))
    if settings.cpus is not None:
        candidates.append((settings.cpus, CPUS_ENV))
    value, source = min(candidates, key=lambda c: c[0])
    return CpuBudget(max(1, value), source)


def limit_math_threads(cpus: int | None = None, settings: TaskSettings | None = None) -> CpuBudget:
    """Cap the BLAS/OpenMP thread pools of this process to ``cpus`` (default: :func:`cpu_budget` of ``settings``,
    the task's; one of the two is needed).

    Idempotent: a second call with no argument returns the first result. Pools of libraries loaded later are
    capped by the next explicit call."""
    global _applied
    with _applied_lock:
        if cpus is None and _applied is not None:
            return _applied
        if cpus is not None:
            budget = CpuBudget(int(cpus), "argument")
        elif settings is not None:
            budget = cpu_budget(settings)
        else:
            raise RuntimeConfigError("settings", None, "the task's settings (or cpus=N): they say its CPU budget")
        threadpool_limits(limits=int(budget))
        _applied = budget
        _log.info("math thread pools capped at %d thread(s) (%s)", int(budget), budget.source)
        return budget


class MathThreadTuner:
    """Sizes a worker's math thread pools by what they buy, not by its budget.

    BLAS pools sized to a task's whole CPU budget spin on the small matmuls of a typical step: on 16 cores a CTR
    worker given 4 threads burnt 3.75 cores for the examples/s one thread gives. The tuner tries the thread counts
    1, 2, 4, ... up to ``budget`` over the worker's first closures (``trials`` each, after ``warmup``), measuring each
    closure's wall time and the process's CPU time (BLAS threads included), and keeps the count with the shortest
    closures among those that use at most ``cpu_slack`` x the CPU of one thread and are at least ``min_gain`` x
    faster than one thread; else one thread. The choice is logged. ``measure()`` wraps one closure; closures that
    overlap another are not counted. ``apply(n)`` sets the pools (default :func:`threadpoolctl.threadpool_limits`).
    """

    def __init__(self, budget: int, *, trials: int = 3, warmup: int = 2, cpu_slack: float = 1.2,
                 min_gain: float = 1.1, apply: Callable[[int], Any] | None = None,
                 clocks: tuple[Callable[[], float], Callable[[], float]] = (time.perf_counter, time.process_time)):
        self.budget = max(1, int(budget))
        counts = [1]
        while counts[-1] * 2 < self.budget:
            counts.append(counts[-1] * 2)
        if self.budget > 1:
            counts.append(self.budget)
        self.candidates = counts
        self.trials, self.warmup, self.cpu_slack, self.min_gain = trials, warmup, cpu_slack, min_gain
        self._apply = apply or (lambda n: threadpool_limits(limits=n))
        self._wall, self._cpu = clocks
        self._lock = threading.Lock()
        self._active = 0
        self._starts = 0
        self._seen = 0
        self._index = 0
        self._samples: dict[int, list[tuple[float, float]]] = {n: [] for n in counts}
        #: the thread count chosen (None while trying)
        self.chosen: int | None = None if len(counts) > 1 else 1
        if self.chosen is None:
            self._apply(self.candidates[0])

    @contextmanager
    def measure(self) -> Iterator[None]:
        if self.chosen is not None:
            yield
            return
        with self._lock:
            self._active += 1
            self._starts += 1
            alone, started = self._active == 1, self._starts
            count = self.candidates[self._index]
        wall, cpu = self._wall(), self._cpu()
        try:
            yield
        finally:
            wall, cpu = self._wall() - wall, self._cpu() - cpu
            with self._lock:
                alone = alone and self._starts == started  # no other closure began meanwhile
                self._active -= 1
                if self.chosen is None and alone and count == self.candidates[self._index]:
                    self._record(count, wall, cpu)

    def _record(self, count: int, wall: float, cpu: float) -> None:
        self._seen += 1
        if self._seen <= self.warmup:
            return
        samples = self._samples[count]
        samples.append((wall, cpu))
        if len(samples) < self.trials:
            return
        if self._index + 1 < len(self.candidates):
            self._index += 1
            self._apply(self.candidates[self._index])
            return
        median = {n: (sorted(w for w, _ in s)[len(s) // 2], sorted(c for _, c in s)[len(s) // 2])
                  for n, s in self._samples.items()}
        wall_1, cpu_1 = median[1]
        eligible = [n for n in self.candidates[1:]
                    if median[n][1] <= self.cpu_slack * cpu_1 and median[n][0] * self.min_gain <= wall_1]
        self.chosen = min(eligible, key=lambda n: median[n][0]) if eligible else 1
        self._apply(self.chosen)
        _log.info("math thread pools: %d thread(s) of a budget of %d, chosen by what they buy (median wall / CPU ms "
                  "per closure: %s)", self.chosen, self.budget,
                  ", ".join(f"{n} thread(s) {w * 1e3:.1f} / {c * 1e3:.1f}" for n, (w, c) in median.items()))
