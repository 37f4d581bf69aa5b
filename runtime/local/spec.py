"""``LocalJobSpec``: one local job as ``kubeps local`` (or a Python caller) asks for it, checked once.

The command's flags and :class:`~kubeps.runtime.local.launcher.LocalCluster`'s keyword arguments are its fields;
each field's annotation is a type of the one validation dialect (:mod:`kubeps.runtime.checks`), so a bad value is
refused with the same words everywhere: a :class:`~kubeps.runtime.local.errors.LauncherArgumentError` naming the
field, the value and what is allowed. ``settings`` are the task settings of the launcher's environment, read once
where the job is built (:meth:`~kubeps.runtime.settings.TaskSettings.from_env`) and passed down from here.

Pure data: no process, port or file is touched here but the script's existence.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any, Mapping, Sequence, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from kubeps.runtime.checks import Allowed, Flag, NonNegativeSeconds, Port, PositiveInt, check
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.local.errors import LauncherArgumentError, LauncherError, PortBaseError
from kubeps.runtime.local.ports import max_port_base
from kubeps.runtime.settings import TaskSettings

__all__ = ["DEFAULT_EVALUATOR_GRACE_S", "DEFAULT_GRACE_PERIOD_S", "LocalJobSpec", "WorkerCount", "check_argument"]

#: Seconds between SIGTERM and SIGKILL when stopping a task (``--grace-period``).
DEFAULT_GRACE_PERIOD_S = 5.0
#: After the chief succeeded, how long a running evaluator may take to finish the final checkpoint (seconds).
DEFAULT_EVALUATOR_GRACE_S = 60.0

# the dialect's types in the words of this spec's errors (the last ``Allowed`` is what a refusal says)
PsCount = Annotated[PositiveInt, Allowed("a number of parameter servers >= 1")]
WorkerCount = Annotated[PositiveInt, Allowed("a number of workers >= 1")]
PsProcesses = Annotated[PositiveInt, Allowed("a number of server processes per ps task >= 1")]


class LocalJobSpec(BaseModel):
    """What one local job runs: ``python SCRIPT SCRIPT_ARGS`` as the chief, ``num_ps`` parameter servers,
    ``num_workers`` workers and, with ``evaluator``, a sidecar evaluator, on ``host``.

    Building one checks every field; a refusal is a :class:`LauncherArgumentError` (a script that is no file: a
    :class:`LauncherError`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: the training program: the same file runs as every task
    script: str
    script_args: tuple[str, ...] = ()
    num_ps: PsCount = 2
    num_workers: WorkerCount = 2
    evaluator: Flag = False
    #: the address every task listens on
    host: str = "127.0.0.1"
    #: the first of consecutive ports (chief, ps..., worker..., evaluator); None: free ports
    port_base: Port | None = None
    #: the interpreter the tasks run with
    python: str = sys.executable
    grace_period: NonNegativeSeconds = DEFAULT_GRACE_PERIOD_S
    #: after the chief succeeded, how long the evaluator may take to evaluate the final checkpoint and exit
    evaluator_grace: NonNegativeSeconds = DEFAULT_EVALUATOR_GRACE_S
    #: mutual TLS between the tasks (a throw-away CA unless the settings name TLS files); False: plaintext
    tls: Flag = True
    #: every task serves its Prometheus metrics on a free port of its own
    metrics: Flag = True
    #: server processes per ps task; None: as the settings say (``KUBEPS_PS_PROCESSES``, default 1: on 16 cores
    #: several per task served less than one, docs/benchmarks.md#scaling-benchscalingpy-benchps_capacitypy)
    ps_processes: PsProcesses | None = None
    #: the task settings of the launcher's environment, as the user gave them
    settings: TaskSettings

    def __init__(self, **fields: Any):
        try:
            super().__init__(**fields)
        except ValidationError as err:
            raise _refusal(err, fields) from None

    @classmethod
    def from_arguments(cls, script: str, script_args: Sequence[str], environ: Mapping[str, str],
                       **options: Any) -> "LocalJobSpec":
        """The spec of :class:`~kubeps.runtime.local.launcher.LocalCluster`'s arguments, its settings read from
        ``environ`` (a bad one is a :class:`LauncherError` naming the variable)."""
        try:
            settings = TaskSettings.from_env(environ)
        except RuntimeConfigError as err:
            raise LauncherError(str(err)) from None
        return cls(script=script, script_args=tuple(script_args), settings=settings, **options)

    @field_validator("script", "script_args", mode="before")
    @classmethod
    def _paths(cls, value: Any) -> Any:
        """Paths (``os.PathLike``) as the strings they name, as ``subprocess`` takes them."""
        if isinstance(value, (list, tuple)):
            return tuple(os.fspath(v) if isinstance(v, os.PathLike) else v for v in value)
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("script")
    @classmethod
    def _a_file(cls, script: str) -> str:
        if not os.path.isfile(script):
            raise LauncherError(f"script file not found: {script}")
        return script

    @model_validator(mode="after")
    def _port_base_fits(self) -> "LocalJobSpec":
        highest = max_port_base(self.num_ps, self.num_workers, self.evaluator, self.server_processes)
        if self.port_base is not None and self.port_base > highest:
            raise PortBaseError(self.port_base, highest, self.task_count())
        return self

    @property
    def server_processes(self) -> int:
        """The server processes of each ps task: ``ps_processes``, else the settings'."""
        return self.ps_processes if self.ps_processes is not None else self.settings.ps_processes

    def counts(self) -> dict[str, int]:
        """How many tasks of each type the job starts with."""
        return {"chief": 1, "ps": self.num_ps, "worker": self.num_workers, "evaluator": 1 if self.evaluator else 0}

    def task_count(self) -> int:
        return sum(self.counts().values())


def check_argument(field: str, value: Any, type_: Any) -> Any:
    """``value`` as ``type_`` (a type of :mod:`kubeps.runtime.checks`) accepts it, or a
    :class:`LauncherArgumentError` naming ``field``, the value and what is allowed."""
    try:
        return check(field, value, type_)
    except RuntimeConfigError as refused:
        raise LauncherArgumentError(field, value, f"allowed is {refused.allowed}") from None


def _refusal(err: ValidationError, fields: Mapping[str, Any]) -> Exception:
    """The dialect's error for pydantic's first complaint: what a validator raised, or the field's refusal in the
    words of its type (:func:`kubeps.runtime.checks.check`); an unknown field is a ``TypeError``, as for any call."""
    first = err.errors()[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, LauncherArgumentError):
        return cause
    field = str(first["loc"][0]) if first["loc"] else "spec"
    hints = get_type_hints(LocalJobSpec, include_extras=True)
    if field not in hints:
        allowed = ", ".join(LocalJobSpec.model_fields)
        return TypeError(f"LocalJobSpec: unexpected argument {field!r}; allowed: {allowed}")
    try:
        check_argument(field, fields.get(field), hints[field])
    except LauncherArgumentError as refused:
        return refused
    return LauncherArgumentError(field, fields.get(field), f"allowed is {first['msg']}")
