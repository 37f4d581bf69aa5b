"""The job token: a shared secret every RPC between the tasks of one job carries.

Workers execute functions sent to them (code), so a server without authentication would run code for anyone who
can reach its port. The launcher (and the operator) always set ``KUBEPS_JOB_TOKEN`` or ``KUBEPS_JOB_TOKEN_FILE``;
a server started without a token refuses to start unless the caller passes ``allow_insecure=True`` explicitly.

The check is a gRPC server interceptor: it compares the token in constant time and refuses with
``UNAUTHENTICATED`` before the method handler runs, so nothing of a refused request is ever deserialised.
"""

from __future__ import annotations

import hmac
from typing import Any, Callable

import grpc

from kubeps.runtime.contract import JOB_TOKEN_ENV, JOB_TOKEN_FILE_ENV
from kubeps.runtime.errors import InsecureServerError, RuntimeConfigError
from kubeps.runtime.settings import TaskSettings

__all__ = [
    "TOKEN_METADATA_KEY",
    "TokenInterceptor",
    "load_job_token",
    "require_job_token",
    "token_metadata",
]

#: gRPC metadata key (lower case, as gRPC requires).
TOKEN_METADATA_KEY = "x-kubeps-job-token"
_MIN_TOKEN_CHARS = 16


def load_job_token(settings: TaskSettings) -> str | None:
    """The job token from ``KUBEPS_JOB_TOKEN``, else from the file named by ``KUBEPS_JOB_TOKEN_FILE``, else None
    (``settings``: the task's, passed down by the ``Server`` or ``ParameterServerStrategy`` that read them)."""
    if settings.job_token is not None:
        return _check_token(JOB_TOKEN_ENV, settings.job_token)
    path = settings.job_token_file
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read().strip()
        except OSError as err:
            raise RuntimeConfigError(JOB_TOKEN_FILE_ENV, path, f"must name a readable file holding the job token ({err.strerror})") from None
        return _check_token(f"{JOB_TOKEN_FILE_ENV} ({path})", text)
    return None


def _check_token(field: str, token: str) -> str:
    token = token.strip()
    if len(token) < _MIN_TOKEN_CHARS:
        raise RuntimeConfigError(field, "<hidden>", f"the job token must be at least {_MIN_TOKEN_CHARS} characters")
    if not token.isascii() or not token.isprintable():
        raise RuntimeConfigError(field, "<hidden>", "the job token must be printable ASCII (it travels as gRPC metadata)")
    return token


def require_job_token(token: str | None, allow_insecure: bool = False) -> str | None:
    """Check that a server has a token; without one it refuses unless ``allow_insecure`` is exactly True."""
    if token:
        return _check_token("token", token)
    if allow_insecure is True:
        return None
    raise InsecureServerError(
        f"refusing to start a kubeps server without a job token: set {JOB_TOKEN_ENV} or {JOB_TOKEN_FILE_ENV} "
        "(the launcher does); workers execute the code sent to them, so an unauthenticated server would run "
        "code for anyone who reaches its port. Tests may pass allow_insecure=True."
    )


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client attaches to every call."""
    return ((TOKEN_METADATA_KEY, token),) if token else ()


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler that refuses at once. It is always request-streaming: it never reads the request, where a
    unary-request handler would first wait (in a server thread, without a deadline) for a message that a stalled
    peer never completes."""
    def abort(request_or_iterator: Any, context: Any) -> None:  # noqa: ARG001 - never looked at
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    identity: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
    if handler is not None and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort, identity, identity)
    return grpc.stream_unary_rpc_method_handler(abort, identity, identity)


# grpc ships no type information: its classes are Any to mypy
class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses (``UNAUTHENTICATED``) any call whose metadata lacks the job token; constant-time comparison."""

    def __init__(self, token: str | None):
        self._token = token.encode() if token else None

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        if self._token is None:  # explicitly insecure server (tests only)
            return continuation(handler_call_details)
        presented = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else bytes(value)
                break
        if presented is not None and hmac.compare_digest(presented, self._token):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)  # only to learn the call's streaming shape
        reason = "missing job token" if presented is None else "wrong job token"
        return _refusal(handler, f"{reason}: every kubeps RPC must carry the job's token in '{TOKEN_METADATA_KEY}'")
