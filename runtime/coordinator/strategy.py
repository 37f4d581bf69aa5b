"""``ParameterServerStrategy``: where variables live.

As TensorFlow's ``tf.distribute.experimental.ParameterServerStrategy``: variables created inside ``scope()`` are
placed round-robin on the ps tasks (``/job:ps/task:{count % num_ps}``); with a ``variable_partitioner`` a
variable of rank >= 1 is split along axis 0 into ``name/part_i`` shards (TF's "div" split), each placed round-robin
too. Variables created outside any scope stay local to the coordinator.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from kubeps.runtime.variables import context as _context
from kubeps.runtime.cluster import ClusterSpec, TFConfigClusterResolver
from kubeps.runtime.data.distribute import distribute_dataset, distribute_datasets_from_function
from kubeps.runtime.checks import NonNegativeInt, check
from kubeps.runtime.errors import PSUnavailableError, RuntimeConfigError
from kubeps.runtime.variables.partitioners import div_split
from kubeps.runtime.rpc.client import DEFAULT_TIMEOUT_S
from kubeps.runtime.rpc.security import load_job_token
from kubeps.runtime.rpc.tls import TLSConfig, load_tls
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.util.threads import limit_math_threads
from kubeps.runtime.models.xla import place_jax, size_cpu_backend_if_loaded
from kubeps.runtime.rpc.transport import PSTransport
from kubeps.runtime.variables.variable import ShardedVariable, Variable, variable_array
from kubeps.runtime.rpc.protocol import PING, PS, NamesRequest

__all__ = ["ParameterServerStrategy"]

log = logging.getLogger("kubeps.runtime.coordinator.strategy")

#: a normal start (every ps answers within this many seconds) is not announced
STARTUP_QUIET_S = 1.0


class ParameterServerStrategy:
    """``ParameterServerStrategy(cluster_resolver, variable_partitioner=None)``.

    kubeps extras (keyword-only): ``job_token`` and ``tls`` (mutual TLS files, :class:`~kubeps.runtime.rpc.tls.TLSConfig`;
    both default to those of ``settings``, the task's settings: default the resolver's
    (:attr:`TFConfigClusterResolver.settings <kubeps.runtime.cluster.TFConfigClusterResolver.settings>`), else
    :meth:`TaskSettings.from_env() <kubeps.runtime.settings.TaskSettings.from_env>` read once here; the strategy
    passes them down to what it builds), ``rpc_timeout`` (seconds,
    the deadline of variable reads and writes from the coordinator) and ``ps_startup_timeout`` (seconds the
    first variable creation waits for every parameter server to answer: tasks of a job start together, and a
    coordinator that dials a ps before it listens must wait, not crash).

    ``dense_staleness`` (default 0: every step reads the dense variables afresh, as TensorFlow does) lets a worker
    reuse the dense weights it pulled in one step for its next ``dense_staleness`` steps before pulling them again;
    its gradients still reach the parameter servers every step. Embedding tables' rows are always looked up fresh.
    It trades a bounded staleness of the reads (stale synchronous parallel) for fewer bytes on the wire: on the Wide
    & Deep shape, whose 1.1 M dense weights cross the wire every step, ``dense_staleness=3`` cuts the job's CPU per
    step (docs/benchmarks.md, with its effect on the eval log-loss).
    """

    def __init__(self, cluster_resolver: Any, variable_partitioner: Callable[[Any, Any], list[int]] | None = None,
                 *, job_token: str | None = None, rpc_timeout: float = DEFAULT_TIMEOUT_S,
                 ps_startup_timeout: float = 120.0, tls: TLSConfig | None = None,
                 settings: TaskSettings | None = None, dense_staleness: int = 0):
        if cluster_resolver is None or not hasattr(cluster_resolver, "cluster_spec"):
            raise RuntimeConfigError("cluster_resolver", cluster_resolver,
                                     "must be a cluster resolver such as TFConfigClusterResolver()")
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise RuntimeConfigError("variable_partitioner", variable_partitioner,
                                     "must be None or a callable partitioner(shape, dtype) -> [num_shards, 1, ...]")
        #: how many of a worker's later steps may reuse a dense value it pulled (0: every step pulls, as TF)
        self.dense_staleness = check("dense_staleness", dense_staleness, NonNegativeInt, owner="ParameterServerStrategy")
        task_type = getattr(cluster_resolver, "task_type", None)
        if task_type in ("ps", "worker"):
            # every task runs the same program: one that builds the strategy on a ps or worker would start no
            # server, and every coordinator in the job would wait for servers that never come
            raise RuntimeConfigError(
                "TF_CONFIG.task.type", task_type,
                "ParameterServerStrategy runs on the chief (the coordinator) only; a 'ps' or 'worker' task runs a "
                "server instead: branch on the task type, e.g. `if resolver.task_type in ('ps', 'worker'): "
                "kp.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id)"
                ".join()` (as the README's example does)",
            )
        spec = cluster_resolver.cluster_spec()
        spec = spec if isinstance(spec, ClusterSpec) else ClusterSpec(spec)
        jobs = spec.as_dict()
        missing = [job for job in ("ps", "worker") if not jobs.get(job)]
        if missing:
            summary = {job: len(tasks) for job, tasks in jobs.items()} or "no tasks at all"
            raise RuntimeConfigError(
                "TF_CONFIG.cluster", summary,
                f"ParameterServerStrategy needs at least one 'ps' and one 'worker' task; missing {missing}",
            )
        if settings is None:
            settings = getattr(cluster_resolver, "settings", None)
        if settings is None:  # an entry point: the chief's program builds the strategy
            settings = TaskSettings.from_env()
        limit_math_threads(settings=settings)  # the chief's own numpy work (evaluation, checkpoints) sized to its CPUs
        place_jax(settings, "chief")  # the chief's jax (where the program loads it) stays on the CPU
        size_cpu_backend_if_loaded(settings)  # and its jax work, where the program imported jax
        #: the chief's settings (the coordinator serves its metrics on their port)
        self.settings = settings
        self.cluster_resolver = cluster_resolver
        self._cluster_spec = spec
        self._variable_partitioner = variable_partitioner
        self._token = job_token if job_token is not None else load_job_token(settings)
        self._tls = tls if tls is not None else load_tls(settings)
        self._transport = PSTransport(spec.job_tasks("ps"), self._token, rpc_timeout, tls=self._tls,
                                      settings=settings)
        self._lock = threading.Lock()
        self._next_ps = 0
        self._names: dict[str, int] = {}
        self._keys: set[str] = set()  # every key handed out (variables and shards)
        if not ps_startup_timeout > 0:
            raise RuntimeConfigError("ps_startup_timeout", ps_startup_timeout, "must be a number of seconds > 0")
        self._ps_startup_timeout = float(ps_startup_timeout)
        self._ps_ready = False
        self._ps_waiting = False

    # -- cluster ---------------------------------------------------------------------------------------------
    @property
    def cluster_spec(self) -> ClusterSpec:
        return self._cluster_spec

    @property
    def num_ps(self) -> int:
        return self._cluster_spec.num_tasks("ps")

    @property
    def num_workers(self) -> int:
        return self._cluster_spec.num_tasks("worker")

    @property
    def worker_addresses(self) -> list[str]:
        return self._cluster_spec.job_tasks("worker")

    @property
    def ps_addresses(self) -> list[str]:
        return self._cluster_spec.job_tasks("ps")

    @property
    def variable_partitioner(self):
        return self._variable_partitioner

    @property
    def job_token(self) -> str | None:
        return self._token

    @property
    def tls(self) -> TLSConfig | None:
        """The mutual TLS credentials its clients dial with (None: plaintext)."""
        return self._tls

    @property
    def transport(self) -> PSTransport:
        return self._transport

    @classmethod
    def from_tf_config(cls, **kwargs: Any) -> "ParameterServerStrategy":
        return cls(TFConfigClusterResolver(), **kwargs)

    @contextlib.contextmanager
    def scope(self) -> Iterator["ParameterServerStrategy"]:
        """Variables created inside live on the parameter servers."""
        _context.push_strategy(self)
        try:
            yield self
        finally:
            _context.pop_strategy(self)

    @property
    def ps_ready(self) -> bool:
        """Whether every parameter server has answered once (:meth:`wait_for_parameter_servers`)."""
        return self._ps_ready

    @property
    def ps_waiting(self) -> bool:
        """Whether :meth:`wait_for_parameter_servers` is waiting right now (the failure detector leaves a ps that
        never answered to it meanwhile: starting, not dead)."""
        return self._ps_waiting

    @property
    def ps_startup_timeout(self) -> float:
        return self._ps_startup_timeout

    def wait_for_parameter_servers(self, timeout: float | None = None) -> None:
        """Block until every ps answers a ping; raise ``PSUnavailableError`` naming the first silent one.

        Called before the first variable is created; a wrong job token fails at once (it will not get better).
        While it waits it says so, for how long and for which addresses (tasks of a job start together, so a
        parameter server that does not listen yet is normal for a few seconds)."""
        if self._ps_ready:
            return
        self._ps_waiting = True
        try:
            self._wait_for_parameter_servers(timeout)
        finally:
            self._ps_waiting = False

    def _wait_for_parameter_servers(self, timeout: float | None) -> None:
        limit = self._ps_startup_timeout if timeout is None else timeout
        began = time.monotonic()
        silent = list(range(self.num_ps))
        errors: dict[int, PSUnavailableError] = {}
        announced = False
        while silent:
            for ps in list(silent):
                try:
                    self._transport.call(ps, PING, timeout=1.0)
                    silent.remove(ps)
                except PSUnavailableError as err:
                    errors[ps] = err
            if not silent:
                break
            waited = time.monotonic() - began
            if waited > limit:
                first = silent[0]
                raise PSUnavailableError(
                    first, self.ps_addresses[first],
                    f"no answer within ps_startup_timeout={limit:g} s (the chief waits that long for every "
                    f"parameter server to start; still silent: {self._describe_ps(silent)}); last error: "
                    f"{errors[first]}", code=errors[first].code)
            if not announced and waited >= STARTUP_QUIET_S:
                log.warning("waiting up to %g s (ps_startup_timeout) for %d parameter server(s) to answer: %s",
                            limit, len(silent), self._describe_ps(silent))
                announced = True
            time.sleep(0.1)
        if announced:
            log.warning("every parameter server answered after %.1f s", time.monotonic() - began)
        self._ps_ready = True

    def _describe_ps(self, indices: list[int]) -> str:
        return ", ".join(f"/job:ps/task:{ps} at {self.ps_addresses[ps]}" for ps in indices)

    # -- variable creation -----------------------------------------------------------------------------------
    def _unique_name(self, name: str, shards: int = 1) -> str:
        """``name``, else ``name_1``, ``name_2`` ...: the first key neither generated nor given before (shard keys
        ``key/part_i`` count too), so that no CreateVariables ever replaces another variable on a ps."""
        with self._lock:
            count = self._names.get(name, 0)
            while True:
                key = name if count == 0 else f"{name}_{count}"
                count += 1
                parts = [f"{key}/part_{i}" for i in range(shards)] if shards > 1 else []
                if key not in self._keys and not self._keys.intersection(parts):
                    break
            self._names[name] = count
            self._keys.add(key)
            self._keys.update(parts)
        return key

    def _place(self) -> int:
        with self._lock:
            ps = self._next_ps % self.num_ps
            self._next_ps += 1
        return ps

    def _num_shards(self, shape: tuple[int, ...], dtype: np.dtype) -> int:
        if self._variable_partitioner is None or len(shape) == 0 or shape[0] <= 1:
            return 1
        parts = self._variable_partitioner(shape, dtype)
        try:
            n = int(list(parts)[0])
        except (TypeError, ValueError, IndexError):
            raise RuntimeConfigError("variable_partitioner", parts,
                                     "a partitioner must return a list like [num_shards, 1, ...]") from None
        if n < 1:
            raise RuntimeConfigError("variable_partitioner", parts, "the number of shards must be >= 1")
        return min(n, shape[0])

    def create_variable(self, initial_value: Any, name: str | None, dtype: Any, trainable: bool,
                        shape: Any = None) -> Variable | ShardedVariable:
        """What ``Variable(...)`` does inside ``scope()``: place (and maybe shard) it on the parameter servers."""
        value = initial_value() if callable(initial_value) else initial_value
        array = variable_array(value, dtype)
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise RuntimeConfigError("shape", shape, f"the initial value has shape {list(array.shape)}")
        self.wait_for_parameter_servers()
        n = self._num_shards(tuple(array.shape), array.dtype)
        key = self._unique_name(name or "Variable", n)
        # small variables (dense weights, sharded or not) are pulled whole once per step with the step's first call;
        # big ones (embedding tables) only ever have the rows a step looks up read
        prefetch = array.nbytes <= _context.PREFETCH_MAX_BYTES
        # a bounded staleness lets a worker reuse the dense values it pulled; never the rows of a table
        staleness = self.dense_staleness if prefetch else 0
        if n == 1:
            ps = self._place()
            self._transport.call(ps, PS.CREATE_VARIABLES, NamesRequest(names=[key]), [array])
            return Variable.remote_handle(key, key, array.shape, array.dtype, trainable, ps, self._transport,
                                         prefetch=prefetch, staleness=staleness)
        shards: list[Variable] = []
        per_ps: dict[int, tuple[list[str], list[np.ndarray]]] = {}
        for i, (start, stop) in enumerate(div_split(array.shape[0], n)):
            ps = self._place()
            shard_key = f"{key}/part_{i}"
            names, values = per_ps.setdefault(ps, ([], []))
            names.append(shard_key)
            values.append(array[start:stop])
            shards.append(Variable.remote_handle(shard_key, shard_key, (stop - start,) + array.shape[1:],
                                                 array.dtype, trainable, ps, self._transport, prefetch=prefetch,
                                                 staleness=staleness))
        self._transport.call_many({ps: (PS.CREATE_VARIABLES, NamesRequest(names=names), values)
                                   for ps, (names, values) in per_ps.items()})
        return ShardedVariable(shards, name=key)

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run ``fn`` once (one replica per worker, as TF's PS strategy on CPU): ``fn(*args, **kwargs)``."""
        return fn(*args, **(kwargs or {}))

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Every worker reads its auto-shard of ``dataset`` (its ``AutoShardPolicy``; batches keep their size, one
        replica per worker). On the coordinator: a ``DistributedDataset`` for
        ``ClusterCoordinator.create_per_worker_dataset``; inside a dataset fn on a worker: that worker's dataset."""
        return distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Every worker calls ``dataset_fn(input_context)`` (batching and sharding are its own). On the
        coordinator: a ``DistributedDataset`` for ``ClusterCoordinator.create_per_worker_dataset``; inside a
        dataset fn on a worker: that worker's dataset."""
        return distribute_datasets_from_function(dataset_fn, options)

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    def __reduce__(self):
        # a scheduled function that captures the strategy gets a light stand-in on the worker
        return (_WorkerSideStrategy, (self.num_workers, self.num_ps))

    def close(self) -> None:
        self._transport.close()

    def __repr__(self) -> str:
        return f"ParameterServerStrategy(num_ps={self.num_ps}, num_workers={self.num_workers})"


class _WorkerSideStrategy:
    """What a strategy captured by a scheduled function becomes on the worker: ``run`` calls the function."""

    def __init__(self, num_workers: int, num_ps: int):
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.num_replicas_in_sync = 1

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        return fn(*args, **(kwargs or {}))

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Inside a dataset fn (TF's per-worker pattern): this worker's auto-shard of ``dataset``."""
        return distribute_dataset(dataset, options).build(_context.current_input_context(self.num_workers))

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Inside a dataset fn (TF's per-worker pattern): ``dataset_fn(input_context)`` of this worker."""
        return distribute_datasets_from_function(dataset_fn, options).build(
            _context.current_input_context(self.num_workers))

    def scope(self):
        return contextlib.nullcontext(self)
