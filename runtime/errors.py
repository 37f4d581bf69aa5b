"""Error types of the kubeps runtime (the names follow TensorFlow where it has one)."""

from __future__ import annotations

__all__ = [
    "ClosureError",
    "CancelledError",
    "InsecureServerError",
    "PSUnavailableError",
    "RemoteError",
    "ResourceMissingError",
    "RuntimeConfigError",
    "UnauthenticatedError",
    "WorkerUnavailableError",
]


class RuntimeConfigError(ValueError):
    """A bad argument or configuration; the message names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        text = repr(value)
        if len(text) > 160:
            text = text[:157] + "..."
        super().__init__(f"'{field}' has invalid value {text}: {allowed}")


class CancelledError(Exception):
    """The closure was cancelled because an earlier closure failed (TensorFlow's ``CancelledError``)."""


class RemoteError(RuntimeError):
    """An RPC to another task failed; carries the gRPC status code name and the peer's address."""

    def __init__(self, message: str, code: str = "UNKNOWN", address: str | None = None):
        self.code = code
        self.address = address
        super().__init__(message)


class UnauthenticatedError(RemoteError):
    """The peer refused the RPC: missing or wrong job token."""


class PSUnavailableError(RemoteError):
    """A parameter server cannot be reached. Not recoverable in place: restart the job from a checkpoint."""

    def __init__(self, ps_index: int, address: str, detail: str = "", code: str = "UNAVAILABLE"):
        self.ps_index = ps_index
        message = f"parameter server /job:ps/task:{ps_index} at {address} is unavailable"
        if detail:
            message += f": {detail}"
        super().__init__(message, code=code, address=address)

    def __reduce__(self):
        return (_rebuild_ps_unavailable, (self.ps_index, self.address, str(self), self.code))


def _rebuild_ps_unavailable(ps_index: int, address: str, message: str, code: str) -> "PSUnavailableError":
    err = PSUnavailableError.__new__(PSUnavailableError)
    RemoteError.__init__(err, message, code=code, address=address)
    err.ps_index = ps_index
    return err


class WorkerUnavailableError(RemoteError):
    """A worker cannot be reached (its closure is re-queued; the coordinator waits for it to come back)."""


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
