"""The parameter-server transport: one client per parameter server, parallel fan-out, and the translation of
"cannot reach it" (or "it came back empty") into :class:`~kubeps.runtime.errors.PSUnavailableError`.

The coordinator's strategy and every worker hold one :class:`PSTransport`; variables, the optimizer push and the
checkpoint's shard RPCs all go through it. It knows nothing of variables: requests name them by key.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Mapping, Sequence, TypeGuard, TypeVar, overload

import grpc
import numpy as np

from kubeps.runtime.errors import PSUnavailableError, RemoteError
from kubeps.runtime.rpc.client import DEFAULT_TIMEOUT_S, Answer, Call, Client
from kubeps.runtime.rpc.protocol import (PING, PS, PS_SERVICE, UNKNOWN_VARIABLE, CreateVariablesAnswer, Method,
                                          PingAnswer)
from kubeps.runtime.rpc.tls import TLSConfig
from kubeps.runtime.settings import TaskSettings

__all__ = ["PS_UNREACHABLE_CODES", "DeclaredRequest", "PSTransport", "Request", "ps_restarted", "ps_restarted_error"]

#: gRPC status codes that mean "the parameter server is not there" rather than "the request was bad".
PS_UNREACHABLE_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN"})
#: the methods whose answer says which incarnation of the ps answered
_WITH_INCARNATION = frozenset({PING, PS.CREATE_VARIABLES, PS.CREATE_DYNAMIC})

AnswerT = TypeVar("AnswerT")
#: one call of :meth:`PSTransport.call_many`: ``(method, request metadata, tensors)``; of a built-in method, whose
#: answer is its declaration ``AnswerT``
Request = tuple[str, Mapping[str, Any], Sequence[Any]]
DeclaredRequest = tuple[Method[AnswerT], Mapping[str, Any], Sequence[Any]]


def _carries_incarnation(answer: object, method: str) -> TypeGuard[PingAnswer | CreateVariablesAnswer]:  # noqa: ARG001
    """Whether ``answer`` (validated against ``method``'s declaration) is one that names the ps's incarnation."""
    return method in _WITH_INCARNATION


def ps_restarted_error(ps_index: int, address: str, how: str) -> PSUnavailableError:
    """The error for a parameter server that came back as a new, empty process (``.restarted`` is True)."""
    error = PSUnavailableError(
        ps_index, address,
        f"it restarted and lost its variables ({how}); this coordinator cannot go on: restart the chief so it "
        "re-creates its variables and restores the latest checkpoint (run_coordinator exits with the retryable "
        "status 133 for that)",
        code="DATA_LOSS",
    )
    error.restarted = True
    return error


def ps_restarted(error: BaseException) -> TypeGuard[PSUnavailableError]:
    """Whether ``error`` says a parameter server restarted (and so lost its variables), not just that it is silent.
    (Only a :class:`PSUnavailableError` carries ``restarted``, hence the TypeGuard.)"""
    return bool(getattr(error, "restarted", False))


class PSTransport:
    """Clients for every parameter server of a cluster.

    It remembers the incarnation (random id per process start) every parameter server answered ``Ping`` and
    ``CreateVariables`` with. Once a ps holds variables created through this transport, an answer with another
    incarnation -- or a NOT_FOUND for one of its variables -- means the ps restarted empty: the call raises
    :func:`ps_restarted_error` (a :class:`PSUnavailableError` with ``restarted=True``), and keeps raising it.
    """

    def __init__(self, ps_addresses: Sequence[str], token: str | None, timeout: float = DEFAULT_TIMEOUT_S,
                 tls: TLSConfig | None = None, settings: TaskSettings | None = None):
        self.ps_addresses = list(ps_addresses)
        #: the settings of the task that made this transport (the chief's strategy passes its own): what the
        #: variables and tables reached through it may read of them (a checkpoint, the job's checkpoint roots)
        self.settings = settings
        self._clients = [Client(a, PS_SERVICE, token, timeout, tls=tls, sender_threads=True) for a in self.ps_addresses]
        #: calls started per ps (tests and benchmarks count RPCs per step with it)
        self.calls: collections.Counter[int] = collections.Counter()
        self._count_lock = threading.Lock()
        self._incarnation_lock = threading.Lock()
        self._incarnations: dict[int, str] = {}
        self._holds_variables: set[int] = set()

    def incarnation(self, ps_index: int) -> str | None:
        """The incarnation of ps ``ps_index`` this transport first saw (the one its variables live in)."""
        with self._incarnation_lock:
            return self._incarnations.get(ps_index)

    def _observe(self, ps_index: int, incarnation: str, created: bool) -> None:
        with self._incarnation_lock:
            known = self._incarnations.get(ps_index)
            if known is not None and known != incarnation and ps_index in self._holds_variables:
                error = ps_restarted_error(ps_index, self.ps_addresses[ps_index],
                                           f"incarnation {known[:8]} became {incarnation[:8]}")
            else:
                self._incarnations[ps_index] = incarnation
                if created:
                    self._holds_variables.add(ps_index)
                return
        raise error

    @property
    def num_ps(self) -> int:
        return len(self._clients)

    def client(self, ps_index: int) -> Client:
        return self._clients[ps_index]

    def _unavailable(self, ps_index: int, method: str, err: RemoteError) -> BaseException:
        """The error a failed call to ps ``ps_index`` raises: unreachable -> PSUnavailableError, lost variable ->
        the restarted error, anything else (a bad request) as it is."""
        if err.code in PS_UNREACHABLE_CODES:
            return PSUnavailableError(ps_index, self.ps_addresses[ps_index], str(err), err.code)
        if err.code == "NOT_FOUND" and getattr(err, "reason", None) == UNKNOWN_VARIABLE:
            # every variable a ps is asked for was created on it by the coordinator: it came back empty
            return ps_restarted_error(ps_index, self.ps_addresses[ps_index],
                                      f"it answered {method} with NOT_FOUND: {err}")
        return err

    def _start(self, ps_index: int, method: str, meta: Mapping[str, Any] | None, arrays: Sequence[Any],
               timeout: float | None) -> Call[Any]:
        with self._count_lock:
            self.calls[ps_index] += 1
        try:
            return self._clients[ps_index].start(method, meta, arrays, timeout)
        except grpc.RpcError as err:  # a call refused before it left (channel closed...)
            raise self._unavailable(ps_index, method, self._clients[ps_index].remote_error(err, method)) from None

    def _finish(self, ps_index: int, method: str, call: Call[AnswerT]) -> tuple[AnswerT, list[np.ndarray]]:
        try:
            meta, arrays = call.result()
        except RemoteError as err:
            raise self._unavailable(ps_index, method, err) from None
        if _carries_incarnation(meta, method) and meta["incarnation"]:
            self._observe(ps_index, meta["incarnation"], created=method == PS.CREATE_VARIABLES)
        return meta, arrays

    @overload
    def call(  # type: ignore[overload-overlap]  # a Method is a str: this overload is the narrower one
            self, ps_index: int, method: Method[AnswerT], meta: Mapping[str, Any] | None = None,
            arrays: Sequence[Any] = (), timeout: float | None = None) -> tuple[AnswerT, list[np.ndarray]]: ...

    @overload
    def call(self, ps_index: int, method: str, meta: Mapping[str, Any] | None = None, arrays: Sequence[Any] = (),
             timeout: float | None = None) -> tuple[Answer, list[np.ndarray]]: ...

    def call(self, ps_index: int, method: str, meta: Mapping[str, Any] | None = None, arrays: Sequence[Any] = (),
             timeout: float | None = None) -> tuple[Any, list[np.ndarray]]:
        """One call to ps ``ps_index``; a built-in method's answer is validated against, and typed as, its
        declaration."""
        return self._finish(ps_index, method, self._start(ps_index, method, meta, arrays, timeout))

    @overload
    def call_many(  # type: ignore[overload-overlap]  # a Method is a str: this overload is the narrower one
            self, requests: Mapping[int, DeclaredRequest[AnswerT]],
            timeout: float | None = None) -> dict[int, tuple[AnswerT, list[np.ndarray]]]: ...

    @overload
    def call_many(self, requests: Mapping[int, Request],
                  timeout: float | None = None) -> dict[int, tuple[Answer, list[np.ndarray]]]: ...

    def call_many(self, requests: Mapping[int, Request],
                  timeout: float | None = None) -> dict[int, tuple[Any, list[np.ndarray]]]:
        """One call per parameter server, in parallel; the first failure is raised after all have finished. The
        answers are typed as :meth:`call`'s: when every call is of one :class:`Method` (or of methods sharing an
        answer), as its answer declaration.

        Every call is started (a gRPC future, or a chunk stream for big requests) before any answer is read, so
        they overlap without a thread per call.
        """
        started: dict[int, tuple[str, Call[Any]]] = {}
        first_error: BaseException | None = None
        for ps, (method, meta, arrays) in requests.items():
            try:
                started[ps] = (method, self._start(ps, method, meta, arrays, timeout))
            except BaseException as err:  # noqa: BLE001 - re-raised below, once the started calls finished
                first_error = err
                break
        results = {}
        for ps, (method, call) in started.items():
            try:
                results[ps] = self._finish(ps, method, call)
            except BaseException as err:  # noqa: BLE001 - re-raised below
                first_error = first_error or err
        if first_error is not None:
            raise first_error
        return results

    def close(self) -> None:
        for client in self._clients:
            client.close()
