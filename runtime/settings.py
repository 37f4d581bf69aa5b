"""``TaskSettings``: everything a task reads from its environment, parsed once, in one dialect.

The variables are the pod contract's (:mod:`kubeps.runtime.contract`); this module is the only part of the runtime
that reads them. A task builds its settings once when it starts (:meth:`TaskSettings.from_env`) and hands them to
what it constructs -- the servers, a parameter server's state, the TLS and token loaders, the kernels' backend, the
summary writers' log dir, the math thread pools -- so nothing reads the environment per request.

Every variable is one field: its name (the alias), its type and bounds, its default, and what is allowed, declared
once. An unset or blank variable is the field's default. A bad value raises
:class:`~kubeps.runtime.errors.RuntimeConfigError` naming the variable, the value and what is allowed.

:meth:`TaskSettings.to_env` renders settings back to variables; ``kubeps local`` (:mod:`kubeps.runtime.local`) and
the operator (:mod:`kubeps.operator.core.children`) both use it, so the names and formats of what they set cannot
drift from what a task parses (``TaskSettings.from_env(s.to_env()) == s``).

What needs I/O stays with its owner: the job token file is read by :mod:`kubeps.runtime.rpc.security`, the TLS
files by :mod:`kubeps.runtime.rpc.tls`, TF_CONFIG is parsed by :mod:`kubeps.runtime.cluster` (carried here raw),
the extension modules are imported by :mod:`kubeps.runtime.server.methods`. Pure otherwise: pydantic, the contract
and the errors, nothing else of the runtime.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kubeps.runtime import contract
from kubeps.runtime.checks import Allowed, MetricsPort, PositiveInt, Seconds, allowed_text, from_text
from kubeps.runtime.errors import RuntimeConfigError

__all__ = [
    "DEFAULT_MAX_ANSWER_BYTES",
    "DEFAULT_MAX_BLOOM_COUNTERS",
    "DEFAULT_MAX_CLIENT_ANSWER_BYTES",
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_MAX_TENSORS",
    "DEFAULT_MAX_PARKED_BYTES",
    "DEFAULT_MAX_READ_IDS",
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_MAX_SLOT_SETS",
    "DEFAULT_MAX_TABLES",
    "DEFAULT_MAX_TABLE_DIM",
    "DEFAULT_MAX_VARIABLES",
    "DEFAULT_MIN_REQUEST_BYTES_PER_S",
    "DEFAULT_PARKED_ANSWER_TTL_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "DEFAULT_STREAM_IDLE_TIMEOUT_S",
    "TaskSettings",
]

#: seconds a server waits for the next chunk of a request before it cancels the call
DEFAULT_STREAM_IDLE_TIMEOUT_S = 10.0
#: seconds a whole request may take to arrive, however steadily its chunks trickle in
DEFAULT_REQUEST_TIMEOUT_S = 120.0
#: the largest request data section a server accepts (bytes)
DEFAULT_MAX_REQUEST_BYTES = 1 << 30
#: the largest answer a parameter server builds (bytes)
DEFAULT_MAX_ANSWER_BYTES = 1 << 30
#: seconds a parked answer (too big for one message) waits for its client's Collect
DEFAULT_PARKED_ANSWER_TTL_S = 30.0
#: the most bytes of parked answers a server holds (the oldest are dropped beyond it)
DEFAULT_MAX_PARKED_BYTES = 2 << 30
#: how many slot sets (one per optimizer configuration) one variable may hold on a parameter server
DEFAULT_MAX_SLOT_SETS = 8
#: the largest request header a server parses (bytes): the JSON parse of 1 MiB stays near 0.1 s of CPU
DEFAULT_MAX_HEADER_BYTES = 1 << 20
#: a Push of every variable of a ps (two tensors per row update) stays far below it; at it a request costs a ps
#: about 45 ms of CPU (bench/request_cost.py: 16,000 tensors cost 170-190 ms on a quiet core, ~11 us each)
DEFAULT_MAX_TENSORS = 4096
#: the most variables one parameter server holds
DEFAULT_MAX_VARIABLES = 100_000
#: the most dynamic tables one parameter server holds
DEFAULT_MAX_TABLES = 1024
#: the widest row a dynamic table may have
DEFAULT_MAX_TABLE_DIM = 16_384
#: the most Bloom-filter counters a dynamic table may have (2 bytes each: 32 MiB)
DEFAULT_MAX_BLOOM_COUNTERS = 1 << 24
#: the most row ids or table keys one call may read or look up
DEFAULT_MAX_READ_IDS = 1 << 20
#: the bytes of answers one client may have a parameter server build at once
DEFAULT_MAX_CLIENT_ANSWER_BYTES = 256 << 20
#: the slowest a request may arrive after its first idle timeout (bytes per second)
DEFAULT_MIN_REQUEST_BYTES_PER_S = 64 << 10

#: the level names ``logging.basicConfig(level=...)`` accepts
_LOG_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARN", "WARNING", "INFO", "DEBUG", "NOTSET")
#: the numeric fields' types (:mod:`kubeps.runtime.checks`), taking the variable's text
if TYPE_CHECKING:  # mypy sees the plain types, pydantic the checked ones
    _Count = int
    _Seconds = float
    _MetricsPort = int
else:
    _Count = from_text(PositiveInt)
    _Seconds = from_text(Seconds)
    _MetricsPort = from_text(MetricsPort)


def _var(name: str, default: Any, allowed: str | None = None) -> Any:
    """A field read from variable ``name``; ``allowed`` is what an error says would be accepted (default: what
    the field's type says, :func:`~kubeps.runtime.checks.allowed_text`)."""
    return Field(default, alias=name, json_schema_extra={"allowed": allowed} if allowed else None)


def _split(value: Any) -> Any:
    """A comma-separated variable as a tuple of its non-blank items, stripped; a sequence of strings is split the
    same way (``("/a,/b", "/c")`` is ``("/a", "/b", "/c")``), as a task would read it back."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        return value  # pydantic's error names the field
    return tuple(part.strip() for item in items for part in item.split(",") if part.strip())


class TaskSettings(BaseModel):
    """A task's settings, one field per variable of :mod:`kubeps.runtime.contract` (the alias is its name).

    ``TaskSettings.from_env()`` reads ``os.environ``; ``TaskSettings(max_slot_sets=3)`` builds settings in code
    (fields by name). Frozen: share one object between everything a task constructs.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    # -- the cluster and the job's identity ---------------------------------------------------------------------
    #: the raw TF_CONFIG JSON (:class:`kubeps.runtime.cluster.TFConfig` parses it), None when unset
    tf_config: str | None = _var(contract.TF_CONFIG_ENV, None, "TF_CONFIG JSON as TensorFlow defines it")
    #: the job's shared secret (checked by :mod:`kubeps.runtime.rpc.security`); never shown in ``repr``
    job_token: str | None = Field(None, alias=contract.JOB_TOKEN_ENV, repr=False,
                                  json_schema_extra={"allowed": "the job token"})
    job_token_file: str | None = _var(contract.JOB_TOKEN_FILE_ENV, None, "a file holding the job token")

    # -- checkpoints (before the TLS files: the order of the operator's pod env) ---------------------------------
    #: the directories or URLs a parameter server confines checkpoint shards to; (): paths are only normalised
    checkpoint_root: tuple[str, ...] = _var(contract.CHECKPOINT_ROOT_ENV, (),
                                            "directories or URLs separated by ','")
    #: the checkpoint directory the examples default to
    checkpoint_dir: str | None = _var(contract.CHECKPOINT_DIR_ENV, None, "a directory or URL")

    # -- transport security and the network ----------------------------------------------------------------------
    tls_ca_file: str | None = _var(contract.TLS_CA_FILE_ENV, None, "a PEM file")
    tls_cert_file: str | None = _var(contract.TLS_CERT_FILE_ENV, None, "a PEM file")
    tls_key_file: str | None = _var(contract.TLS_KEY_FILE_ENV, None, "a PEM file")
    #: the address a server binds to; None: every interface
    bind_host: str | None = _var(contract.BIND_HOST_ENV, None, "a host name or address")

    # -- the process ----------------------------------------------------------------------------------------------
    #: the CPUs the task may use; None: its cgroup quota and CPU affinity decide
    cpus: _Count | None = _var(contract.CPUS_ENV, None,
                               "a whole number of CPUs >= 1 (or unset: the cgroup quota and CPU affinity decide)")
    #: server processes per ps task, the same in every task of the job (a ps uses that many cores)
    ps_processes: _Count = _var(contract.PS_PROCESSES_ENV, 1, "a whole number of processes per ps task >= 1")
    #: the ps task's own process, for a server process it started (:mod:`kubeps.runtime.server.processes`)
    ps_task_pid: _Count | None = _var(contract.PS_TASK_PID_ENV, None, "a process id >= 1 (set by a ps task)")
    #: where array kernels run; None: a GPU when CuPy sees one, else the CPU
    device: Literal["cpu", "gpu"] | None = _var(contract.DEVICE_ENV, None, "'cpu', 'gpu' or unset (auto)")
    #: how many GPU tasks share this task's GPU: each may use 0.9 / gpu_tasks of its memory (CuPy's pool, XLA)
    gpu_tasks: _Count = _var(contract.GPU_TASKS_ENV, 1)
    log_level: str = _var(contract.LOG_LEVEL_ENV, "INFO", f"a logging level name: {', '.join(_LOG_LEVELS)}")
    #: where TensorBoard event files go; None: nowhere unless a program names a log dir
    logdir: str | None = _var(contract.LOGDIR_ENV, None, "a directory or URL")
    #: the port the task serves Prometheus metrics on; None: no metrics are recorded or served
    #: (``0`` is off as well, as it is for the operator: :data:`~kubeps.runtime.checks.MetricsPort`)
    metrics_port: _MetricsPort | None = _var(contract.METRICS_PORT_ENV, None)
    #: seconds between two looks of the chief's hot-ps detector
    hotspot_interval_s: _Seconds = _var(contract.HOTSPOT_INTERVAL_ENV, 10.0)
    log_format: Literal["text", "json"] = _var(contract.LOG_FORMAT_ENV, "text", "'text' (the default) or 'json'")
    #: modules a server imports before it serves (the user's methods)
    server_extensions: tuple[str, ...] = _var(contract.SERVER_EXTENSIONS_ENV, (),
                                              "module names separated by ','")
    #: the chief's membership document (watched while it runs); None: TF_CONFIG's workers for the whole run
    membership_file: str | None = _var(contract.MEMBERSHIP_FILE_ENV, None, "a file path")
    #: where the chief acknowledges an applied membership document; None: nowhere
    membership_ack_file: str | None = _var(contract.MEMBERSHIP_ACK_FILE_ENV, None, "a file path")

    # -- a server's limits ------------------------------------------------------------------------------------------
    #: the size of the chunks a server streams large answers in; None: the wire's default
    chunk_bytes: _Count | None = _var(contract.CHUNK_BYTES_ENV, None, "an integer >= 1 (bytes), or unset")
    stream_idle_timeout_s: _Seconds = _var(contract.STREAM_IDLE_TIMEOUT_ENV, DEFAULT_STREAM_IDLE_TIMEOUT_S)
    request_timeout_s: _Seconds = _var(contract.REQUEST_TIMEOUT_ENV, DEFAULT_REQUEST_TIMEOUT_S)
    min_request_bytes_per_s: _Count = _var(contract.MIN_REQUEST_RATE_ENV, DEFAULT_MIN_REQUEST_BYTES_PER_S)
    #: calls per client (job identity: token and certificate; the peer address on an insecure server); None:
    #: three quarters of the server's handler threads (at least 2)
    max_calls_per_client: _Count | None = _var(contract.MAX_CALLS_PER_CLIENT_ENV, None, "an integer >= 1, or unset")
    max_request_bytes: _Count = _var(contract.MAX_REQUEST_BYTES_ENV, DEFAULT_MAX_REQUEST_BYTES)
    max_answer_bytes: _Count = _var(contract.MAX_ANSWER_BYTES_ENV, DEFAULT_MAX_ANSWER_BYTES)
    parked_answer_ttl_s: _Seconds = _var(contract.PARKED_ANSWER_TTL_ENV, DEFAULT_PARKED_ANSWER_TTL_S)
    max_parked_bytes: _Count = _var(contract.MAX_PARKED_BYTES_ENV, DEFAULT_MAX_PARKED_BYTES)
    max_slot_sets: _Count = _var(contract.MAX_SLOT_SETS_ENV, DEFAULT_MAX_SLOT_SETS)
    max_header_bytes: _Count = _var(contract.MAX_HEADER_BYTES_ENV, DEFAULT_MAX_HEADER_BYTES)
    max_tensors: _Count = _var(contract.MAX_TENSORS_ENV, DEFAULT_MAX_TENSORS)
    max_variables: _Count = _var(contract.MAX_VARIABLES_ENV, DEFAULT_MAX_VARIABLES)
    max_tables: _Count = _var(contract.MAX_TABLES_ENV, DEFAULT_MAX_TABLES)
    max_table_dim: _Count = _var(contract.MAX_TABLE_DIM_ENV, DEFAULT_MAX_TABLE_DIM)
    max_bloom_counters: _Count = _var(contract.MAX_BLOOM_COUNTERS_ENV, DEFAULT_MAX_BLOOM_COUNTERS)
    max_read_ids: _Count = _var(contract.MAX_READ_IDS_ENV, DEFAULT_MAX_READ_IDS)
    max_client_answer_bytes: _Count = _var(contract.MAX_CLIENT_ANSWER_BYTES_ENV, DEFAULT_MAX_CLIENT_ANSWER_BYTES)
    nonfinite_gradients: Literal["refuse", "allow"] = _var(contract.NONFINITE_GRADIENTS_ENV, "refuse",
                                                           "'refuse' (the default) or 'allow'")

    @field_validator("device", "log_format", mode="before")
    @classmethod
    def _device_case(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value not in _LOG_LEVELS:
            raise ValueError("not a logging level name")
        return value

    @field_validator("metrics_port")
    @classmethod
    def _zero_is_off(cls, value: int | None) -> int | None:
        return value or None

    @field_validator("checkpoint_root", "server_extensions", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return _split(value)

    # -- the environment ----------------------------------------------------------------------------------------------
    @classmethod
    def variables(cls) -> dict[str, str]:
        """``{field: variable name}`` of every field, in declaration order."""
        return {name: str(info.alias) for name, info in cls.model_fields.items()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "TaskSettings":
        """The settings in ``environ`` (default ``os.environ``); blank variables count as unset."""
        env = os.environ if environ is None else environ
        given = {name: raw for name in cls.variables().values()
                 if (raw := env.get(name)) is not None and raw.strip()}
        try:
            return cls.model_validate(given)
        except ValidationError as err:
            first = err.errors()[0]
            name = str(first["loc"][0])
            field = next(f for f, alias in cls.variables().items() if alias == name)
            shown = "<hidden>" if field == "job_token" else given.get(name)
            raise RuntimeConfigError(name, shown, cls.allowed(field)) from None

    @classmethod
    def allowed(cls, field: str) -> str:
        """What variable ``field`` allows, in a refusal's words: the field's own words, else its type's (a field
        that may be unset says so)."""
        info = cls.model_fields[field]
        extra = info.json_schema_extra
        if isinstance(extra, dict) and extra.get("allowed"):
            return str(extra["allowed"])
        types = [t for t in getattr(info.annotation, "__args__", ()) if t is not type(None)]
        if types:  # T | None
            return f"{allowed_text(types[0])}, or unset"
        return next((str(m) for m in reversed(info.metadata) if isinstance(m, Allowed)), allowed_text(info.annotation))

    def to_env(self) -> dict[str, str]:
        """The variables that say these settings: every field not at its default, in declaration order.
        ``TaskSettings.from_env(settings.to_env()) == settings``."""
        rendered: dict[str, str] = {}
        for field, name in self.variables().items():
            value = getattr(self, field)
            if value == type(self).model_fields[field].default:
                continue
            rendered[name] = _render(value)
        return rendered


def _render(value: Any) -> str:
    return ",".join(value) if isinstance(value, tuple) else str(value)
