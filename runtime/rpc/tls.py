"""Mutual TLS between the tasks of a job: what a server serves and a client dials with.

The token (:mod:`kubeps.runtime.rpc.security`) says who may call; TLS keeps what travels (weights, gradients, the
closures sent to workers) private and proves both ends belong to the job: every task presents the job's
certificate, and every peer's must chain to the job's CA. A server given :class:`TLSConfig` listens with
``grpc.ssl_server_credentials(..., require_client_auth=True)`` and nothing else, so a plaintext connection or one
without a certificate of the job's CA fails the handshake before any RPC; a client dials with
``grpc.ssl_channel_credentials(ca, key, chain)``, which checks the server's certificate names the host dialed.

The files come from :data:`~kubeps.runtime.contract.TLS_CA_FILE_ENV`, :data:`~kubeps.runtime.contract.TLS_CERT_FILE_ENV`
and :data:`~kubeps.runtime.contract.TLS_KEY_FILE_ENV` (mounted from the job's Secret by the operator, written to a
throw-away directory by ``kubeps local``). None set: plaintext; some but not all set: an error naming the missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kubeps.runtime.contract import TLS_CA_FILE_ENV, TLS_CERT_FILE_ENV, TLS_KEY_FILE_ENV
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.settings import TaskSettings

__all__ = ["TLS_ENV_VARS", "TLSConfig", "load_tls"]

TLS_ENV_VARS = (TLS_CA_FILE_ENV, TLS_CERT_FILE_ENV, TLS_KEY_FILE_ENV)


@dataclass(frozen=True, repr=False)
class TLSConfig:
    """PEM bytes: the job CA's certificate, this task's certificate chain and its private key."""

    ca: bytes
    cert: bytes
    key: bytes

    def __repr__(self) -> str:  # never print a key
        return "TLSConfig(<job CA>, <certificate>, <key>)"

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve TLS only, and only to clients presenting a certificate of the job's CA."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Dial TLS, trusting only the job's CA, presenting this task's certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    @classmethod
    def from_files(cls, ca: str, cert: str, key: str) -> "TLSConfig":
        return cls(_read(TLS_CA_FILE_ENV, ca), _read(TLS_CERT_FILE_ENV, cert), _read(TLS_KEY_FILE_ENV, key))


def _read(field: str, path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as err:
        raise RuntimeConfigError(field, path, f"must name a readable PEM file ({err.strerror})") from None
    if b"-----BEGIN " not in data:
        raise RuntimeConfigError(field, path, "must hold PEM text (-----BEGIN ...-----); the file holds none")
    return data


def load_tls(settings: TaskSettings) -> TLSConfig | None:
    """The task's TLS files named by its settings (passed down by the ``Server`` or ``ParameterServerStrategy``
    that read them), or None (plaintext) when none of the three is set."""
    paths = dict(zip(TLS_ENV_VARS, (settings.tls_ca_file or "", settings.tls_cert_file or "",
                                    settings.tls_key_file or "")))
    given = [name for name, path in paths.items() if path]
    if not given:
        return None
    missing = [name for name in TLS_ENV_VARS if name not in given]
    if missing:
        raise RuntimeConfigError(missing[0], None, f"mutual TLS needs all of {', '.join(TLS_ENV_VARS)}; "
                                 f"{', '.join(given)} set but {', '.join(missing)} not (unset all three for "
                                 "plaintext)")
    ca, cert, key = paths.values()
    return TLSConfig.from_files(ca, cert, key)
