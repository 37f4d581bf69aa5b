"""The TF_CONFIG model shared by the operator (which writes it) and the runtime (which reads it).

The shape is TensorFlow's::

    {"cluster": {"chief": ["h:p"], "ps": [...], "worker": [...], "evaluator": [...]},
     "task": {"type": "ps", "index": 1},
     "rpc_layer": "grpc"}

``rpc_layer`` and ``environment`` are optional and unknown keys are ignored, as in TensorFlow's
``TFConfigClusterResolver``. On top of what TensorFlow checks, a malformed TF_CONFIG raises
:class:`TFConfigError` whose message names the field, the value and what is allowed.

TF_CONFIG is fixed when a task starts. The workers of a running job may change: :class:`Membership` is the
document that says who they are now (written by the operator into the job's membership ConfigMap, and by
``kubeps local scale``; read by the chief's :mod:`~kubeps.runtime.coordinator.membership` watcher), and
:class:`MembershipAck` is what the chief writes back once it applied one (docs/elastic.md).
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any, Iterable, Mapping, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from kubeps.runtime.checks import NonNegativeInt, check, integer
from kubeps.runtime.errors import FieldError, RuntimeConfigError, short_repr
from kubeps.runtime.contract import PS_PROCESSES_ENV
from kubeps.runtime.settings import TaskSettings

__all__ = [
    "TASK_TYPES",
    "TRAINING_TASK_TYPES",
    "ClusterSpec",
    "Membership",
    "MembershipAck",
    "TFConfig",
    "TFConfigClusterResolver",
    "TFConfigError",
    "TaskSpec",
    "parse_address",
]

#: Every task type TensorFlow's parameter-server training knows.
TASK_TYPES = ("chief", "ps", "worker", "evaluator")
#: The task types of the training cluster the coordinator connects to (the evaluator is never in it).
TRAINING_TASK_TYPES = ("chief", "ps", "worker")
#: Task types of which a cluster holds at most one.
SINGLETON_TASK_TYPES = ("chief", "evaluator")

_DNS_LABEL = re.compile(r"^[a-zA-Z0-9]([-a-zA-Z0-9_]{0,61}[a-zA-Z0-9])?$")


class TFConfigError(FieldError):
    """TF_CONFIG (or a cluster spec) is malformed; the message names the field, the value and what is allowed."""

    template = "TF_CONFIG field '{field}' has invalid value {value}: {allowed}"
    value_chars = 120


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) and check both parts; raises ``ValueError``."""
    if not isinstance(address, str) or not address:
        raise ValueError("expected 'host:port'")
    if address.startswith("["):
        host, sep, port_text = address[1:].partition("]:")
        if not sep:
            raise ValueError("expected '[ipv6]:port'")
        ipaddress.IPv6Address(host)
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or not host:
            raise ValueError("expected 'host:port'")
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            if len(host) > 253 or not all(_DNS_LABEL.match(label) for label in host.split(".")):
                raise ValueError(f"host {host!r} is neither an IP address nor a DNS name") from None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"port {port_text!r} is not an integer in 1..65535")
    return host, int(port_text)


class TaskSpec(BaseModel):
    """The ``task`` part of TF_CONFIG: which task of the cluster this process is."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    type: str
    index: int = 0

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in TASK_TYPES:
            raise TFConfigError("task.type", value, f"allowed task types are {', '.join(TASK_TYPES)}")
        return value

    @field_validator("index")
    @classmethod
    def _non_negative(cls, value: int) -> int:
        if value < 0:
            raise TFConfigError("task.index", value, "must be an integer >= 0")
        return value


def _check_cluster(cluster: Mapping[str, Any]) -> dict[str, list[str]]:
    """Validate a ``{task_type: [address, ...]}`` mapping; returns a normalised copy."""
    if not isinstance(cluster, Mapping):
        raise TFConfigError("cluster", cluster, "must be an object mapping task types to lists of 'host:port'")
    result: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    for task_type, addresses in cluster.items():
        if task_type not in TASK_TYPES:
            raise TFConfigError(
                f"cluster.{task_type}", task_type, f"allowed task types are {', '.join(TASK_TYPES)}"
            )
        if isinstance(addresses, Mapping):  # {index: address}, as tf.train.ClusterSpec allows
            try:
                indexed = {int(k): v for k, v in addresses.items()}
            except (TypeError, ValueError):
                raise TFConfigError(f"cluster.{task_type}", addresses, "task indices must be integers") from None
            if sorted(indexed) != list(range(len(indexed))):
                raise TFConfigError(
                    f"cluster.{task_type}", sorted(indexed), "task indices must be 0..n-1 without gaps"
                )
            addresses = [indexed[i] for i in range(len(indexed))]
        if not isinstance(addresses, (list, tuple)):
            raise TFConfigError(f"cluster.{task_type}", addresses, "must be a list of 'host:port' strings")
        if task_type in SINGLETON_TASK_TYPES and len(addresses) > 1:
            raise TFConfigError(
                f"cluster.{task_type}", list(addresses), f"a cluster has at most one {task_type} task"
            )
        for i, address in enumerate(addresses):
            field = f"cluster.{task_type}[{i}]"
            try:
                parse_address(address)
            except ValueError as err:
                raise TFConfigError(field, address, f"must be 'host:port' ({err})") from None
            if address in seen:
                raise TFConfigError(field, address, f"duplicate address, already used by {seen[address]}")
            seen[address] = field
        result[task_type] = list(addresses)
    return result


class TFConfig(BaseModel):
    """TF_CONFIG as TensorFlow's ``TFConfigClusterResolver`` reads it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    cluster: dict[str, list[str]] = {}
    task: TaskSpec | None = None
    rpc_layer: str | None = None
    environment: str | None = None

    @field_validator("cluster", mode="before")
    @classmethod
    def _valid_cluster(cls, value: Any) -> dict[str, list[str]]:
        return _check_cluster(value if value is not None else {})

    @field_validator("task", mode="before")
    @classmethod
    def _task_object(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (Mapping, TaskSpec)):
            raise TFConfigError("task", value, 'must be an object like {"type": "worker", "index": 0}')
        return value

    @model_validator(mode="after")
    def _task_in_cluster(self) -> "TFConfig":
        task = self.task
        if task is not None and self.cluster:
            members = self.cluster.get(task.type)
            if members is None:
                raise TFConfigError(
                    "task.type", task.type, f"the cluster has no '{task.type}' tasks; it has {sorted(self.cluster)}"
                )
            if task.index >= len(members):
                raise TFConfigError(
                    "task.index",
                    task.index,
                    f"the cluster has {len(members)} '{task.type}' task(s), so the index must be in 0..{len(members) - 1}",
                )
        return self

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, data: str | bytes | Mapping[str, Any] | None) -> "TFConfig":
        """Parse TF_CONFIG from JSON text or a mapping; empty or None means "no cluster" (a local run)."""
        if data is None or (isinstance(data, (str, bytes)) and not data.strip()):
            return cls()
        return _validate_json(cls, data, "TF_CONFIG", "must be a JSON object with 'cluster' and 'task'")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "TFConfig":
        """``TF_CONFIG`` of the environment (default ``os.environ``), as the task's settings read it: with its ps
        tasks' processes as ps of their own (:meth:`with_ps_processes`) when ``KUBEPS_PS_PROCESSES`` says so."""
        return cls.of_settings(TaskSettings.from_env(environ))

    @classmethod
    def of_settings(cls, settings: TaskSettings) -> "TFConfig":
        """``TF_CONFIG`` of the task's ``settings``, with its ps tasks' processes as ps of their own
        (:meth:`with_ps_processes`) when ``KUBEPS_PS_PROCESSES`` says so."""
        return cls.parse(settings.tf_config).with_ps_processes(settings.ps_processes)

    def with_ps_processes(self, processes: int, process: int = 0) -> "TFConfig":
        """This TF_CONFIG as kubeps tasks see it when every ps task runs ``processes`` server processes: ps task
        ``i`` at ``host:port`` serves on ``port``, ``port + 1``, ..., each process a ps of its own. The ps list
        grows from P to P x ``processes`` addresses, the tasks' own first (``0..P-1``, unchanged), then every
        task's second process, and so on, so that consecutive shards of a partitioned variable land on different
        ps tasks. ``process`` makes this config that process's: ps task index ``i + process * P``. With one
        process per task the config is returned unchanged."""
        if not isinstance(processes, int) or processes < 1:
            raise TFConfigError(PS_PROCESSES_ENV, processes, "a whole number of processes per ps task >= 1")
        if not isinstance(process, int) or not 0 <= process < processes:
            raise TFConfigError("process", process, f"a process number in 0..{processes - 1} "
                                f"({PS_PROCESSES_ENV}={processes})")
        if processes == 1:
            return self
        if process and self.task_type != "ps":
            raise TFConfigError("process", process, f"0: only a ps task runs several processes, this task is "
                                f"{self.task_type!r}")
        ps = self.cluster.get("ps", [])
        expanded = []
        for shift in range(processes):
            for address in ps:
                host, port = parse_address(address)
                if port + shift > 65535:
                    raise TFConfigError(PS_PROCESSES_ENV, processes, f"at most {65536 - port} processes: ps "
                                        f"address {address} would need ports up to {port + processes - 1}")
                expanded.append(f"[{host}]:{port + shift}" if ":" in host else f"{host}:{port + shift}")
        task = self.task
        if task is not None and task.type == "ps":
            task = TaskSpec(type="ps", index=task.index + process * len(ps))
        return self.model_copy(update={"cluster": {**self.cluster, "ps": expanded} if ps else self.cluster,
                                       "task": task})

    @classmethod
    def for_task(
        cls,
        cluster: Mapping[str, Iterable[str]],
        task_type: str,
        task_index: int,
        rpc_layer: str | None = "grpc",
    ) -> "TFConfig":
        """The TF_CONFIG a given task of ``cluster`` should see.

        An evaluator never belongs to the training cluster (a TensorFlow coordinator would wait for it), so it
        gets a cluster holding just itself.
        """
        cluster = {k: list(v) for k, v in cluster.items() if list(v)}
        if task_type == "evaluator":
            cluster = {"evaluator": cluster.get("evaluator", [])}
        else:
            cluster.pop("evaluator", None)
        return cls.parse(
            {"cluster": cluster, "task": {"type": task_type, "index": task_index}, "rpc_layer": rpc_layer}
        )

    def to_json(self) -> str:
        """Compact JSON, without the optional fields that are unset."""
        return self.model_dump_json(exclude_none=True)

    # -- queries ------------------------------------------------------------------------------------------------
    @property
    def task_type(self) -> str | None:
        return self.task.type if self.task else None

    @property
    def task_index(self) -> int | None:
        return self.task.index if self.task else None

    def address(self, task_type: str | None = None, index: int | None = None) -> str:
        """The address of a task, this process's own by default."""
        task_type = task_type or self.task_type
        index = self.task_index if index is None else index
        if task_type is None or index is None:
            raise TFConfigError("task", None, "TF_CONFIG names no task, so this process has no address")
        members = self.cluster.get(task_type, [])
        if not 0 <= index < len(members):
            raise TFConfigError(f"cluster.{task_type}", index, f"there are {len(members)} '{task_type}' task(s)")
        return members[index]


class Membership(BaseModel):
    """The workers of a running job, as the chief should dispatch to them: ``workers[i]`` is the address of worker
    ``i``. ``generation`` grows with every change; the chief applies a document whose generation differs from the
    one it applied last (a restarted chief applies whatever it finds first).

    >>> Membership.parse('{"generation": 3, "workers": ["w-0:2222", "w-1:2222"]}').workers
    ['w-0:2222', 'w-1:2222']
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    generation: int = 0
    workers: list[str] = []
    #: A checkpoint request: when it grows past the last one the chief served, the chief saves a checkpoint with
    #: the newest ``CheckpointManager`` of its program and reports the request served (``MembershipAck.checkpoint``,
    #: the metric ``kubeps_checkpoint_request``). The operator asks for one before it restarts the chief into a new
    #: ps count. A chief that starts takes the number it finds as already served (the request was its
    #: predecessor's).
    checkpoint: int = 0

    @field_validator("generation", "checkpoint", mode="before")
    @classmethod
    def _generation(cls, value: Any, info: Any) -> Any:
        try:
            return check(f"membership.{info.field_name}", value, NonNegativeInt)
        except RuntimeConfigError as err:  # a document's error, in its words
            raise TFConfigError(err.field, value, err.allowed) from None

    @field_validator("workers", mode="before")
    @classmethod
    def _addresses(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            raise TFConfigError("membership.workers", value, "must be a non-empty list of 'host:port' addresses")
        for index, address in enumerate(value):
            try:
                parse_address(address)
            except ValueError as err:
                raise TFConfigError(f"membership.workers[{index}]", address, str(err)) from None
        if len(set(value)) != len(value):
            raise TFConfigError("membership.workers", value, "must not name an address twice")
        return value

    @classmethod
    def parse(cls, data: str | bytes | Mapping[str, Any]) -> "Membership":
        """A membership document from JSON text or a mapping; a malformed one raises :class:`TFConfigError`."""
        return _validate_json(cls, data, "membership", 'must be a JSON object like {"generation": 1, "workers": [...]}')

    def to_json(self) -> str:
        return self.model_dump_json()


class MembershipAck(BaseModel):
    """What the chief reports after applying a :class:`Membership`: the ``generation`` applied, the indexes of
    the workers it dispatches to (``workers``), of those still finishing their last closure after a scale-down
    (``draining``), and of those drained since the chief started (``drained``: their processes may go), and the
    last checkpoint request served (``checkpoint``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    generation: int
    workers: list[int]
    draining: list[int] = []
    drained: list[int] = []
    #: the last checkpoint request served (:attr:`Membership.checkpoint`)
    checkpoint: int = 0

    def to_json(self) -> str:
        return self.model_dump_json()


_Model = TypeVar("_Model", bound=BaseModel)


def _validate_json(model: type[_Model], data: str | bytes | Mapping[str, Any], field: str, shape: str) -> _Model:
    """``model`` from JSON text or a mapping; every problem a :class:`TFConfigError` naming ``field`` or the
    field inside it (``shape`` says what a document of the kind looks like)."""
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as err:
            raise TFConfigError(field, short_repr(data, 60), f"must be a JSON object ({err})") from None
    if not isinstance(data, Mapping):
        raise TFConfigError(field, data, shape)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _from_validation_error(err) from None


def _from_validation_error(err: ValidationError) -> TFConfigError:
    """Turn pydantic's error into ours: the first problem, with its field path and value."""
    first = err.errors(include_url=False)[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, TFConfigError):
        return cause
    field = ".".join(str(part) for part in first["loc"]) or "TF_CONFIG"
    return TFConfigError(field, first.get("input"), first["msg"])


class ClusterSpec:
    """The cluster's task addresses, as ``tf.train.ClusterSpec``: ``{job_name: [address, ...]}``."""

    def __init__(self, cluster: "ClusterSpec | Mapping[str, Any] | None" = None):
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        self._cluster = _check_cluster(cluster or {})

    def as_dict(self) -> dict[str, list[str]]:
        return {job: list(tasks) for job, tasks in self._cluster.items()}

    @property
    def jobs(self) -> list[str]:
        return list(self._cluster)

    def num_tasks(self, job_name: str) -> int:
        return len(self._cluster.get(job_name, []))

    def task_indices(self, job_name: str) -> list[int]:
        return list(range(self.num_tasks(job_name)))

    def job_tasks(self, job_name: str) -> list[str]:
        if job_name not in self._cluster:
            raise RuntimeConfigError("job_name", job_name, f"a job of the cluster: one of {self.jobs}")
        return list(self._cluster[job_name])

    def task_address(self, job_name: str, task_index: int) -> str:
        tasks = self.job_tasks(job_name)
        allowed = f"an integer in 0..{len(tasks) - 1} (job {job_name!r} has {len(tasks)} task(s))"
        index: int = check("task_index", task_index, integer(ge=0, lt=len(tasks), allowed=allowed))
        return tasks[index]

    def __bool__(self) -> bool:
        return bool(self._cluster)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClusterSpec):
            return self._cluster == other._cluster
        return NotImplemented

    def __repr__(self) -> str:
        return f"ClusterSpec({self._cluster!r})"


class TFConfigClusterResolver:
    """Resolves the cluster from the ``TF_CONFIG`` environment variable, as TensorFlow's class of the same name.

    ``task_type``, ``task_id`` and ``rpc_layer`` given here override what TF_CONFIG says.

    Without ``tf_config`` it reads the task's settings (:meth:`TaskSettings.from_env()
    <kubeps.runtime.settings.TaskSettings.from_env>`, once: one of the three entry points that do, with
    ``ParameterServerStrategy`` and ``Server``) and keeps them as :attr:`settings`, for what the program builds next
    (``ParameterServerStrategy`` takes them from its resolver; ``SidecarEvaluator(..., settings=resolver.settings)``).
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        tf_config: "TFConfig | str | Mapping[str, Any] | None" = None,
    ):
        #: the task's settings this resolver read TF_CONFIG from; None when ``tf_config`` was given
        self.settings: TaskSettings | None = None
        if tf_config is None:
            self.settings = TaskSettings.from_env()
            config = TFConfig.of_settings(self.settings)
        else:
            config = tf_config if isinstance(tf_config, TFConfig) else TFConfig.parse(tf_config)
        self._config = config
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @property
    def tf_config(self) -> TFConfig:
        return self._config

    @property
    def task_type(self) -> str | None:
        return self._task_type if self._task_type is not None else self._config.task_type

    @task_type.setter
    def task_type(self, value: str | None) -> None:
        self._task_type = value

    @property
    def task_id(self) -> int | None:
        return self._task_id if self._task_id is not None else self._config.task_index

    @task_id.setter
    def task_id(self, value: int | None) -> None:
        self._task_id = value

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer if self._rpc_layer is not None else self._config.rpc_layer

    @property
    def environment(self) -> str | None:
        return self._environment if self._environment is not None else self._config.environment

    def cluster_spec(self) -> ClusterSpec:
        return ClusterSpec(self._config.cluster)

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The address of a task (this one by default), prefixed with ``rpc_layer://`` when there is one."""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        address = self.cluster_spec().task_address(task_type, task_id)
        layer = rpc_layer if rpc_layer is not None else self.rpc_layer
        return f"{layer}://{address}" if layer else address

    def num_accelerators(self, *args: Any, **kwargs: Any) -> dict[str, int]:
        """Accelerators visible to this task: ``{"GPU": n}`` when CuPy sees GPUs, else ``{}``."""
        try:  # optional dependency: the ``gpu`` extra
            import cupy  # noqa: PLC0415

            count = cupy.cuda.runtime.getDeviceCount()
        except Exception:  # noqa: BLE001 - no CuPy or no driver means no accelerators
            return {}
        return {"GPU": count} if count else {}
