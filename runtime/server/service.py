"""``Server``: the gRPC server of a ps or worker task, as ``tf.distribute.Server``.

A ps task serves ``kubeps.ParameterServer`` over a :class:`~kubeps.runtime.ps.state.ParameterServerState`; a worker task
serves ``kubeps.Worker`` over a :class:`~kubeps.runtime.worker.state.WorkerState`. Methods are table-driven: every method
is a function ``fn(state, meta, arrays) -> (meta, arrays)`` looked up by name at call time in the tables of
:mod:`kubeps.runtime.server.methods`, which composes the built-in ones and takes the user's
(``register_ps_method``).

Both services also answer ``Ping`` (``{"incarnation", "job", "task"}``): the coordinator's failure detector.

Errors map to gRPC status codes: a malformed frame or a bad argument (``ValueError``) -> ``INVALID_ARGUMENT``, an
unknown variable (``KeyError``) -> ``NOT_FOUND``, anything else -> ``INTERNAL``; the server keeps serving.

``python -m kubeps.runtime.server`` reads TF_CONFIG and the job token from the environment and runs the server
of its task (ps or worker) until SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, NoReturn, Protocol

import grpc

from kubeps.runtime.rpc import wire
from kubeps.runtime.cluster import ClusterSpec, TFConfig, TFConfigError, parse_address
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.contract import BIND_HOST_ENV, CHUNK_BYTES_ENV, LOG_LEVEL_ENV
from kubeps.runtime.ps.state import ParameterServerState, UnknownVariableError
from kubeps.runtime.server.methods import (PS_METHODS, WORKER_METHODS, Method, load_extensions, ps_methods,
                                           register_ps_method, register_worker_method, worker_methods)
from kubeps.runtime.rpc.client import CHANNEL_OPTIONS
from kubeps.runtime.rpc.protocol import (ANSWER_ID_KEY, ANSWER_PARKED, COLLECT, ERROR_REASON_KEY, PING, PS_SERVICE,
                                          UNARY_PREFIX, UNKNOWN_VARIABLE, WORKER_SERVICE)
from kubeps.runtime.rpc.security import TokenInterceptor, load_job_token, require_job_token
from kubeps.runtime.rpc.tls import TLSConfig, load_tls
from kubeps.runtime.util.threads import limit_math_threads
from kubeps.runtime.models.xla import size_cpu_backend_if_loaded
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

#: how long a parked unary answer (too big for one message) waits for its client's Collect (seconds)
PARKED_TTL_S = 120.0


_IDENTITY = lambda b: b  # noqa: E731


class _ParkedAnswers:
    """Answers of unary calls too big for one message, held until the client streams them (``Collect``)."""

    def __init__(self, ttl_s: float = PARKED_TTL_S):
        self._ttl = ttl_s
        self._lock = threading.Lock()
        self._answers: dict[str, tuple[float, list[bytes]]] = {}

    def park(self, chunks: list[bytes]) -> str:
        answer_id = uuid.uuid4().hex
        now = time.monotonic()
        with self._lock:
            for key in [k for k, (t, _) in self._answers.items() if now - t > self._ttl]:
                del self._answers[key]  # the client that would collect it went away
            self._answers[answer_id] = (now, chunks)
        return answer_id

    def take(self, answer_id: str) -> list[bytes] | None:
        with self._lock:
            entry = self._answers.pop(answer_id, None)
        return None if entry is None else entry[1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._answers)


class _Context(Protocol):
    """The part of ``grpc.ServicerContext`` the handler uses (grpc ships no type information): ``abort`` raises."""

    def abort(self, code: Any, details: str) -> NoReturn: ...

    def set_trailing_metadata(self, trailing_metadata: tuple[tuple[str, str], ...]) -> None: ...


class _ServiceHandler(grpc.GenericRpcHandler):
    """Routes ``/<service>/<Method>`` (stream-stream) and ``/<service>/Unary.<Method>`` (unary-unary) to the
    method table, looked up per call; ``/<service>/Collect`` streams a parked answer."""

    def __init__(self, service: str, table: dict[str, Method], state: Any, server: "Server"):
        self._prefix = f"/{service}/"
        self._table = table
        self._state = state
        self._server = server
        self.parked = _ParkedAnswers()

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
            return grpc.unary_unary_rpc_method_handler(
                lambda request, context: self._invoke_unary(name, fn, request, context), _IDENTITY, _IDENTITY
            )
        return grpc.stream_stream_rpc_method_handler(
            lambda requests, context: self._invoke(name, fn, requests, context), _IDENTITY, _IDENTITY
        )

    def _ping(self, state: Any, meta: dict[str, Any], arrays: list):
        return {"incarnation": self._server.incarnation, "job": self._server.job_name,
                "task": self._server.task_index}, []

    def _run(self, name: str, fn: Method, chunks, context: _Context) -> list[bytes]:
        """Decode the request, run the method, encode the answer in chunks; failures abort with a status code."""
        try:
            meta, arrays = wire.decode_chunks(chunks)
        except wire.WireError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {err}")
        try:
            out_meta, out_arrays = fn(self._state, meta, arrays)
            return wire.encode_chunks(out_meta, out_arrays, self._server.chunk_bytes)
        except (ValueError, TypeError) as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {err}")
        except KeyError as err:
            if isinstance(err, UnknownVariableError):  # lets clients tell "lost variable" from other NOT_FOUNDs
                context.set_trailing_metadata(((ERROR_REASON_KEY, UNKNOWN_VARIABLE),))
            context.abort(grpc.StatusCode.NOT_FOUND, f"{name}: {err}")
        except Exception as err:  # noqa: BLE001 - never let a method take the server down
            log.exception("method %s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"{name}: {type(err).__name__}: {err}")

    def _invoke(self, name: str, fn: Method, requests, context: _Context):
        yield from self._run(name, fn, requests, context)

    def _invoke_unary(self, name: str, fn: Method, request: bytes, context: _Context) -> bytes:
        chunks = self._run(name, fn, (request,), context)
        if len(chunks) == 1:
            return chunks[0]
        # the method ran (it may not be idempotent: never ask the client to call it again); hand the answer
        # over in chunks through Collect
        answer_id = self.parked.park(chunks)
        context.set_trailing_metadata(((ERROR_REASON_KEY, ANSWER_PARKED), (ANSWER_ID_KEY, answer_id)))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"{name}: the answer has {len(chunks)} chunks; collect it streamed with id {answer_id}")

    def _collect(self, requests, context: _Context):
        try:
            meta, _ = wire.decode_chunks(requests)
        except wire.WireError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{COLLECT}: {err}")
        answer_id = meta.get("id")
        if not isinstance(answer_id, str):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{COLLECT}: field 'id' must be the string a unary call's trailing metadata "
                          f"'{ANSWER_ID_KEY}' named, got {answer_id!r}")
        chunks = self.parked.take(answer_id)
        if chunks is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"{COLLECT}: no parked answer {answer_id!r} (collected "
                          f"already, or older than {PARKED_TTL_S:.0f} s)")
        yield from chunks


class Server:
    """``Server(cluster_spec, job_name, task_index)``: the gRPC server of one ps or worker task.

    ``token`` defaults to the job token from the environment; a server without one refuses to start unless
    ``allow_insecure=True``. ``tls`` (default: the environment's, :func:`~kubeps.runtime.rpc.tls.load_tls`) makes it
    serve mutual TLS only: no plaintext port, client certificates of the job's CA required.
    ``start=True`` (TF's default) starts it at once.
    """

    def __init__(self, cluster_spec: ClusterSpec | Mapping[str, Any], job_name: str, task_index: int = 0, *,
                 start: bool = True, token: str | None = None, allow_insecure: bool = False,
                 bind_host: str | None = None, max_workers: int | None = None, rpc_timeout: float = 30.0,
                 chunk_bytes: int | None = None, tls: TLSConfig | None = None):
        try:
            self.cluster_spec = ClusterSpec(cluster_spec)
        except TFConfigError as err:
            raise RuntimeConfigError("cluster_spec", cluster_spec, str(err)) from None
        if job_name not in ("ps", "worker"):
            raise RuntimeConfigError("job_name", job_name, "a kubeps Server runs a 'ps' or a 'worker' task "
                                     "(the chief runs the coordinator, the evaluator runs user code)")
        count = self.cluster_spec.num_tasks(job_name)
        if not isinstance(task_index, int) or isinstance(task_index, bool) or not 0 <= task_index < count:
            raise RuntimeConfigError("task_index", task_index,
                                     f"the cluster has {count} '{job_name}' task(s), so the index must be in 0..{count - 1}"
                                     if count else f"the cluster spec has no '{job_name}' job")
        self.job_name = job_name
        self.task_index = task_index
        self.address = self.cluster_spec.task_address(job_name, task_index)
        self.port = parse_address(self.address)[1]
        self._token = require_job_token(token if token is not None else load_job_token(), allow_insecure)
        self.tls = tls if tls is not None else load_tls()
        self.bind_host = bind_host or os.environ.get(BIND_HOST_ENV) or None
        self.chunk_bytes = chunk_bytes or int(os.environ.get(CHUNK_BYTES_ENV) or wire.DEFAULT_CHUNK_BYTES)
        if job_name == "ps":
            self.state: Any = ParameterServerState()
            service, table = PS_SERVICE, PS_METHODS
        else:
            ps = self.cluster_spec.job_tasks("ps") if "ps" in self.cluster_spec.jobs else []
            self.state = WorkerState(task_index, ps, self._token, rpc_timeout, tls=self.tls)
            service, table = WORKER_SERVICE, WORKER_METHODS
        #: random per process start (the state's): a restarted task answers Ping with a new one
        self.incarnation: str = self.state.incarnation
        self._handler = _ServiceHandler(service, table, self.state, self)
        self._max_workers = max_workers or (32 if job_name == "ps" else 8)
        self._server: grpc.Server | None = None
        self._stopped = threading.Event()
        if start:
            self.start()

    @property
    def target(self) -> str:
        """``grpc://host:port`` of this task, as TF's ``Server.target``."""
        return f"grpc://{self.address}"

    def start(self) -> None:
        if self._server is not None:
            return
        limit_math_threads()  # size BLAS/OpenMP pools to this task's CPUs before the first update runs
        size_cpu_backend_if_loaded()  # and XLA's, where the program imported jax
        load_extensions()  # KUBEPS_SERVER_EXTENSIONS: a plain Server(...).join() serves the user's methods too
        server = grpc.server(
            ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix=f"kubeps-{self.job_name}"),
            handlers=[self._handler],
            interceptors=[TokenInterceptor(self._token)],
            options=CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)],
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
        self._server = server
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
        if self._server is not None:
            self._server.stop(grace).wait()
        close = getattr(self.state, "close", None)
        if close:
            close()
        self._stopped.set()


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:  # noqa: ARG001
    """Entry point of ``python -m kubeps.runtime.server``: serve this task of TF_CONFIG until signalled."""
    logging.basicConfig(level=os.environ.get(LOG_LEVEL_ENV, "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    env = os.environ if environ is None else environ
    try:
        load_extensions(env)
        config = TFConfig.from_env(env)
        if config.task is None or not config.cluster:
            raise TFConfigError("TF_CONFIG", env.get("TF_CONFIG"),
                                "must name a cluster and a task, e.g. {\"cluster\": {...}, \"task\": {\"type\": \"ps\", \"index\": 0}}")
        if config.task_type not in ("ps", "worker"):
            raise TFConfigError("task.type", config.task_type,
                                "python -m kubeps.runtime.server runs 'ps' and 'worker' tasks; the chief and the "
                                "evaluator run the user's program")
        server = Server(ClusterSpec(config.cluster), config.task_type, config.task.index, start=False)
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
