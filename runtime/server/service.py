"""``Server``: the gRPC server of a ps or worker task, as ``tf.distribute.Server``.

A ps task serves ``kubeps.ParameterServer`` over a :class:`~kubeps.runtime.ps.state.ParameterServerState`; a worker task
serves ``kubeps.Worker`` over a :class:`~kubeps.runtime.worker.state.WorkerState`. Methods are table-driven: every method
is a function ``fn(state, request, arrays) -> (answer, arrays)`` looked up by name at call time in the tables of
:mod:`kubeps.runtime.server.methods`, which composes the built-in ones and takes the user's
(``register_ps_method``). Here, where it dispatches, the server validates a built-in method's request against its
declaration in :mod:`kubeps.runtime.rpc.protocol` (:mod:`kubeps.runtime.rpc.validation`), once, before the method
runs; a request of a method whose declaration says it takes no tensors may bring no tensor data.

Both services also answer ``Ping`` (``{"incarnation", "job", "task"}``): the coordinator's failure detector.

Errors map to gRPC status codes: a malformed frame or a bad argument (``ValueError``) -> ``INVALID_ARGUMENT``, an
unknown variable (``KeyError``) -> ``NOT_FOUND``, anything else -> ``INTERNAL``; the server keeps serving.

``python -m kubeps.runtime.server`` reads TF_CONFIG and the job token from the environment and runs the server
of its task (ps or worker) until SIGTERM/SIGINT.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import math
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Literal, Mapping, NoReturn, Protocol

import grpc

from kubeps.runtime.observe import logs
from kubeps.runtime.observe import metrics as _metrics
from kubeps.runtime.rpc import wire
from kubeps.runtime.checks import check, integer
from kubeps.runtime.cluster import ClusterSpec, TFConfig, TFConfigError, parse_address
from kubeps.runtime.checkpoint.format import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError,
                                              CheckpointSpaceError)
from kubeps.runtime.errors import LimitExceededError, RuntimeConfigError, short_repr
from kubeps.runtime.util.storage import StorageError
from kubeps.runtime.contract import (MAX_CALLS_PER_CLIENT_ENV, MIN_REQUEST_RATE_ENV, PARKED_ANSWER_TTL_ENV,
                                     REQUEST_TIMEOUT_ENV, STREAM_IDLE_TIMEOUT_ENV)
from kubeps.runtime import settings as _settings
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.ps.budget import AnswerBudget, Ledger
from kubeps.runtime.ps.state import ParameterServerState, UnknownVariableError
from kubeps.runtime.server.metrics import state_collector
from kubeps.runtime.server.processes import PSProcesses, die_with_task
from kubeps.runtime.server.methods import (BUILTIN_PS_METHODS, BUILTIN_WORKER_METHODS, PS_METHODS, WORKER_METHODS,
                                           Method, load_extensions, ps_methods, register_ps_method,
                                           register_worker_method, worker_methods)
from kubeps.runtime.rpc.client import CHANNEL_OPTIONS, SERVER_KEEPALIVE_OPTIONS
from kubeps.runtime.rpc.protocol import (ANSWER_ID_KEY, ANSWER_PARKED, COLLECT, COLLECT_SPEC, ERROR_REASON_KEY,
                                          LIMIT, PING, PS_SERVICE, PS_SPECS, TOO_MANY_CALLS, UNARY_PREFIX,
                                          UNKNOWN_VARIABLE, WORKER_SERVICE, WORKER_SPECS, EmptyRequest, MethodSpec,
                                          PingAnswer)
from kubeps.runtime.rpc.validation import COLLECT_REQUEST, PS_REQUESTS, WORKER_REQUESTS, RequestShape
from kubeps.runtime.rpc.security import TokenInterceptor, load_job_token, require_job_token
from kubeps.runtime.rpc.tls import TLSConfig, load_tls
from kubeps.runtime.util.threads import MathThreadTuner, limit_math_threads
from kubeps.runtime.models.xla import place_jax, size_cpu_backend_if_loaded
from kubeps.runtime.ops import kernels
from kubeps.runtime.worker.state import WorkerState

__all__ = [
    "Server",
    "main",
    "ps_methods",
    "register_ps_method",
    "register_worker_method",
    "worker_methods",
]

log = logging.getLogger("kubeps.runtime.server")


def _no_tensors(specs: Mapping[str, MethodSpec]) -> frozenset[str]:
    """The methods of a service whose requests carry no tensors (their data section must be empty), by their
    declarations: a method cannot be left out."""
    return frozenset(name for name, spec in {**specs, COLLECT: COLLECT_SPEC}.items() if not spec.tensors)


#: per service: the methods whose requests carry no tensors
_NO_TENSORS = {PS_SERVICE: _no_tensors(PS_SPECS), WORKER_SERVICE: _no_tensors(WORKER_SPECS)}
#: per service: its built-in methods and their requests' validators
_BUILTINS: dict[str, tuple[Mapping[str, Method], Mapping[str, RequestShape]]] = {
    PS_SERVICE: (BUILTIN_PS_METHODS, PS_REQUESTS), WORKER_SERVICE: (BUILTIN_WORKER_METHODS, WORKER_REQUESTS)}


_IDENTITY = lambda b: b  # noqa: E731


def _address_of(context: Any) -> str:
    """The peer's address without its port (``ipv4:10.0.0.7``)."""
    try:
        peer = context.peer() or "?"
    except Exception:  # noqa: BLE001 - a context without a peer
        return "?"
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rsplit(':', 1)[0]}"
    return peer


def _client_of(context: Any, by_identity: bool) -> str:
    """The client a call counts against. On a server that checks the job token, the job identity the call
    presented (the token, with its certificate's fingerprint under mutual TLS): every task of the job is the same
    client, wherever it connects from, so a second address buys an attacker nothing. On an insecure server (tests):
    the peer's address."""
    if not by_identity:
        return _address_of(context)
    try:
        certs = context.auth_context().get("x509_pem_cert") or []
    except Exception:  # noqa: BLE001 - a context without an auth context
        certs = []
    return "job:" + hashlib.sha256(certs[0]).hexdigest()[:16] if certs else "job"


#: how often the janitor hands memory freed inside the allocator back to the system (seconds)
_TRIM_EVERY_S = 2.0


#: glibc's ``mallopt`` parameters: the size from which a block gets its own mapping, and how much free memory at the
#: top of a heap is kept rather than handed back at once
_M_MMAP_THRESHOLD = -3
_M_TRIM_THRESHOLD = -1
_M_ARENA_MAX = -8
#: Fixed thresholds (which also stop glibc's dynamic ones). Blocks up to 32 MiB -- a step's rows, gradients and
#: activations, 4-8 MiB at batch 2048 x 8 fields x 64 floats -- are reused from the heap: with a 1 MiB threshold
#: each of them was a fresh mapping whose pages the kernel faulted in and zeroed on every step, 2.5x the CPU of the
#: arithmetic on them. Freed memory is kept in the heap (up to 128 MiB at its top) until the server's janitor
#: hands it back to the system every ``_TRIM_EVERY_S`` (``malloc_trim``), so a ps's memory follows what it holds
#: rather than its worst moment. Two arenas, not one per handler thread (up to 8 per core): freed blocks spread over
#: dozens of arenas were not given back (+20-40 MB after 60 pushes of a 4.8 MB tensor); in two they are.
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = 128 << 20
_ARENAS = 2


def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune or trim
        return None


_LIBC = _libc()
_TRIM = getattr(_LIBC, "malloc_trim", None)


def _tune_allocator() -> None:
    """Fixed allocator thresholds (see above), set when a server starts: only a process that serves, not one that
    merely imports this module, changes its allocator."""
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
        mallopt(_M_ARENA_MAX, _ARENAS)


def _release_free_memory() -> None:
    """Give the pages glibc keeps after big buffers were freed (refused requests, expired parked answers) back to
    the system, so a ps's memory follows what it holds rather than its worst moment."""
    if _TRIM is not None:
        _TRIM(0)


class _ParkedAnswers:
    """Answers of unary calls too big for one message, held until the client streams them (``Collect``); dropped
    after ``ttl_s`` by the server's janitor, and the oldest first once they hold more than ``max_bytes``."""

    def __init__(self, ttl_s: float = _settings.DEFAULT_PARKED_ANSWER_TTL_S,
                 max_bytes: int = _settings.DEFAULT_MAX_PARKED_BYTES):
        self._ttl = ttl_s
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._answers: dict[str, tuple[float, int, list[bytes]]] = {}
        self._bytes = 0

    def park(self, chunks: list[bytes]) -> str:
        answer_id = uuid.uuid4().hex
        size = sum(len(c) for c in chunks)
        with self._lock:
            self._answers[answer_id] = (time.monotonic(), size, chunks)
            self._bytes += size
            while self._bytes > self._max_bytes and len(self._answers) > 1:
                oldest = next(iter(self._answers))
                self._bytes -= self._answers.pop(oldest)[1]
        self.expire()
        return answer_id

    def take(self, answer_id: str) -> list[bytes] | None:
        with self._lock:
            entry = self._answers.pop(answer_id, None)
            if entry is not None:
                self._bytes -= entry[1]
        return None if entry is None else entry[2]

    def expire(self) -> int:
        """Drop the answers nobody collected within the TTL (the client went away); returns how many."""
        now = time.monotonic()
        with self._lock:
            old = [k for k, (t, _, _) in self._answers.items() if now - t > self._ttl]
            for key in old:
                self._bytes -= self._answers.pop(key)[1]
        return len(old)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._answers)


class _Throttled:
    """A warning said at most once per ``every_s`` seconds; the next one says how many were held back (a client
    that makes the server cancel its calls must not also fill its log)."""

    def __init__(self, every_s: float = 5.0):
        self._every_s, self._lock = every_s, threading.Lock()
        self._last, self._held = -math.inf, 0

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self._every_s:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        log.warning(message + (f" ({held} more like it in the last {self._every_s:.0f} s not logged)" if held else ""),
                    *args)


class _Slot:
    """One admitted call: its client, when it was admitted, the bytes of its request that arrived, since when it
    waits for the next chunk (None: not waiting), and whether it still counts against its client."""

    __slots__ = ("client", "context", "start", "received", "waiting_since", "deadline", "counted")

    def __init__(self, client: str, context: Any):
        self.client, self.context = client, context
        self.start = time.monotonic()
        self.received = 0
        self.waiting_since: float | None = None
        self.deadline = math.inf
        self.counted = True


class _Guard:
    """What keeps one client from holding a server's handler threads.

    * At most ``max_calls_per_client`` calls per client (:func:`_client_of`: the job identity) and ``max_calls``
      in all, both below the handler threads. A call past either bound first evicts the admitted call that
      waits for its request slowest (waiting for its next chunk for at least ``evict_after_s``, fewest bytes per
      second first; cancelled, its thread is freed); with none to evict it is refused at once (``RESOURCE_EXHAUSTED``,
      reason ``too-many-calls``, which kubeps clients retry), before it waits for a byte. So stalled streams,
      from however many addresses, cannot keep a correct call out.
    * Every request is awaited under deadlines measured on bytes: the next chunk within ``idle_s`` of the previous
      one, the whole request within ``request_s``, and, after its first ``idle_s``, at least ``min_rate`` bytes per
      second on average: a stream trickling a few bytes now and then is cancelled even though each chunk comes in
      time. A janitor thread cancels a call that misses a deadline, which frees its handler thread. The janitor
      also expires parked answers.
    """

    def __init__(self, idle_s: float, request_s: float, max_calls_per_client: int, parked: list[_ParkedAnswers], *,
                 max_calls: int | None = None, min_rate: int = _settings.DEFAULT_MIN_REQUEST_BYTES_PER_S,
                 by_identity: bool = True, evict_after_s: float = 0.1):
        self.idle_s, self.request_s, self.min_rate = idle_s, request_s, min_rate
        self.max_calls_per_client = max_calls_per_client
        self.max_calls = max_calls if max_calls is not None else max_calls_per_client
        self.evict_after_s = min(evict_after_s, idle_s)
        self._by_identity = by_identity
        self._parked = parked
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._total = 0
        self._slots: set[_Slot] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: calls the janitor cancelled, and calls evicted for a newcomer (tests read them)
        self.cancelled = 0
        self.evicted = 0
        self._evictions_log, self._stalls_log = _Throttled(), _Throttled()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._janitor, name="kubeps-guard", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def enter(self, context: Any) -> _Slot | None:
        slot = _Slot(_client_of(context, self._by_identity), context)
        victim: _Slot | None = None
        with self._lock:
            held = self._calls.get(slot.client, 0)
            if held >= self.max_calls_per_client or self._total >= self.max_calls:
                victim = self._slowest(slot.client if held >= self.max_calls_per_client else None)
                if victim is None:
                    return None
                self._uncount(victim)
                self._slots.discard(victim)
                self.evicted += 1
            self._calls[slot.client] = self._calls.get(slot.client, 0) + 1
            self._total += 1
            self._slots.add(slot)
        if victim is not None:
            self._evictions_log.warning("cancelled a call from %s to admit another: its request arrived slowest (%d "
                                        "bytes in %.1f s)", _address_of(victim.context), victim.received,
                                        time.monotonic() - victim.start)
            _cancel(victim.context)
        return slot

    def _slowest(self, client: str | None) -> _Slot | None:
        """The waiting call (of ``client``, or of anyone) whose request arrives slowest, if one waited long enough."""
        now = time.monotonic()
        waiting = [s for s in self._slots if s.waiting_since is not None and now - s.waiting_since >= self.evict_after_s
                   and (client is None or s.client == client)]
        return min(waiting, key=lambda s: s.received / max(now - s.start, 1e-3), default=None)

    def _uncount(self, slot: _Slot) -> None:
        if not slot.counted:
            return
        slot.counted = False
        self._total -= 1
        held = self._calls.get(slot.client, 1) - 1
        if held:
            self._calls[slot.client] = held
        else:
            self._calls.pop(slot.client, None)

    def leave(self, slot: _Slot) -> None:
        with self._lock:
            self._uncount(slot)
            self._slots.discard(slot)

    def receive(self, requests: Any, slot: _Slot, one: bool = False) -> Iterator[bytes]:
        """The request's chunks, each awaited under the deadlines; with ``one``, only its first message (a unary
        call's request: the stream's end is not awaited, which would cost one more trip through gRPC's polling
        thread)."""
        it = iter(requests)
        last = slot.start + self.request_s
        while True:
            now = time.monotonic()
            with self._lock:
                slot.waiting_since = now
                slot.deadline = min(now + self.idle_s, last, slot.start + self.idle_s + slot.received / self.min_rate)
            try:
                chunk = next(it)
            except StopIteration:
                return
            finally:
                with self._lock:
                    slot.waiting_since = None
                    slot.deadline = math.inf
            slot.received += len(chunk)
            yield chunk
            if one:
                return

    def _janitor(self) -> None:
        period = max(0.05, min(1.0, self.idle_s / 4))
        last_trim = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            if now - last_trim >= _TRIM_EVERY_S:
                last_trim = now
                _release_free_memory()
            with self._lock:
                late = [s for s in self._slots if s.deadline < now]
                for slot in late:
                    slot.deadline = math.inf
            for slot in late:
                self.cancelled += 1
                self._stalls_log.warning(
                    "cancelled a call from %s: its request stalled (no chunk for %.1f s, slower than %d bytes/s, or "
                    "not complete after %.0f s; %s, %s, %s)", _address_of(slot.context), self.idle_s, self.min_rate,
                    self.request_s, STREAM_IDLE_TIMEOUT_ENV, MIN_REQUEST_RATE_ENV, REQUEST_TIMEOUT_ENV)
                _cancel(slot.context)
            if sum(parked.expire() for parked in self._parked):
                _release_free_memory()


def _cancel(context: Any) -> None:
    try:
        context.cancel()
    except Exception:  # noqa: BLE001 - the call ended meanwhile
        pass


#: errno values that say the request named something unusable (a too-long name, a link, a file for a directory)
_BAD_PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.EINVAL,
                              errno.EEXIST, errno.EMLINK})
#: errno values that say the server ran out of something
_EXHAUSTED_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def _storage_status(err: OSError) -> Any:
    """The status code of a file-system error: a path the request should not have named -> INVALID_ARGUMENT, the
    server out of space or descriptors -> RESOURCE_EXHAUSTED, anything else (missing, not permitted, read-only,
    I/O) -> FAILED_PRECONDITION. A :class:`~kubeps.runtime.util.storage.StorageError` without an errno is a refused
    path."""
    if err.errno in _EXHAUSTED_ERRNOS:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if err.errno in _BAD_PATH_ERRNOS or (isinstance(err, StorageError) and err.errno is None):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.FAILED_PRECONDITION


def _storage_message(err: OSError) -> str:
    """One line: what the file system said, about the path the request gave (shortened), nothing else."""
    if isinstance(err, StorageError) or err.strerror is None:
        text = str(err)
        return text if len(text) <= 300 else text[:297] + "..."
    where = f" ({short_repr(err.filename, 120)})" if err.filename else ""
    return f"storage error{where}: {err.strerror}"


class _Context(Protocol):
    """The part of ``grpc.ServicerContext`` the handler uses (grpc ships no type information): ``abort`` raises."""

    def abort(self, code: Any, details: str) -> NoReturn: ...

    def set_trailing_metadata(self, trailing_metadata: tuple[tuple[str, str], ...]) -> None: ...

    def peer(self) -> str: ...

    def cancel(self) -> None: ...


#: per method served: its metric children (calls, answer bytes, seconds), bound once
_SERVED: dict[str, tuple[Any, Any, Any]] = {}


def _observe_served(method: str, started: float, chunks: list[bytes]) -> None:
    """Count one call served (the answer encoded) in the metrics."""
    children = _SERVED.get(method)
    if children is None:
        children = _SERVED[method] = (_metrics.RPC_SERVER_CALLS.labels(method), _metrics.RPC_SERVER_SENT.labels(method),
                                      _metrics.RPC_SERVER_SECONDS.labels(method))
    calls, sent, seconds = children
    calls.inc()
    sent.inc(sum(map(len, chunks)))
    seconds.observe(time.perf_counter() - started)


class _ServiceHandler(grpc.GenericRpcHandler):
    """Routes ``/<service>/<Method>`` (stream-stream) and ``/<service>/Unary.<Method>`` (one message each way) to
    the method table, looked up per call; ``/<service>/Collect`` streams a parked answer.

    The unary twin is served as stream-unary: the server reads the one request message itself, under the
    guard's deadline, instead of gRPC waiting for it in a handler thread with none (a unary-unary handler)."""

    def __init__(self, service: str, table: dict[str, Method], state: Any, server: "Server"):
        self._prefix = f"/{service}/"
        self._table = table
        self._builtins, self._requests = _BUILTINS[service]
        self._no_tensors = _NO_TENSORS[service]
        self._state = state
        #: the state's per-client answer budget (a ps's), charged by its reads while a call runs
        self._answers: AnswerBudget | None = getattr(state, "answers", None)
        self._server = server
        self.parked = _ParkedAnswers(server.parked_ttl_s, server.max_parked_bytes)

    def service(self, handler_call_details):
        method = handler_call_details.method
        if not method.startswith(self._prefix):
            return None
        name = method[len(self._prefix):]
        unary = name.startswith(UNARY_PREFIX)
        if unary:
            name = name[len(UNARY_PREFIX):]
        elif name == COLLECT:
            return grpc.stream_stream_rpc_method_handler(self._collect, _IDENTITY, _IDENTITY)
        if name == PING:
            fn: Method = self._ping
        else:
            found = self._table.get(name)
            if found is None:
                return None  # gRPC answers UNIMPLEMENTED
            fn = found
        if unary:
            return grpc.stream_unary_rpc_method_handler(
                lambda requests, context: self._invoke_unary(name, fn, requests, context), _IDENTITY, _IDENTITY
            )
        return grpc.stream_stream_rpc_method_handler(
            lambda requests, context: self._invoke(name, fn, requests, context), _IDENTITY, _IDENTITY
        )

    def _ping(self, state: Any, request: EmptyRequest, arrays: list[Any]) -> tuple[PingAnswer, list[Any]]:  # noqa: ARG002
        return {"incarnation": self._server.incarnation, "job": self._server.job_name,
                "task": self._server.task_index}, []

    def _enter(self, name: str, context: _Context) -> _Slot:
        slot = self._server.guard.enter(context)
        if slot is None:
            context.set_trailing_metadata(((ERROR_REASON_KEY, TOO_MANY_CALLS),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{name}: this client already has {self._server.guard.max_calls_per_client} calls in "
                          f"the server, the most one client may have ({MAX_CALLS_PER_CLIENT_ENV}), and none of "
                          "them stalls; retry later")
        return slot

    def _run(self, name: str, fn: Method, chunks, context: _Context, slot: _Slot, ledger: Ledger | None,
             unary: bool = False) -> list[bytes]:
        """Decode the request (``unary``: its one message), run the method, encode the answer in chunks; failures
        abort with a status code (never UNKNOWN: whatever a request holds, the answer says what was wrong with it)."""
        limit = 0 if name in self._no_tensors else self._server.max_request_bytes
        started = time.perf_counter() if _metrics.ENABLED else 0.0
        try:
            meta, arrays = wire.decode_chunks(self._server.guard.receive(chunks, slot, unary), limit,
                                              self._server.settings.max_header_bytes, self._server.settings.max_tensors)
        except wire.WireError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {err}")
        except grpc.RpcError:  # the client went away, or the guard cancelled the stalled call: nobody hears this
            context.abort(grpc.StatusCode.CANCELLED, f"{name}: the request did not arrive")
        except Exception as err:  # noqa: BLE001 - a malformed request the decoder did not name (a bug in it)
            log.warning("%s: request could not be decoded: %s: %s", name, type(err).__name__, err)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: malformed request ({type(err).__name__})")
        # a built-in's request is validated against its declaration (a user's method gets the decoded object)
        shape = self._requests.get(name) if name == PING or self._builtins.get(name) is fn else None
        try:
            request = meta if shape is None else shape.validate(meta)
            with (ledger.budget.charging(ledger) if ledger is not None else contextlib.nullcontext()):
                out_meta, out_arrays = fn(self._state, request, arrays)
            answer: list[bytes] = wire.encode_chunks(out_meta, out_arrays, self._server.chunk_bytes)
            if started:
                _observe_served(name, started, answer)
            return answer
        except LimitExceededError as err:
            context.set_trailing_metadata(((ERROR_REASON_KEY, LIMIT),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{name}: {err}")
        except (CheckpointMismatchError, CheckpointCorruptError) as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{name}: {err}")
        except CheckpointSpaceError as err:  # the storage is full: the message says how much was needed
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{name}: {err}")
        except (ValueError, TypeError, CheckpointError, RecursionError) as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {err}")
        except KeyError as err:
            if isinstance(err, UnknownVariableError):  # lets clients tell "lost variable" from other NOT_FOUNDs
                context.set_trailing_metadata(((ERROR_REASON_KEY, UNKNOWN_VARIABLE),))
            context.abort(grpc.StatusCode.NOT_FOUND, f"{name}: {err}")
        except MemoryError:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{name}: the server ran out of memory for this call")
        except OSError as err:  # the file system refused (a checkpoint path): the caller's problem, no traceback
            context.abort(_storage_status(err), f"{name}: {_storage_message(err)}")
        except Exception as err:  # noqa: BLE001 - never let a method take the server down
            log.exception("method %s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"{name}: {type(err).__name__}: {err}")

    def _ledger(self, slot: _Slot) -> Ledger | None:
        return self._answers.ledger(slot.client) if self._answers is not None else None

    def _invoke(self, name: str, fn: Method, requests, context: _Context):
        slot = self._enter(name, context)
        ledger = self._ledger(slot)
        try:
            try:
                chunks = self._run(name, fn, requests, context, slot, ledger)
            finally:
                self._server.guard.leave(slot)
            yield from chunks
        finally:  # the answer was handed to gRPC: it no longer counts against the client's budget
            if ledger is not None:
                ledger.release()

    def _invoke_unary(self, name: str, fn: Method, requests, context: _Context) -> bytes:
        slot = self._enter(name, context)
        ledger = self._ledger(slot)
        try:
            chunks = self._run(name, fn, requests, context, slot, ledger, unary=True)
        finally:
            self._server.guard.leave(slot)
            if ledger is not None:  # returned or parked (the parked bytes have their own bound)
                ledger.release()
        if len(chunks) == 1:
            return chunks[0]
        # the method ran (it may not be idempotent: never ask the client to call it again); hand the answer
        # over in chunks through Collect
        answer_id = self.parked.park(chunks)
        context.set_trailing_metadata(((ERROR_REASON_KEY, ANSWER_PARKED), (ANSWER_ID_KEY, answer_id)))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"{name}: the answer has {len(chunks)} chunks; collect it streamed with id {answer_id}")

    def _collect(self, requests, context: _Context):
        slot = self._enter(COLLECT, context)
        try:
            meta, _ = wire.decode_chunks(self._server.guard.receive(requests, slot), 0,
                                         self._server.settings.max_header_bytes)
            answer_id: str = COLLECT_REQUEST.validate(meta)["id"]
        except (wire.WireError, ValueError) as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{COLLECT}: {err} (the id is the one a unary call's "
                                                            f"trailing metadata '{ANSWER_ID_KEY}' named)")
        finally:
            self._server.guard.leave(slot)
        chunks = self.parked.take(answer_id)
        if chunks is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"{COLLECT}: no parked answer {answer_id!r} (collected "
                          f"already, or older than {self._server.parked_ttl_s:.0f} s, {PARKED_ANSWER_TTL_ENV})")
        yield from chunks


class Server:
    """``Server(cluster_spec, job_name, task_index)``: the gRPC server of one ps or worker task.

    ``settings`` (default :meth:`TaskSettings.from_env() <kubeps.runtime.settings.TaskSettings.from_env>`, read
    once here) give the limits, the bind host, the chunk size, and the token and TLS files the arguments leave out.
    ``token`` defaults to the settings' job token; a server without one refuses to start unless
    ``allow_insecure=True``. ``tls`` (default: the settings', :func:`~kubeps.runtime.rpc.tls.load_tls`) makes it
    serve mutual TLS only: no plaintext port, client certificates of the job's CA required.
    ``start=True`` (TF's default) starts it at once.
    """

    def __init__(self, cluster_spec: ClusterSpec | Mapping[str, Any], job_name: str, task_index: int = 0, *,
                 start: bool = True, token: str | None = None, allow_insecure: bool = False,
                 bind_host: str | None = None, max_workers: int | None = None, rpc_timeout: float = 30.0,
                 chunk_bytes: int | None = None, tls: TLSConfig | None = None,
                 settings: TaskSettings | None = None):
        try:
            self.cluster_spec = ClusterSpec(cluster_spec)
        except TFConfigError as err:
            raise RuntimeConfigError("cluster_spec", cluster_spec, str(err)) from None
        self.job_name = check("job_name", job_name, Literal["ps", "worker"],
                              allowed="a kubeps Server runs a 'ps' or a 'worker' task (the chief runs the "
                                      "coordinator, the evaluator runs user code)")
        count = self.cluster_spec.num_tasks(job_name)
        self.task_index = check("task_index", task_index, integer(ge=0, lt=count), allowed=(
            f"the cluster has {count} '{job_name}' task(s), so the index must be in 0..{count - 1}" if count
            else f"the cluster spec has no '{job_name}' job"))
        self.address = self.cluster_spec.task_address(job_name, task_index)
        self.port = parse_address(self.address)[1]
        self.settings = TaskSettings.from_env() if settings is None else settings
        self._token = require_job_token(token if token is not None else load_job_token(self.settings), allow_insecure)
        self.tls = tls if tls is not None else load_tls(self.settings)
        self.bind_host = bind_host or self.settings.bind_host
        self.chunk_bytes = chunk_bytes or self.settings.chunk_bytes or wire.DEFAULT_CHUNK_BYTES
        self._max_workers = max_workers or (64 if job_name == "ps" else 16)
        # the limits (docs/runtime.md, "Limits"); each is a setting of the task
        self.max_request_bytes = self.settings.max_request_bytes
        self.parked_ttl_s = self.settings.parked_answer_ttl_s
        self.max_parked_bytes = self.settings.max_parked_bytes
        max_calls = self.settings.max_calls_per_client or max(2, self._max_workers * 3 // 4)
        idle_s = self.settings.stream_idle_timeout_s
        request_s = self.settings.request_timeout_s
        if job_name == "ps":
            self.state: Any = ParameterServerState(settings=self.settings)
            service, table = PS_SERVICE, PS_METHODS
        else:
            ps = self.cluster_spec.job_tasks("ps") if "ps" in self.cluster_spec.jobs else []
            self.state = WorkerState(task_index, ps, self._token, rpc_timeout, tls=self.tls)
            service, table = WORKER_SERVICE, WORKER_METHODS
        #: random per process start (the state's): a restarted task answers Ping with a new one
        self.incarnation: str = self.state.incarnation
        self._handler = _ServiceHandler(service, table, self.state, self)
        # below the handler threads in all, so a few are always free to refuse, evict for, or serve a call
        self.guard = _Guard(idle_s, request_s, max_calls, [self._handler.parked],
                            max_calls=max(1, self._max_workers - max(2, self._max_workers // 8)),
                            min_rate=self.settings.min_request_bytes_per_s, by_identity=self._token is not None)
        self._server: grpc.Server | None = None
        self._collector: Any = None  # the state's scrape-time metrics, once served
        self._stopped = threading.Event()
        #: the other server processes of a ps task of several (``KUBEPS_PS_PROCESSES``), started with this one
        self.processes = (PSProcesses(self.cluster_spec, task_index, self.settings)
                          if job_name == "ps" and self.settings.ps_processes > 1 else None)
        if start:
            self.start()

    @property
    def target(self) -> str:
        """``grpc://host:port`` of this task, as TF's ``Server.target``."""
        return f"grpc://{self.address}"

    def start(self) -> None:
        if self._server is not None:
            return
        _tune_allocator()
        budget = limit_math_threads(settings=self.settings)  # BLAS/OpenMP pools capped to the task's CPUs
        if self.job_name == "worker":
            # where this worker's layers compute: KUBEPS_DEVICE=gpu without a GPU fails here, with the reason
            # (a ps never touches a GPU: its updates run on numpy arrays)
            log.info("kubeps worker task %d computes on %s", self.task_index, kernels.use_device(self.settings))
        if isinstance(self.state, WorkerState) and budget > 1:
            self.state.threads = MathThreadTuner(budget)  # and a worker's sized by what threads buy within the cap
        place_jax(self.settings, self.job_name)  # jax, where the program imported it: this task's device and share
        size_cpu_backend_if_loaded(self.settings)  # and XLA's CPU pool
        load_extensions(self.settings)  # KUBEPS_SERVER_EXTENSIONS: a plain Server(...).join() serves the user's methods
        server = grpc.server(
            ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix=f"kubeps-{self.job_name}"),
            handlers=[self._handler],
            interceptors=[TokenInterceptor(self._token)],
            options=CHANNEL_OPTIONS + SERVER_KEEPALIVE_OPTIONS + [("grpc.so_reuseport", 0)],
        )
        hosts = [self.bind_host] if self.bind_host else ["[::]", "0.0.0.0"]
        bound, errors = 0, []
        for host in hosts:
            try:
                if self.tls is not None:  # TLS only: no plaintext port at all
                    bound = server.add_secure_port(f"{host}:{self.port}", self.tls.server_credentials())
                else:
                    bound = server.add_insecure_port(f"{host}:{self.port}")
            except RuntimeError as err:  # grpc raises on failure in recent versions
                errors.append(f"{host}: {err}")
                bound = 0
            if bound:
                break
        if not bound:
            raise OSError(f"cannot listen on port {self.port} for /job:{self.job_name}/task:{self.task_index} "
                          f"(tried {', '.join(hosts)}): is the port in use? {'; '.join(errors)}")
        server.start()
        self.guard.start()
        self._server = server
        if _metrics.serve(self.settings) is not None and self._collector is None:
            self._collector = _metrics.add_collector(state_collector(self.state))
        if self.processes is not None:
            self.processes.start()
        log.info("kubeps %s task %d serving %s on port %d", self.job_name, self.task_index,
                 "mutual TLS" if self.tls is not None else "plaintext", self.port)

    def join(self) -> None:
        """Block until the server stops (TF's ``Server.join``)."""
        if self._server is None:
            raise RuntimeError("the server was never started; call start() first")
        # Wake up now and then: a signal the kernel hands to one of gRPC's threads runs its Python handler (the
        # image's exit on SIGTERM, main()'s stop) only when the main thread executes bytecode, and a wait without
        # a timeout held it off until the kubelet's SIGKILL at the end of the grace period.
        while not self._stopped.wait(0.25):
            pass
        self._server.wait_for_termination()

    def stop(self, grace: float | None = 1.0) -> None:
        if self.processes is not None:
            self.processes.stop()
        if self._server is not None:
            self._server.stop(grace).wait()
        self.guard.stop()
        if self._collector is not None:
            _metrics.remove_collector(self._collector)
            self._collector = None
        close = getattr(self.state, "close", None)
        if close:
            close()
        self._stopped.set()


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:  # noqa: ARG001
    """Entry point of ``python -m kubeps.runtime.server``: serve this task of TF_CONFIG until signalled (the task's
    settings are ``environ``'s, default ``os.environ``, read once)."""
    try:
        settings = TaskSettings.from_env(environ)
    except RuntimeConfigError as err:
        print(f"kubeps server: {err}", file=sys.stderr)
        return 2
    logs.configure(settings)  # text, or JSON lines with the job, role, index and step (KUBEPS_LOG_FORMAT)
    if settings.ps_task_pid is not None:  # a process a ps task started: it ends with the task
        die_with_task(settings.ps_task_pid)
    try:
        load_extensions(settings)
        config = TFConfig.of_settings(settings)
        if config.task is None or not config.cluster:
            raise TFConfigError("TF_CONFIG", settings.tf_config,
                                "must name a cluster and a task, e.g. {\"cluster\": {...}, \"task\": {\"type\": \"ps\", \"index\": 0}}")
        if config.task_type not in ("ps", "worker"):
            raise TFConfigError("task.type", config.task_type,
                                "python -m kubeps.runtime.server runs 'ps' and 'worker' tasks; the chief and the "
                                "evaluator run the user's program")
        server = Server(ClusterSpec(config.cluster), config.task_type, config.task.index, start=False,
                        settings=settings)
        server.start()
    except (TFConfigError, RuntimeConfigError, OSError) as err:
        print(f"kubeps server: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - e.g. InsecureServerError: say it and exit non-zero
        print(f"kubeps server: {type(err).__name__}: {err}", file=sys.stderr)
        return 2

    def _terminate(signum, frame):  # noqa: ARG001
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    print(f"kubeps server ready: /job:{server.job_name}/task:{server.task_index} port {server.port}",
          file=sys.stderr, flush=True)
    server.join()
    return 0
