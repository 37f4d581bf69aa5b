"""Error types of the kubeps runtime (the names follow TensorFlow where it has one)."""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = [
    "FieldError",
    "ClosureError",
    "CancelledError",
    "InsecureServerError",
    "LimitExceededError",
    "OutOfRangeError",
    "PSUnavailableError",
    "RemoteError",
    "ResourceMissingError",
    "RuntimeConfigError",
    "UnauthenticatedError",
    "WorkerUnavailableError",
]


_BOUNDED = reprlib.Repr()
_BOUNDED.maxlevel, _BOUNDED.maxstring, _BOUNDED.maxother = 6, 400, 400
_BOUNDED.maxlist = _BOUNDED.maxtuple = _BOUNDED.maxdict = _BOUNDED.maxset = _BOUNDED.maxfrozenset = 16


def short_repr(value: object, limit: int) -> str:
    """``repr(value)``, cut to ``limit`` characters so a huge payload never floods an error message. A container is
    shown by :mod:`reprlib` (its first items, six levels deep), so the cost never follows its size: a request's
    hundred thousand nested lists are not all rendered to show 120 characters of them."""
    text = _BOUNDED.repr(value) if isinstance(value, (list, tuple, dict, set, frozenset)) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class FieldError(ValueError):
    """Bad input. The message names the field, the value and what is allowed; each subclass words it for its
    context (TF_CONFIG, a wire frame, an argument). ``field``, ``value`` and ``allowed`` are kept as attributes."""

    template = "'{field}' has invalid value {value}: {allowed}"
    value_chars = 160

    def __init__(self, field: str, value: object, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(self.template.format(field=field, value=short_repr(value, self.value_chars), allowed=allowed))

    def __reduce__(self) -> tuple[Any, ...]:
        # the default (cls, self.args) would call __init__ with the formatted message alone
        return (type(self), (self.field, self.value, self.allowed))


class LimitExceededError(FieldError):
    """A request within the protocol but over one of a server's limits (answer size, slot sets, streams);
    servers answer ``RESOURCE_EXHAUSTED`` with reason ``limit`` and the message names the setting."""

    template = "'{field}' has value {value}: {allowed}"
    value_chars = 120


class RuntimeConfigError(FieldError):
    """A bad argument or configuration; the message names the field, the value and what is allowed."""


class CancelledError(Exception):
    """The closure was cancelled because an earlier closure failed (TensorFlow's ``CancelledError``)."""


class RemoteError(RuntimeError):
    """An RPC to another task failed; carries the gRPC status code name and the peer's address."""

    #: the peer's reason for a refusal (``kubeps.runtime.rpc.protocol``), set by the client that raised it
    reason: str | None
    #: the method that failed, where the client knew it
    method: str | None = None

    def __init__(self, message: str, code: str = "UNKNOWN", address: str | None = None):
        self.code = code
        self.address = address
        super().__init__(message)


class UnauthenticatedError(RemoteError):
    """The peer refused the RPC: missing or wrong job token."""


class PSUnavailableError(RemoteError):
    """A parameter server cannot be reached. Not recoverable in place: restart the job from a checkpoint."""

    #: set (True) on the error for a parameter server that came back empty (``kubeps.runtime.rpc.transport``)
    restarted: bool

    def __init__(self, ps_index: int, address: str, detail: str = "", code: str = "UNAVAILABLE"):
        self.ps_index = ps_index
        message = f"parameter server /job:ps/task:{ps_index} at {address} is unavailable"
        if detail:
            message += f": {detail}"
        super().__init__(message, code=code, address=address)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_ps_unavailable, (self.ps_index, self.address, str(self), self.code))


def _rebuild_ps_unavailable(ps_index: int, address: str, message: str, code: str) -> "PSUnavailableError":
    err = PSUnavailableError.__new__(PSUnavailableError)
    RemoteError.__init__(err, message, code=code, address=address)
    err.ps_index = ps_index
    return err


class WorkerUnavailableError(RemoteError):
    """A worker cannot be reached (its closure is re-queued; the coordinator waits for it to come back)."""


class OutOfRangeError(Exception):
    """A scheduled function read past the end of its input: a per-worker dataset's iterator ran out (TensorFlow's
    ``tf.errors.OutOfRangeError``). The message names the worker; make the dataset ``.repeat()`` or schedule fewer
    steps."""


class ResourceMissingError(RuntimeError):
    """A closure referenced a per-worker resource (dataset, iterator) the worker does not hold (it restarted)."""


class ClosureError(RuntimeError):
    """A scheduled function raised on a worker, and its exception could not be rebuilt on the coordinator."""

    def __init__(self, type_name: str, message: str, remote_traceback: str = ""):
        self.type_name = type_name
        self.remote_traceback = remote_traceback
        super().__init__(f"{type_name}: {message}")


class InsecureServerError(RuntimeError):
    """A server was asked to start without a job token (it would execute code for anyone)."""
