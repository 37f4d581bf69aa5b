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

Placement (:func:`place_jax`): the task's role and settings decide which platforms jax may use when it creates its
backend. A chief, a ps and a task with ``KUBEPS_DEVICE=cpu`` get ``jax_platforms=cpu`` (they never grab a GPU); a
worker on a GPU gets ``jax_default_device`` set to its GPU and XLA's preallocation limited to its share of the
device (``XLA_PYTHON_CLIENT_MEM_FRACTION`` = 0.9 / ``KUBEPS_GPU_TASKS``, written before the backend is created); a worker
with ``KUBEPS_DEVICE=gpu`` whose jax sees no GPU fails with
:class:`~kubeps.runtime.ops.kernels.DeviceUnavailableError`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from kubeps.runtime.ops.kernels import DEVICE_ENV, DeviceUnavailableError, memory_share
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.util.threads import cpu_budget

__all__ = ["place_jax", "size_cpu_backend", "size_cpu_backend_if_loaded", "xla_pool_threads"]

_log = logging.getLogger("kubeps.threads")
_lock = threading.Lock()
_sized: int | None = None
#: (role, settings) of this task, once :func:`place_jax` recorded them
_placement: tuple[str, TaskSettings] | None = None
#: the environment variable XLA's GPU client reads its memory fraction from
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
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
    :func:`~kubeps.runtime.util.threads.cpu_budget` under ``settings``, else under the settings the task's ``Server``
    or ``ParameterServerStrategy`` gave :func:`place_jax`; a process with neither: the CPUs it may run on, by its
    affinity and cgroup quota); returns the budget it used (the first call's, later)."""
    global _sized
    with _lock:
        if _sized is not None:
            return _sized
        import jax  # noqa: PLC0415 - jax is optional: only a process that computes with it loads it

        if cpus is not None:
            budget = int(cpus)
        else:
            placed = _placement[1] if _placement is not None else TaskSettings()
            budget = int(cpu_budget(placed if settings is None else settings))
        created = _backend_created()
        if not created:
            _choose_platforms(jax)
        if created:
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
        _choose_device(jax)
        return budget


def place_jax(settings: TaskSettings, role: str) -> None:
    """Record this task's ``role`` (``chief``, ``ps``, ``worker``, ``evaluator``) and settings for jax's placement
    (module docstring); applied when jax creates its backend (:func:`size_cpu_backend`), now or later. Loads no
    jax."""
    global _placement
    _placement = (role, settings)


def _choose_platforms(jax: Any) -> None:
    """Before the backend exists: CPU only for a task that must not use a GPU; a GPU worker's memory share."""
    if _placement is None:
        return
    role, settings = _placement
    if role != "worker" or settings.device == "cpu":
        jax.config.update("jax_platforms", "cpu")
        return
    # a write, not a read: XLA's GPU client reads its own variable when the backend is created
    os.environ[MEM_FRACTION_ENV] = f"{memory_share(settings):.3f}"


def _choose_device(jax: Any) -> None:
    """After the backend exists: a GPU worker computes on its GPU by default; one asked for and absent fails."""
    if _placement is None:
        return
    role, settings = _placement
    if role != "worker" or settings.device == "cpu":
        return
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        if settings.device == "gpu":
            raise DeviceUnavailableError(f"{DEVICE_ENV}=gpu was requested but jax sees no GPU (its devices: "
                                         f"{[str(d) for d in jax.devices()]}; install jax with its CUDA plugin); set "
                                         f"{DEVICE_ENV}=cpu to run on the CPU")
        return
    jax.config.update("jax_default_device", gpus[0])
    _log.info("jax computes on %s (XLA memory fraction %.3f)", gpus[0], memory_share(settings))


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
