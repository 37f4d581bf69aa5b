"""The runtime's Prometheus metrics: every task serves them on ``/metrics`` at its settings' ``metrics_port``.

A task records metrics only once :func:`serve` started its endpoint (``KUBEPS_METRICS_PORT`` set: the operator
sets it on every pod, ``kubeps local`` gives every task a free port); before that, and in a program that never
serves, :data:`ENABLED` is False and every recording site skips its update with one global read, so metrics
cost nothing when off.

What the hot path pays when on: one counter or histogram update per *call* (an RPC, a closure, a batch), never per
row, on label children bound once per ``(method, peer)`` (:func:`client_call`). What a ps or the coordinator
counts anyway (rows and bytes per variable, the closure queue's transitions, the dynamic tables' counters) is read
only when Prometheus scrapes, by collectors the owners register with :func:`add_collector`.

Beside ``/metrics``, the endpoint serves the documents its owners register with :func:`add_document` (a path, a
function that renders the document as JSON): the chief serves its membership acknowledgement there
(:data:`kubeps.runtime.contract.MEMBERSHIP_ACK_PATH`), the typed answer another component acts on. A registered path
nobody serves any more answers 404; every other path answers the metrics, as ``prometheus_client``'s own server.

Names follow Prometheus' conventions: the ``kubeps_`` prefix, base units (seconds, bytes), ``_total`` on counters.
docs/observability.md lists every metric; a test checks that list against a live scrape.
"""

from __future__ import annotations

import logging
import socket
import threading
from http.server import ThreadingHTTPServer
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from kubeps.runtime.settings import TaskSettings

__all__ = [
    "ENABLED",
    "CallMetrics",
    "add_collector",
    "add_document",
    "remove_collector",
    "remove_document",
    "client_call",
    "enable",
    "serve",
    "served_port",
]

log = logging.getLogger("kubeps.runtime.observe.metrics")

#: whether this process records metrics (:func:`serve` or :func:`enable` turn it on); read by every recording site
ENABLED = False

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# -- RPCs, seen by the caller (per method and per peer task: a ps's address, a worker's) ----------------------------
RPC_CLIENT_CALLS = Counter("kubeps_rpc_client_calls_total", "RPCs made, by method and peer task address",
                           ["method", "peer"])
RPC_CLIENT_ERRORS = Counter("kubeps_rpc_client_errors_total", "RPCs that failed, by method, peer and gRPC code",
                            ["method", "peer", "code"])
RPC_CLIENT_SENT = Counter("kubeps_rpc_client_sent_bytes_total", "Request bytes sent (wire frames)",
                          ["method", "peer"])
RPC_CLIENT_RECEIVED = Counter("kubeps_rpc_client_received_bytes_total", "Answer bytes received (wire frames)",
                              ["method", "peer"])
RPC_CLIENT_SECONDS = Histogram("kubeps_rpc_client_duration_seconds", "From sending a request to its decoded answer",
                               ["method", "peer"], buckets=_LATENCY_BUCKETS)
# -- RPCs, seen by the server (a ps or a worker) ----------------------------------------------------------------------
RPC_SERVER_CALLS = Counter("kubeps_rpc_server_calls_total", "RPCs served, by method", ["method"])
RPC_SERVER_SENT = Counter("kubeps_rpc_server_sent_bytes_total", "Answer bytes sent, by method", ["method"])
RPC_SERVER_SECONDS = Histogram("kubeps_rpc_server_duration_seconds",
                               "From a request's first chunk to its encoded answer, by method", ["method"],
                               buckets=_LATENCY_BUCKETS)
# -- the coordinator (the chief) ---------------------------------------------------------------------------------------
CLOSURE_SECONDS = Histogram("kubeps_closure_duration_seconds",
                            "Time a worker took to run one scheduled function (steps_per_execution steps), by worker",
                            ["worker"], buckets=_STEP_BUCKETS)
TRAIN_STEP = Gauge("kubeps_train_step", "The training step the chief last reported")
TRAIN_EXAMPLES = Counter("kubeps_train_examples_total", "Examples trained on, as the chief reported them")
TRAIN_STEPS = Counter("kubeps_train_steps_total", "Training steps, as the chief reported them")
# -- a worker's input ----------------------------------------------------------------------------------------------------
INPUT_WAIT = Histogram("kubeps_worker_input_wait_seconds",
                       "Time a step waited for its batch (one next() on a per-worker iterator)",
                       buckets=_LATENCY_BUCKETS)
WORKER_BATCHES = Counter("kubeps_worker_batches_total", "Batches a worker's per-worker iterators handed out")
WORKER_EXAMPLES = Counter("kubeps_worker_examples_total",
                          "Examples in those batches (the leading dimension of the batch's first tensor)")
# -- checkpoints -----------------------------------------------------------------------------------------------------------
CHECKPOINT_SECONDS = Histogram("kubeps_checkpoint_duration_seconds", "Time to write or read one checkpoint",
                               ["operation"], buckets=_CHECKPOINT_BUCKETS)
CHECKPOINT_BYTES = Counter("kubeps_checkpoint_bytes_total",
                           "Bytes of variables and slots in the checkpoints written or read", ["operation"])
CHECKPOINT_STEP = Gauge("kubeps_checkpoint_step", "The training step of the last checkpoint this task wrote")
# -- hot parameter servers (the chief's detector, kubeps.runtime.coordinator.hotspots) ---------------------------------
PS_TRAFFIC_SHARE = Gauge("kubeps_ps_traffic_share",
                         "Each ps's share of the bytes read and pushed in the detector's last window", ["ps"])
PS_IMBALANCE_RATIO = Gauge("kubeps_ps_imbalance_ratio",
                           "The busiest ps's traffic over the mean of the others' in the detector's last window")
PS_IMBALANCED = Gauge("kubeps_ps_imbalanced",
                      "1 while one ps serves more than the threshold times the others' mean: the ps, its busiest "
                      "variable shard", ["ps", "variable"])

_lock = threading.Lock()
_served_port: int | None = None
#: the documents served beside the metrics, by path: a function rendering each as JSON (None: served no more, 404)
_documents: dict[str, Callable[[], str] | None] = {}


class _Handler(MetricsHandler):
    """``/metrics`` (any path but a document's) as ``prometheus_client`` serves it; a document's path, its JSON."""

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path not in _documents:
            super().do_GET()
            return
        render = _documents.get(path)
        try:
            body, status = (render().encode(), 200) if render is not None else (b"not served here\n", 404)
        except Exception:  # noqa: BLE001 - the owner's failure is the answer's, never the server thread's
            log.exception("metrics: rendering %s failed", path)
            body, status = b"rendering failed\n", 500
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if status == 200 else "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def add_document(path: str, render: Callable[[], str]) -> None:
    """Serve ``render()`` (JSON text, rendered at each request) at ``path`` beside the metrics."""
    _documents[path] = render


def remove_document(path: str, render: Callable[[], str] | None = None) -> None:
    """Serve nothing at ``path`` any more (404); with ``render``, only if that is what ``path`` serves."""
    if render is None or _documents.get(path) == render:
        _documents[path] = None


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _start_server(port: int, addr: str) -> None:
    server = (_Server6 if ":" in addr else ThreadingHTTPServer)((addr, port), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kubeps-metrics-http", daemon=True).start()


def enable() -> None:
    """Record metrics in this process (:func:`serve` does it; tests that read the registry directly too)."""
    global ENABLED
    ENABLED = True


def serve(settings: TaskSettings) -> int | None:
    """Serve the metrics on ``settings.metrics_port`` (every interface, or the settings' bind host) and start
    recording; a second call is a no-op. Returns the port, or None when the settings name none (nothing recorded).

    A port that cannot be bound is logged and metrics stay off: training never fails for want of metrics."""
    global _served_port
    if settings.metrics_port is None:
        return None
    with _lock:
        if _served_port is not None:
            return _served_port
        try:
            _start_server(settings.metrics_port, settings.bind_host or "0.0.0.0")
        except OSError as err:
            log.warning("metrics: cannot serve on port %d (%s); this task records no metrics",
                        settings.metrics_port, err)
            return None
        _served_port = settings.metrics_port
        disable_created_metrics()  # no ``*_created`` series beside every counter: a third of a scrape, unread
        enable()
        log.info("serving Prometheus metrics on port %d (/metrics)", settings.metrics_port)
        return _served_port


def served_port() -> int | None:
    """The port :func:`serve` serves on, None before."""
    return _served_port


class _Collector(Collector):
    def __init__(self, collect: Callable[[], Iterable[Any]]):
        self._collect = collect

    def collect(self) -> Iterable[Any]:
        try:
            yield from self._collect()
        except Exception:  # noqa: BLE001 - a scrape never fails for one owner's counters
            log.exception("metrics: a collector failed")

    def describe(self) -> Iterable[Any]:
        return []  # unchecked: families are built per scrape


def add_collector(collect: Callable[[], Iterable[Any]]) -> Collector:
    """Register ``collect`` (yields ``prometheus_client.core`` metric families) to run at every scrape; returns the
    registered collector (``REGISTRY.unregister`` it when its owner goes away)."""
    collector = _Collector(collect)
    REGISTRY.register(collector)
    return collector


def remove_collector(collector: Collector) -> None:
    """Stop running a collector :func:`add_collector` registered (its owner went away)."""
    try:
        REGISTRY.unregister(collector)
    except KeyError:
        pass


class CallMetrics:
    """The metric children of one ``(method, peer)`` of an RPC client, bound once and updated per call."""

    __slots__ = ("method", "peer", "calls", "sent", "received", "seconds")

    def __init__(self, method: str, peer: str):
        self.method, self.peer = method, peer
        self.calls = RPC_CLIENT_CALLS.labels(method, peer)
        self.sent = RPC_CLIENT_SENT.labels(method, peer)
        self.received = RPC_CLIENT_RECEIVED.labels(method, peer)
        self.seconds = RPC_CLIENT_SECONDS.labels(method, peer)

    def observe(self, seconds: float, sent: int, received: int) -> None:
        self.calls.inc()
        self.sent.inc(sent)
        self.received.inc(received)
        self.seconds.observe(seconds)

    def failed(self, seconds: float, sent: int, code: str) -> None:
        self.calls.inc()
        self.sent.inc(sent)
        self.seconds.observe(seconds)
        RPC_CLIENT_ERRORS.labels(self.method, self.peer, code).inc()


def client_call(cache: dict[str, CallMetrics], method: str, peer: str) -> CallMetrics:
    """The bound children of ``method`` to ``peer``, from ``cache`` (one per client) or made once."""
    found = cache.get(method)
    if found is None:
        found = cache[method] = CallMetrics(method, peer)
    return found
