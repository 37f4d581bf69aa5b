"""The pod contract: what the operator, ``kubeps local`` and the runtime's processes agree on about a task.

One definition, imported by both halves (the operator may import this module and :mod:`kubeps.runtime.cluster`,
nothing else of the runtime): the environment variables a task reads, the exit status of a chief that lost a
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
    "BIND_HOST_ENV",
    "CHUNK_BYTES_ENV",
    "CPUS_ENV",
    "DEVICE_ENV",
    "EXIT_PS_UNAVAILABLE",
    "FIRST_RETRYABLE_EXIT",
    "JOB_TOKEN_ENV",
    "JOB_TOKEN_FILE_ENV",
    "LOG_LEVEL_ENV",
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

#: ``cpu`` or ``gpu``: where a task's array kernels run (:mod:`kubeps.runtime.ops.kernels`)
DEVICE_ENV = "KUBEPS_DEVICE"

#: the size of the chunks a server streams large answers in (bytes)
CHUNK_BYTES_ENV = "KUBEPS_CHUNK_BYTES"

#: the log level of a ps or worker server (``INFO`` by default)
LOG_LEVEL_ENV = "KUBEPS_LOG_LEVEL"

#: Exit status of a chief that lost a parameter server: retryable (>= 128), and not a status the kernel gives a
#: crash kubeps can cause by itself (134 abort, 137 kill/OOM, 139 segfault, 143 term).
EXIT_PS_UNAVAILABLE = 133

#: the lowest retryable exit status (the statuses of signals start here)
FIRST_RETRYABLE_EXIT = 128


def is_retryable_exit(status: int) -> bool:
    """Exit statuses 128-255 (signals, :data:`EXIT_PS_UNAVAILABLE`) are retryable; 1-127 are permanent."""
    return FIRST_RETRYABLE_EXIT <= status <= 255
