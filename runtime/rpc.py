"""The client half of kubeps' gRPC glue: one stream-stream method per registered name, raw bytes both ways.

Service paths are ``/kubeps.ParameterServer/<Method>`` and ``/kubeps.Worker/<Method>``. Requests and responses are
wire frames (:mod:`kubeps.runtime.wire`) cut into chunks; serializers are the identity, so no protoc and no pickle.
Every call has a deadline (fail fast: no ``wait_for_ready``), so a dead peer is an error, never a hang.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import grpc
import numpy as np

from . import wire
from .errors import RemoteError, UnauthenticatedError
from .security import token_metadata

__all__ = [
    "CHANNEL_OPTIONS",
    "PS_SERVICE",
    "WORKER_SERVICE",
    "Client",
    "DEFAULT_TIMEOUT_S",
    "ERROR_REASON_KEY",
    "UNKNOWN_VARIABLE",
]

PS_SERVICE = "kubeps.ParameterServer"
WORKER_SERVICE = "kubeps.Worker"
#: trailing-metadata key a server sets to say why a call failed, beyond the status code; a client's
#: :class:`RemoteError` carries it as ``.reason``
ERROR_REASON_KEY = "x-kubeps-error"
#: ``reason`` of a NOT_FOUND for a variable the parameter server does not hold (it restarted and lost it)
UNKNOWN_VARIABLE = "unknown-variable"
#: Deadline of a call that has none of its own (seconds).
DEFAULT_TIMEOUT_S = 30.0
_MAX_MESSAGE = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # big flow-control windows let one stream fill the pipe (tuned with bench/pushpull.py)
    ("grpc.http2.lookahead_bytes", 8 << 20),
    ("grpc.http2.bdp_probe", 1),
]

_IDENTITY = lambda b: b  # noqa: E731


def _connect_address(address: str) -> str:
    """Clients on this host reach a task by its cluster address."""
    return address


class Client:
    """Calls methods of one task. Thread-safe; the channel reconnects by itself after the peer comes back."""

    def __init__(self, address: str, service: str, token: str | None, timeout: float = DEFAULT_TIMEOUT_S,
                 chunk_bytes: int | None = None):
        self.address = address
        self.service = service
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._metadata = token_metadata(token)
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._methods: dict[str, Any] = {}

    def _method(self, name: str):
        with self._lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(_connect_address(self.address), options=CHANNEL_OPTIONS)
            method = self._methods.get(name)
            if method is None:
                method = self._channel.stream_stream(
                    f"/{self.service}/{name}", request_serializer=_IDENTITY, response_deserializer=_IDENTITY
                )
                self._methods[name] = method
            return method

    def start(self, name: str, meta: dict[str, Any] | None = None, arrays: Sequence[Any] = (),
              timeout: float | None = None):
        """Start a call; returns the response iterator (a grpc call object: ``.cancel()`` aborts it)."""
        chunks = wire.encode_chunks(meta, arrays, self.chunk_bytes or wire.DEFAULT_CHUNK_BYTES)
        return self._method(name)(iter(chunks), timeout=self.timeout if timeout is None else timeout,
                                  metadata=self._metadata)

    def finish(self, call) -> tuple[dict[str, Any], list[np.ndarray]]:
        """Read a started call's response; gRPC failures become :class:`RemoteError` with the status code name."""
        try:
            decoder = wire.MessageDecoder()
            for chunk in call:
                decoder.feed(chunk)
            return decoder.finish()
        except grpc.RpcError as err:
            raise self._error(err) from None

    def call(self, name: str, meta: dict[str, Any] | None = None, arrays: Sequence[Any] = (),
             timeout: float | None = None) -> tuple[dict[str, Any], list[np.ndarray]]:
        try:
            call = self.start(name, meta, arrays, timeout)
        except grpc.RpcError as err:
            raise self._error(err) from None
        return self.finish(call)

    def _error(self, err: grpc.RpcError) -> RemoteError:
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        name = code.name if code is not None else "UNKNOWN"
        message = f"{self.service} at {self.address} failed with {name}: {details}"
        cls = UnauthenticatedError if code == grpc.StatusCode.UNAUTHENTICATED else RemoteError
        error = cls(message, code=name, address=self.address)
        reason = None
        try:
            trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
            reason = dict(trailing or ()).get(ERROR_REASON_KEY)
        except Exception:  # noqa: BLE001 - a failed call without metadata
            reason = None
        error.reason = reason
        return error

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = None
            self._methods.clear()
