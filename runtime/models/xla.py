"""jax's CPU backend, created with XLA's thread pool sized to this task's CPU budget.

The BLAS pools of numpy are capped per task (:mod:`kubeps.runtime.util.threads`): 2 ps and 2 workers on 2 cores get
one math thread each. XLA's CPU client has a pool of its own (threads named ``tf_XLAEigen``) that runs compiled
computations and their intra-op parallelism. Its size is the number of CPUs the process may run on
(``sched_getaffinity``) *when jax creates its backend*, and no ``XLA_FLAGS`` entry sets it: jaxlib 0.10 has no
``intra_op_parallelism_threads`` flag (it is not an XLA flag at all), and ``--xla_cpu_multi_thread_eigen=false``
did not stop a jitted matmul from running on two threads on our 2-core machine. So :func:`size_cpu_backend` creates the
backend while the calling thread may run on only ``budget`` CPUs -- XLA sizes its pool from that, and the pool's
threads are created then -- and gives the calling thread and every thread created meanwhile their whole CPU set
back. The pool keeps ``budget`` threads, which may run on any of the task's CPUs.

It must run before anything else in the process makes jax create its backend (the first computation, or
``jax.devices()``; ``import jax`` alone does not). :mod:`kubeps.runtime.models.autodiff` calls it before its first use
of jax, and ``Server`` (ps, worker) and ``ParameterServerStrategy`` (the chief) call it when they start if the
program has imported jax by then (:func:`size_cpu_backend_if_loaded`). A program that computes with jax before
either (e.g. initial values with ``jax.random`` at import time) calls :func:`size_cpu_backend` first.
Where the budget covers every CPU the process may use, or on a platform without ``sched_setaffinity``, the backend is
created as jax would create it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.util.threads import cpu_budget

__all__ = ["size_cpu_backend", "size_cpu_backend_if_loaded", "xla_pool_threads"]

_log = logging.getLogger("kubeps.threads")
_lock = threading.Lock()
_sized: int | None = None
#: the name XLA gives the threads of its CPU pool
POOL_THREAD_NAME = "tf_XLAEigen"


def _backend_created() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def _thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def import_jax() -> Any:
    """``jax``, after :func:`size_cpu_backend`; an ImportError that names the extra when jax is not installed."""
    try:
        import jax  # noqa: PLC0415 - jax is optional and loads only in a process that computes with it
    except ImportError as err:
        raise ImportError(f"kubeps.runtime.models needs jax ({err}); install it with: pip install 'kubeps[jax]'") from err
    size_cpu_backend()
    return jax


def size_cpu_backend(cpus: int | None = None, settings: TaskSettings | None = None) -> int:
    """Create jax's backends (once per process) with XLA's CPU pool at ``cpus`` threads (default: the task's
    :func:`~kubeps.runtime.util.threads.cpu_budget` under ``settings``); returns the budget it used (the first
    call's, later)."""
    global _sized
    with _lock:
        if _sized is not None:
            return _sized
        import jax  # noqa: PLC0415 - jax is optional: only a process that computes with it loads it

        budget = int(cpus) if cpus is not None else int(cpu_budget(settings))
        if _backend_created():
            _log.warning("jax created its backend before kubeps could size XLA's thread pool: it has as many threads "
                         "as the CPUs this process may run on, not the task's budget of %d; call "
                         "kubeps.runtime.models.xla.size_cpu_backend() before computing with jax", budget)
        elif not hasattr(os, "sched_setaffinity") or budget >= len(os.sched_getaffinity(0)):
            jax.devices()
        else:
            allowed = os.sched_getaffinity(0)
            before = _thread_ids()
            os.sched_setaffinity(0, sorted(allowed)[:budget])
            try:
                jax.devices()
            finally:
                os.sched_setaffinity(0, allowed)
                for tid in _thread_ids() - before:
                    try:
                        os.sched_setaffinity(tid, allowed)
                    except OSError:  # the thread ended meanwhile
                        pass
        _sized = budget
        _log.info("XLA CPU thread pool sized for %d CPU(s)", budget)
        return budget


def size_cpu_backend_if_loaded(settings: TaskSettings | None = None) -> None:
    """:func:`size_cpu_backend` when this process has imported jax (a program that imports it at its top), before
    its first computation: ``Server`` and ``ParameterServerStrategy`` call this when they start, beside the BLAS
    caps. A process that never imported jax does not load it."""
    if sys.modules.get("jax") is not None:
        size_cpu_backend(settings=settings)


def xla_pool_threads() -> int:
    """How many threads XLA's CPU pool has in this process (Linux; 0 before jax created its backend)."""
    count = 0
    for tid in _thread_ids():
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == POOL_THREAD_NAME
        except OSError:
            continue
    return count
