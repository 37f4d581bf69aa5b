"""The pod contract: what the operator, ``kubeps local`` and the runtime's processes agree on about a task.

One definition, imported by both halves (the operator may import this module and :mod:`kubeps.runtime.cluster`,
nothing else of the runtime): the version of kubeps (:data:`VERSION`), the environment variables a task reads, the exit status of a chief that lost a
parameter server, and which exit statuses are retried.

Exit statuses (the same in Kubernetes and locally, as Kubeflow's training operators define them):

- 0 ends the task successfully; the chief exiting 0 ends the job;
- 1-127 are permanent failures (a bug, a bad argument): retrying cannot help;
- 128-255 are retryable: killed by a signal (137 OOM or SIGKILL, 143 SIGTERM) or :data:`EXIT_PS_UNAVAILABLE`.

>>> is_retryable_exit(EXIT_PS_UNAVAILABLE), is_retryable_exit(1), is_retryable_exit(137)
(True, False, True)

This module is pure data and one function: no I/O, no third-party import.
"""

from __future__ import annotations

__all__ = [
    "VERSION",
    "BIND_HOST_ENV",
    "CHECKPOINT_DIR_ENV",
    "CHECKPOINT_ROOT_ENV",
    "CHUNK_BYTES_ENV",
    "CPUS_ENV",
    "DEVICE_ENV",
    "GPU_TASKS_ENV",
    "EXIT_PS_UNAVAILABLE",
    "FIRST_RETRYABLE_EXIT",
    "JOB_TOKEN_ENV",
    "JOB_TOKEN_FILE_ENV",
    "HOTSPOT_INTERVAL_ENV",
    "LOGDIR_ENV",
    "LOG_FORMAT_ENV",
    "LOG_LEVEL_ENV",
    "MAX_ANSWER_BYTES_ENV",
    "MAX_BLOOM_COUNTERS_ENV",
    "MAX_CALLS_PER_CLIENT_ENV",
    "MAX_CLIENT_ANSWER_BYTES_ENV",
    "MAX_HEADER_BYTES_ENV",
    "MAX_TENSORS_ENV",
    "MAX_PARKED_BYTES_ENV",
    "MAX_READ_IDS_ENV",
    "MAX_REQUEST_BYTES_ENV",
    "MAX_SLOT_SETS_ENV",
    "MAX_TABLES_ENV",
    "MAX_TABLE_DIM_ENV",
    "MAX_VARIABLES_ENV",
    "MEMBERSHIP_ACK_FILE_ENV",
    "MEMBERSHIP_ACK_PATH",
    "MEMBERSHIP_FILE_ENV",
    "MIN_REQUEST_RATE_ENV",
    "METRICS_PORT_ENV",
    "NONFINITE_GRADIENTS_ENV",
    "PARKED_ANSWER_TTL_ENV",
    "PS_PROCESSES_ENV",
    "PS_TASK_PID_ENV",
    "REQUEST_TIMEOUT_ENV",
    "SERVER_EXTENSIONS_ENV",
    "STREAM_IDLE_TIMEOUT_ENV",
    "TF_CONFIG_ENV",
    "TLS_CA_FILE_ENV",
    "TLS_CERT_FILE_ENV",
    "TLS_KEY_FILE_ENV",
    "TLS_MOUNT_PATH",
    "is_retryable_exit",
]

#: the cluster and this task's place in it, as TensorFlow defines it (:mod:`kubeps.runtime.cluster` parses it)
TF_CONFIG_ENV = "TF_CONFIG"

#: the job's shared secret; every RPC carries it (the operator injects it from the job's Secret)
JOB_TOKEN_ENV = "KUBEPS_JOB_TOKEN"

#: a file holding the job token, read when :data:`JOB_TOKEN_ENV` is unset (``kubeps local`` writes one)
JOB_TOKEN_FILE_ENV = "KUBEPS_JOB_TOKEN_FILE"

#: mutual TLS between the tasks: the job CA's certificate (PEM), which every peer's certificate must chain to
TLS_CA_FILE_ENV = "KUBEPS_TLS_CA_FILE"

#: mutual TLS: the certificate chain (PEM) a task serves and dials with
TLS_CERT_FILE_ENV = "KUBEPS_TLS_CERT_FILE"

#: mutual TLS: the private key (PEM) of :data:`TLS_CERT_FILE_ENV`. All three set: every server requires TLS with a
#: client certificate and every client dials TLS; none set: plaintext (the operator and ``kubeps local`` set them
#: unless TLS was turned off explicitly)
TLS_KEY_FILE_ENV = "KUBEPS_TLS_KEY_FILE"

#: where the operator mounts the job Secret's ``ca.crt``, ``tls.crt`` and ``tls.key`` in every container
TLS_MOUNT_PATH = "/var/run/kubeps/tls"

#: the address a ps or worker server binds to (default: all interfaces; ``kubeps local`` uses 127.0.0.1)
BIND_HOST_ENV = "KUBEPS_BIND_HOST"

#: the CPUs a task may use (a positive integer); sizes its math thread pools (:mod:`kubeps.runtime.util.threads`)
CPUS_ENV = "KUBEPS_CPUS"

#: server processes per ps task (a positive integer, the same in every task of the job): a ps task then serves on
#: its port and the next ones, each process a ps of its own to the chief and the workers
#: (:meth:`kubeps.runtime.cluster.TFConfig.with_ps_processes`); ``kubeps local`` and the operator size it
PS_PROCESSES_ENV = "KUBEPS_PS_PROCESSES"

#: set by a ps task of several processes on the server processes it starts: the pid of the task's own process,
#: which each of them ends with (``PR_SET_PDEATHSIG``, set by the process itself; not for users to set)
PS_TASK_PID_ENV = "KUBEPS_PS_TASK_PID"

#: ``cpu`` or ``gpu``: where a task's array kernels run (:mod:`kubeps.runtime.ops.kernels`)
DEVICE_ENV = "KUBEPS_DEVICE"

#: how many GPU tasks share one GPU (a positive integer, default 1): each task's memory share is 0.9 / that
GPU_TASKS_ENV = "KUBEPS_GPU_TASKS"

#: the size of the chunks a server streams large answers in (bytes)
CHUNK_BYTES_ENV = "KUBEPS_CHUNK_BYTES"

#: the log level of a ps or worker server (``INFO`` by default)
LOG_LEVEL_ENV = "KUBEPS_LOG_LEVEL"

#: where TensorBoard event files go: the job's log dir; the chief writes ``train/``, the evaluator ``eval/`` under it
#: (a mounted volume's path, or an ``s3://``/``gs://`` URL; :mod:`kubeps.runtime.observe.summary`)
LOGDIR_ENV = "KUBEPS_LOGDIR"

#: the TCP port a task serves its Prometheus metrics on (``/metrics``; :mod:`kubeps.runtime.observe.metrics`);
#: unset: the task neither serves nor records metrics. The operator names it ``metrics`` on the pod
METRICS_PORT_ENV = "KUBEPS_METRICS_PORT"

#: seconds between two looks of the chief's hot-ps detector at the ps' traffic (default 10;
#: :mod:`kubeps.runtime.coordinator.hotspots`)
HOTSPOT_INTERVAL_ENV = "KUBEPS_HOTSPOT_INTERVAL_S"

#: ``text`` (the default) or ``json``: one JSON object per log line, with the job, role, index and step fields
#: (:mod:`kubeps.runtime.observe.logs`)
LOG_FORMAT_ENV = "KUBEPS_LOG_FORMAT"

#: modules (comma-separated) a ps or worker server imports before it serves: the user's own methods
#: (:mod:`kubeps.runtime.server.methods`)
SERVER_EXTENSIONS_ENV = "KUBEPS_SERVER_EXTENSIONS"

#: the chief's membership document (:class:`kubeps.runtime.cluster.Membership`, JSON): the workers it dispatches to
#: now. Watched while the chief runs; the operator mounts the job's membership ConfigMap there, ``kubeps local``
#: writes a file of its own (docs/elastic.md). Unset: the workers of TF_CONFIG, for the whole run
MEMBERSHIP_FILE_ENV = "KUBEPS_MEMBERSHIP_FILE"

#: where the chief writes a :class:`kubeps.runtime.cluster.MembershipAck` after applying a membership document
#: (``kubeps local`` reads it to stop a drained worker); unset: nowhere
MEMBERSHIP_ACK_FILE_ENV = "KUBEPS_MEMBERSHIP_ACK_FILE"

#: the HTTP path, on the chief's metrics port, that serves its :class:`kubeps.runtime.cluster.MembershipAck` (JSON,
#: the same document as the ack file): what the operator reads to act on a membership change. Metrics are for
#: people and dashboards; no decision is taken on a metric's name
MEMBERSHIP_ACK_PATH = "/kubeps/membership"

# -- a server's limits (docs/runtime.md, "Limits"): what one peer may make a ps or worker hold --------------------
#: seconds a server waits for the next chunk of a request before it cancels the call (default 10)
STREAM_IDLE_TIMEOUT_ENV = "KUBEPS_STREAM_IDLE_TIMEOUT_S"

#: seconds a whole request may take to arrive, however steadily its chunks trickle in (default 120)
REQUEST_TIMEOUT_ENV = "KUBEPS_REQUEST_TIMEOUT_S"

#: calls one client (one job identity: the token, with the certificate under mutual TLS; a peer address on an insecure
#: server) may have in a server at once; a call past it evicts the call whose request arrives slowest, or is refused
#: with RESOURCE_EXHAUSTED before it holds a thread, and kubeps clients retry it (default: three quarters of the
#: server's handler threads)
MAX_CALLS_PER_CLIENT_ENV = "KUBEPS_MAX_CALLS_PER_CLIENT"

#: the largest request data section a server accepts, in bytes (default 1 GiB; methods without tensors take none)
MAX_REQUEST_BYTES_ENV = "KUBEPS_MAX_REQUEST_BYTES"

#: the largest answer a server builds, in bytes: a read that would answer more is refused (default 1 GiB)
MAX_ANSWER_BYTES_ENV = "KUBEPS_MAX_ANSWER_BYTES"

#: seconds a parked answer (too big for one message) waits for its client's Collect (default 30)
PARKED_ANSWER_TTL_ENV = "KUBEPS_PARKED_ANSWER_TTL_S"

#: the most bytes of parked answers a server holds; the oldest are dropped beyond it (default 2 GiB)
MAX_PARKED_BYTES_ENV = "KUBEPS_MAX_PARKED_BYTES"

#: how many slot sets (one per optimizer configuration) one variable may hold on a ps (default 8)
MAX_SLOT_SETS_ENV = "KUBEPS_MAX_SLOT_SETS"

#: the largest request header (the JSON before the tensors) a server parses, in bytes (default 1 MiB); a bigger one
#: is refused unparsed
MAX_HEADER_BYTES_ENV = "KUBEPS_MAX_HEADER_BYTES"

#: the most tensors one request may carry (each costs the server a header entry, a checked view and often a variable:
#: ~10 us of CPU); a request with more is refused before its header is checked
MAX_TENSORS_ENV = "KUBEPS_MAX_TENSORS"

#: the most variables one ps holds (default 100000); a ``CreateVariables`` that would pass it is refused
MAX_VARIABLES_ENV = "KUBEPS_MAX_VARIABLES"

#: the most dynamic tables one ps holds (default 1024); a ``CreateDynamic`` of one more is refused
MAX_TABLES_ENV = "KUBEPS_MAX_DYNAMIC_TABLES"

#: the widest row (``dim``) a dynamic table may have on a ps (default 16384)
MAX_TABLE_DIM_ENV = "KUBEPS_MAX_TABLE_DIM"

#: the most counters of a dynamic table's Bloom filter (2 bytes each) on a ps (default 2**24)
MAX_BLOOM_COUNTERS_ENV = "KUBEPS_MAX_BLOOM_COUNTERS"

#: the most row ids (or table keys) one call may read or look up on a ps, all its tensors together (default 2**20)
MAX_READ_IDS_ENV = "KUBEPS_MAX_READ_IDS"

#: the bytes of answers one client (one job identity) may have a ps build at once (default 256 MiB): a read that
#: would pass it while the client has another answer in flight is refused; alone, a call may build up to
#: :data:`MAX_ANSWER_BYTES_ENV`
MAX_CLIENT_ANSWER_BYTES_ENV = "KUBEPS_MAX_CLIENT_ANSWER_BYTES"

#: the slowest a request may arrive, in bytes per second after its first :data:`STREAM_IDLE_TIMEOUT_ENV` seconds
#: (default 65536): a stream trickling small chunks is cancelled even though each chunk comes in time
MIN_REQUEST_RATE_ENV = "KUBEPS_MIN_REQUEST_BYTES_PER_S"

#: ``refuse`` (default) or ``allow``: whether a ps applies gradients holding NaN or infinity
NONFINITE_GRADIENTS_ENV = "KUBEPS_NONFINITE_GRADIENTS"

#: where a ps may read and write checkpoint shards: a directory or URL (several separated by ``,``); a
#: ``SaveShards``/``RestoreShards`` naming anything else is refused. ``kubeps local`` and the operator set it;
#: unset, checkpoint paths are only normalised (no ``..``, no relative paths), not confined
CHECKPOINT_ROOT_ENV = "KUBEPS_CHECKPOINT_ROOT"

#: the checkpoint directory the examples default to (``--checkpoint-dir``); the operator adds it to a task's
#: :data:`CHECKPOINT_ROOT_ENV`
CHECKPOINT_DIR_ENV = "KUBEPS_CHECKPOINT_DIR"

#: The version of kubeps, the one source of it: the wheel's and the sdist's (pyproject.toml reads it), the images'
#: tag, the operator's default runtime image; the chart's ``version`` and ``appVersion`` must equal it
#: (tests/packaging/test_release.py). docs/releasing.md says how a release bumps it.
VERSION = "0.1.0"

#: Exit status of a chief that lost a parameter server: retryable (>= 128), and not a status the kernel gives a
#: crash kubeps can cause by itself (134 abort, 137 kill/OOM, 139 segfault, 143 term).
EXIT_PS_UNAVAILABLE = 133

#: the lowest retryable exit status (the statuses of signals start here)
FIRST_RETRYABLE_EXIT = 128


def is_retryable_exit(status: int) -> bool:
    """Exit statuses 128-255 (signals, :data:`EXIT_PS_UNAVAILABLE`) are retryable; 1-127 are permanent."""
    return FIRST_RETRYABLE_EXIT <= status <= 255
