"""The client half of kubeps' gRPC glue: two paths per registered name, raw bytes both ways.

Service paths are ``/kubeps.ParameterServer/<Method>`` and ``/kubeps.Worker/<Method>`` (stream-stream: requests
and responses are wire frames (:mod:`kubeps.runtime.rpc.wire`) cut into chunks), plus the unary twin
``/<service>/Unary.<Method>`` (one message each way). A request that fits one chunk takes the unary twin: a
unary-unary round trip costs a third of a stream-stream one in grpc-python (no request-iterator thread, one batch
of operations). If the answer turns out bigger than one chunk, the server -- having run the method exactly once --
parks it and answers ``RESOURCE_EXHAUSTED`` with reason ``answer-parked``; the client then streams it in chunks
with the reserved ``Collect`` method, so big tensors always travel in chunks both ways.

Serializers are the identity, so no protoc and no pickle. Every call has a deadline (fail fast: no
``wait_for_ready``), so a dead peer is an error, never a hang.

A client made with ``sender_threads=True`` (the parameter-server clients of the step path) makes its unary calls as
*blocking* gRPC calls on threads of its own, one per call in flight, instead of as gRPC futures: a future is
completed by the channel's polling thread, which takes the GIL for every event of every call. Two small calls
to two servers on loopback cost the caller 1.1 ms of CPU as futures and 0.7 ms as blocking calls on two waiting
threads; in ``bench/ctr_vs_tf.py`` the workers' CPU per step fell from 8.8-9.3 ms to 8.4-8.6 ms (figures in
docs/benchmarks.md). Such a call cannot be aborted on the wire: ``cancel()`` releases its waiter at once and the
call runs on to its deadline on its thread (the coordinator's calls to workers, which it does cancel, stay
futures).

A client made with ``blocking=True`` (the coordinator's worker clients) makes a one-chunk call as a blocking gRPC
call on the thread that reads its result (``finish``/``result``), so no other thread takes part: a gRPC future on
a channel with no other call in flight starts a new polling thread for every call, which cost the chief's
dispatch more CPU than the call itself (``bench/dispatch.py``). ``cancel()`` of such a call closes the client's
channel -- every call on it ends at once with ``CANCELLED`` -- and the next call opens a new one: the coordinator
cancels a worker's call only when it gives the worker up.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Generic, Mapping, Sequence, TypeVar, overload

import grpc
import numpy as np

from kubeps.runtime.observe import metrics as _metrics
from kubeps.runtime.rpc import wire
from kubeps.runtime.errors import RemoteError, UnauthenticatedError
from kubeps.runtime.rpc.protocol import (ANSWER_ID_KEY, ANSWER_PARKED, COLLECT, CollectRequest, ERROR_REASON_KEY, TOO_MANY_CALLS,
                                          UNARY_PREFIX, Method)
from kubeps.runtime.rpc.security import token_metadata
from kubeps.runtime.rpc.tls import TLSConfig
from kubeps.runtime.rpc.validation import ANSWERS, AnswerShape

__all__ = ["CHANNEL_OPTIONS", "DEFAULT_TIMEOUT_S", "SERVER_KEEPALIVE_OPTIONS", "Answer", "Call", "Client"]

#: a call's answer metadata: its method's answer declaration (a :class:`~kubeps.runtime.rpc.protocol.Method`'s), the
#: decoded JSON object for a method the protocol does not declare (the user's)
AnswerT = TypeVar("AnswerT")
#: what a call of a method the protocol does not declare answers
Answer = dict[str, Any]

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

#: The server's side of the keepalive policy: accept the clients' pings (every ``grpc.keepalive_time_ms``, with or
#: without calls in flight) on an idle channel. gRPC's defaults (a ping without data at most every 5 minutes, 2
#: strikes) answer an idle worker's pings with GOAWAY ``too_many_pings`` (a chief waiting on its callbacks, an early
#: stop), which closes the channel.
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.min_time_between_pings_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]

_IDENTITY = lambda b: b  # noqa: E731


def _connect_address(address: str) -> str:
    """Clients on this host reach a task by its cluster address."""
    return address


class Client:
    """Calls methods of one task. Thread-safe; the channel reconnects by itself after the peer comes back.

    With ``tls`` the channel is mutual TLS (:mod:`kubeps.runtime.rpc.tls`); without, plaintext.
    """

    def __init__(self, address: str, service: str, token: str | None, timeout: float = DEFAULT_TIMEOUT_S,
                 chunk_bytes: int | None = None, tls: TLSConfig | None = None, sender_threads: bool = False,
                 blocking: bool = False):
        if sender_threads and blocking:
            raise ValueError("a Client makes its unary calls either on sender threads or blocking, not both")
        self.address = address
        self.tls = tls
        self.service = service
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._metadata = token_metadata(token)
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._methods: dict[tuple[str, bool], Any] = {}
        #: the threads that make blocking unary calls (``sender_threads``), else None: gRPC futures
        self._senders: _Senders | None = _Senders() if sender_threads else None
        #: one-chunk calls run blocking on the reader's thread; cancelling one closes the channel
        self._blocking = blocking
        #: the metric children of each method called (bound once; :mod:`kubeps.runtime.observe.metrics`)
        self._metrics: dict[str, _metrics.CallMetrics] = {}
        #: the answer validator of each built-in method of the service (a user's method has none)
        self._answers: dict[str, AnswerShape] = ANSWERS.get(service, {})

    def _method(self, name: str, unary: bool = False) -> Any:
        """The multi-callable of a method: its stream-stream path, or (``unary``) its unary-unary twin."""
        return self._method_on_channel(name, unary)[1]

    def _method_on_channel(self, name: str, unary: bool = False) -> tuple[grpc.Channel, Any]:
        """``(channel, multi-callable)``: the method, with the channel it calls on."""
        with self._lock:
            if self._channel is None:
                target = _connect_address(self.address)
                if self.tls is not None:
                    self._channel = grpc.secure_channel(target, self.tls.channel_credentials(), options=CHANNEL_OPTIONS)
                else:
                    self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
            key = (name, unary)
            method = self._methods.get(key)
            if method is None:
                if unary:
                    method = self._channel.unary_unary(f"/{self.service}/{UNARY_PREFIX}{name}",
                                                       request_serializer=_IDENTITY, response_deserializer=_IDENTITY)
                else:
                    method = self._channel.stream_stream(f"/{self.service}/{name}",
                                                         request_serializer=_IDENTITY, response_deserializer=_IDENTITY)
                self._methods[key] = method
            return self._channel, method

    def _drop_channel(self, channel: grpc.Channel) -> None:
        """Close ``channel`` (its calls end with ``CANCELLED``); the next call opens a new one."""
        with self._lock:
            if self._channel is channel:
                self._channel = None
                self._methods.clear()
        channel.close()

    @overload
    def start(  # type: ignore[overload-overlap]  # a Method is a str: this overload is the narrower one
            self, name: Method[AnswerT], meta: Mapping[str, Any] | None = None, arrays: Sequence[Any] = (),
            timeout: float | None = None) -> "Call[AnswerT]": ...

    @overload
    def start(self, name: str, meta: Mapping[str, Any] | None = None, arrays: Sequence[Any] = (),
              timeout: float | None = None) -> "Call[Answer]": ...

    def start(self, name: str, meta: Mapping[str, Any] | None = None, arrays: Sequence[Any] = (),
              timeout: float | None = None) -> "Call[Any]":
        """Start a call without waiting for it; ``finish(call)`` (or ``call.result()``) reads the answer.

        A request that encodes to one chunk goes out on the method's unary twin (one gRPC message each way, no
        request-iterator thread); a bigger one is streamed in chunks. ``.cancel()`` on the returned call aborts it.
        """
        timeout = self.timeout if timeout is None else timeout
        chunks = wire.encode_chunks(meta, arrays, self.chunk_bytes or wire.DEFAULT_CHUNK_BYTES)
        call: Call[Any] = Call(self, name, timeout, chunks)
        call._launch(timeout)
        return call

    def finish(self, call: "Call[AnswerT]") -> tuple[AnswerT, list[np.ndarray]]:
        """Read a started call's response; gRPC failures become :class:`RemoteError` with the status code name."""
        return call.result()

    @overload
    def call(  # type: ignore[overload-overlap]  # a Method is a str: this overload is the narrower one
            self, name: Method[AnswerT], meta: Mapping[str, Any] | None = None, arrays: Sequence[Any] = (),
            timeout: float | None = None) -> tuple[AnswerT, list[np.ndarray]]: ...

    @overload
    def call(self, name: str, meta: Mapping[str, Any] | None = None, arrays: Sequence[Any] = (),
             timeout: float | None = None) -> tuple[Answer, list[np.ndarray]]: ...

    def call(self, name: str, meta: Mapping[str, Any] | None = None, arrays: Sequence[Any] = (),
             timeout: float | None = None) -> tuple[Any, list[np.ndarray]]:
        """Call ``name`` and wait for its answer: a built-in method's validated against its declaration."""
        try:
            call = self.start(name, meta, arrays, timeout)
        except grpc.RpcError as err:
            raise self.remote_error(err, name) from None
        return call.result()

    def _collect(self, answer_id: str, timeout: float, call: "Call[Any] | None" = None) -> tuple[dict[str, Any],
                                                                                                list[np.ndarray]]:
        """Fetch, streamed in chunks, an answer the server parked because it was too big for one unary message.

        With ``call``, the stream is attached to it, so that ``call.cancel()`` (the failure detector giving up on a
        frozen peer) aborts the collection too instead of leaving it to its deadline.
        """
        chunks = wire.encode_chunks(CollectRequest(id=answer_id))
        stream = self._method(COLLECT)(iter(chunks), timeout=timeout, metadata=self._metadata)
        if call is not None:
            call._collecting = stream
            if call._cancelled:  # cancel() ran before the stream was attached: it did not see it
                stream.cancel()
        return _read_stream(self, stream, COLLECT, call)

    def remote_error(self, err: grpc.RpcError, method: str | None = None) -> RemoteError:
        """The :class:`RemoteError` (or :class:`UnauthenticatedError`) for a failed gRPC call to this task; the
        message names the method (the server's details name the field and the value of a refused request)."""
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        name = code.name if code is not None else "UNKNOWN"
        where = f"{self.service}.{method}" if method else self.service
        message = f"{where} at {self.address} failed with {name}: {details}"
        cls = UnauthenticatedError if code == grpc.StatusCode.UNAUTHENTICATED else RemoteError
        error = cls(message, code=name, address=self.address)
        error.method = method
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
        if self._senders is not None:
            self._senders.close()


class _Senders:
    """The threads of a client that make its unary calls as blocking calls: an idle one takes the next call, a
    new one starts when none is idle (so a call stuck until its deadline never holds up the next), and they end
    with the client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Call[Any] | None]] = []
        self._closed = False

    def send(self, call: "Call[Any]") -> None:
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue[Call[Any] | None]()
            threading.Thread(target=self._serve, args=(jobs,), name="kubeps-rpc-sender", daemon=True).start()
        jobs.put(call)

    def _serve(self, jobs: queue.SimpleQueue[Call[Any] | None]) -> None:
        while True:
            call = jobs.get()
            if call is None:
                return
            call._send()
            with self._lock:
                if self._closed:
                    return
                self._idle.append(jobs)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for jobs in idle:
            jobs.put(None)


def _read_stream(client: Client, stream: Any, method: str,
                 call: "Call[Any] | None" = None) -> tuple[dict[str, Any], list[np.ndarray]]:
    try:
        decoder = wire.MessageDecoder()
        received = 0
        for chunk in stream:
            received += len(chunk)
            decoder.feed(chunk)
        if call is not None:
            call._received = received
        return decoder.finish()
    except grpc.RpcError as err:
        raise client.remote_error(err, method) from None


#: first and longest pause before a call the server refused as one too many of this client's is sent again
_BUSY_BACKOFF_S = (0.005, 0.25)


class Call(Generic[AnswerT]):
    """A started call (unary future or chunk stream): ``result()`` waits for and decodes the answer -- for a
    built-in method, validated against its declaration (an :class:`~kubeps.runtime.rpc.validation.AnswerError`
    naming the method, the peer and the field when it does not fit).

    A call the server refused before running it because this client had too many calls there (reason
    ``too-many-calls``) is sent again, with backoff, until its deadline."""

    __slots__ = ("_client", "_name", "_timeout", "_chunks", "_deadline", "_future", "_stream", "_collecting",
                 "_cancelled", "_sent", "_answer", "_error", "_inline", "_started", "_received")

    def __init__(self, client: Client, name: str, timeout: float, chunks: list[bytes] | None = None, *,
                 future: Any = None, stream: Any = None):
        self._client, self._name, self._timeout = client, name, timeout
        self._chunks = chunks  # what to send again when the server was busy (None: never sent again)
        self._deadline = time.monotonic() + timeout
        self._future: Any = future
        self._stream: Any = stream
        self._collecting: Any = None  # the Collect stream of a parked answer, once started
        self._cancelled = False
        #: a blocking call on a sender thread: held until its outcome (``_answer`` or ``_error``) is in
        self._sent: threading.Lock | None = None
        self._answer: bytes | None = None
        self._error: BaseException | None = None
        #: a blocking call made by the reader (``Client(blocking=True)``): ``(channel, multi-callable)``
        self._inline: tuple[grpc.Channel, Any] | None = None
        self._started = time.perf_counter()
        self._received = 0  # answer bytes, for the metrics

    def _launch(self, timeout: float) -> None:
        client = self._client
        assert self._chunks is not None, "only a call started from its chunks is launched"
        if len(self._chunks) == 1 and client._blocking:
            self._inline = client._method_on_channel(self._name, unary=True)  # called by result()
        elif len(self._chunks) == 1 and client._senders is not None:
            self._sent = threading.Lock()
            self._sent.acquire()
            self._answer = self._error = None
            client._senders.send(self)
        elif len(self._chunks) == 1:
            self._future = client._method(self._name, unary=True).future(self._chunks[0], timeout=timeout,
                                                                         metadata=client._metadata)
        else:
            self._stream = client._method(self._name)(iter(self._chunks), timeout=timeout,
                                                      metadata=client._metadata)

    def _send(self) -> None:
        """On a sender thread: make the blocking call, keep its outcome, release the waiter."""
        client, chunks = self._client, self._chunks
        assert chunks is not None, "a sent call has its chunks"
        try:
            left = max(0.001, self._deadline - time.monotonic())
            self._answer = client._method(self._name, unary=True)(chunks[0], timeout=left, metadata=client._metadata)
        except BaseException as err:  # noqa: BLE001 - handed to the waiter, raised there
            self._error = err
        finally:
            self._release()

    def _release(self) -> None:
        sent = self._sent
        assert sent is not None, "only a call on a sender thread is released"
        try:
            sent.release()
        except RuntimeError:  # released already (cancelled, then the outcome came)
            pass

    @property
    def unary(self) -> bool:
        return self._future is not None or self._sent is not None or self._inline is not None

    def cancel(self) -> bool:
        """Abort the call -- the Collect stream of its parked answer too, once that started; ``result()`` then
        raises a :class:`RemoteError` with code ``CANCELLED``. (A blocking call on a sender thread runs on to its
        deadline there; its waiter is released at once.)"""
        already, self._cancelled = self._cancelled, True
        if self._inline is not None:
            cancelled = not already and self._answer is None
            self._client._drop_channel(self._inline[0])
        elif self._sent is not None:
            done = self._answer is not None or self._error is not None
            self._release()
            cancelled = not (already or done)
        else:
            cancelled = (self._future or self._stream).cancel()
        collecting = self._collecting
        if collecting is not None:
            cancelled = collecting.cancel() or cancelled
        return cancelled

    def _cancelled_error(self) -> RemoteError:
        error = RemoteError(f"{self._client.service} at {self._client.address} failed with CANCELLED: "
                            f"{self._name} was cancelled locally", code="CANCELLED", address=self._client.address)
        error.reason = None
        return error

    def result(self) -> tuple[AnswerT, list[np.ndarray]]:
        """The decoded answer. Every failure is a :class:`RemoteError` (a cancelled call: code ``CANCELLED``; an
        answer its declaration refuses: code ``INTERNAL``), never a raw gRPC exception: callers' threads (the
        coordinator's dispatch threads) handle only that."""
        pause = _BUSY_BACKOFF_S[0]
        while True:
            try:
                decoded, arrays = self._result()
                shape = self._client._answers.get(self._name)
                # AnswerT is the declaration of the method's answer: the shape validates exactly that
                meta: Any = decoded if shape is None else shape.validate(decoded, self._client.service, self._name,
                                                                         self._client.address)
                if _metrics.ENABLED:
                    self._observe(None)
                return meta, arrays
            except RemoteError as error:
                left = self._deadline - time.monotonic()
                if error.reason != TOO_MANY_CALLS or self._cancelled or left <= pause or self._chunks is None:
                    if _metrics.ENABLED:
                        self._observe(error.code or "UNKNOWN")
                    raise
            time.sleep(pause)
            pause = min(pause * 2, _BUSY_BACKOFF_S[1])
            self._launch(max(0.001, self._deadline - time.monotonic()))

    def _observe(self, code: str | None) -> None:
        """Count this call in the metrics (``code``: the gRPC code of its failure, None when it succeeded)."""
        client = self._client
        children = _metrics.client_call(client._metrics, self._name, client.address)
        seconds = time.perf_counter() - self._started
        sent = sum(map(len, self._chunks)) if self._chunks is not None else 0
        if code is None:
            children.observe(seconds, sent, self._received)
        else:
            children.failed(seconds, sent, code)

    def _result(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        if self._stream is not None:
            return _read_stream(self._client, self._stream, self._name, self)
        try:
            if self._inline is not None:
                answer = self._call_inline(self._inline[1])
            elif self._sent is not None:
                self._sent.acquire()
                if self._cancelled:
                    raise grpc.FutureCancelledError()
                if self._error is not None:
                    raise self._error
                sent_answer = self._answer
                assert sent_answer is not None, "a call released without an error has its answer"
                answer = sent_answer
            else:
                answer = self._future.result()
        except grpc.FutureCancelledError:
            raise self._cancelled_error() from None
        except grpc.RpcError as err:
            error = self._client.remote_error(err, self._name)
            if error.code == "RESOURCE_EXHAUSTED" and error.reason == ANSWER_PARKED:
                answer_id = _trailing(err, ANSWER_ID_KEY)
                if answer_id:
                    if self._cancelled:
                        raise self._cancelled_error() from None
                    return self._client._collect(answer_id, self._timeout, call=self)
            raise error from None
        self._received = len(answer)
        return wire.decode_message(answer)

    def _call_inline(self, method: Any) -> bytes:
        """The blocking call of a ``Client(blocking=True)``, on this thread; cancelled: ``FutureCancelledError``."""
        assert self._chunks is not None, "an inline call has its chunks"
        if self._cancelled:
            raise grpc.FutureCancelledError()
        client = self._client
        try:
            left = max(0.001, self._deadline - time.monotonic())
            self._answer = method(self._chunks[0], timeout=left, metadata=client._metadata)
        except grpc.RpcError:
            if self._cancelled:  # our cancel() closed the channel under the call
                raise grpc.FutureCancelledError() from None
            raise
        except ValueError:  # "Cannot invoke RPC on closed channel!": cancelled, or the client was closed
            raise grpc.FutureCancelledError() from None
        return self._answer


def _trailing(err: grpc.RpcError, key: str) -> str | None:
    try:
        trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
        return dict(trailing or ()).get(key)
    except Exception:  # noqa: BLE001 - a failed call without metadata
        return None
