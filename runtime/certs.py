"""A job's certificates: one certificate authority per job and the certificate its tasks serve and dial with.

One definition, used by both halves: the operator issues them into the job's Secret, ``kubeps local`` into a
throw-away directory. Every task of a job holds the same key pair (as it holds the same job token); the CA exists
for that job alone, so a certificate it signed proves "a task of this job" and nothing else.

* The CA: ECDSA P-256, ``BasicConstraints(ca=True, path_length=0)``, signing certificates only.
* The task certificate: ECDSA P-256, extended key usage server *and* client (every task is both), subject
  alternative names = the hosts the tasks are dialed by (``<job>-<type>-<index>.<namespace>.svc`` and its
  cluster-domain form in Kubernetes; ``127.0.0.1`` and ``localhost`` locally). gRPC checks the dialed host
  against them.
* Validity: :data:`VALIDITY_DAYS` (a job outlives no year; a lost Secret gets a new CA and new certificates).

Pure functions of their arguments and the clock: no files, no environment (the caller writes the PEM bytes).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from typing import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CA_CERT_KEY",
    "CA_KEY_KEY",
    "TLS_CERT_KEY",
    "TLS_KEY_KEY",
    "VALIDITY_DAYS",
    "JobCredentials",
    "issue_job_credentials",
    "issue_task_certificate",
]

#: Names of the PEM files (and of the job Secret's keys; ``ca.key`` is never mounted into a pod).
CA_CERT_KEY = "ca.crt"
CA_KEY_KEY = "ca.key"
TLS_CERT_KEY = "tls.crt"
TLS_KEY_KEY = "tls.key"

#: How long the CA and the task certificate are valid (days).
VALIDITY_DAYS = 365
#: Backdating of ``notBefore`` (clock skew between the issuer and the tasks).
_SKEW = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class JobCredentials:
    """PEM bytes: the job's CA (certificate and key) and the task certificate and key it signed."""

    ca_cert: bytes
    ca_key: bytes
    cert: bytes
    key: bytes

    def files(self) -> dict[str, bytes]:
        """File (or Secret key) name -> PEM bytes."""
        return {CA_CERT_KEY: self.ca_cert, CA_KEY_KEY: self.ca_key, TLS_CERT_KEY: self.cert, TLS_KEY_KEY: self.key}


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for host in hosts:
        host = host.strip().strip("[]")
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    if not names:
        raise ValueError("hosts: a task certificate needs at least one host name or IP address, got none")
    return x509.SubjectAlternativeName(names)


def issue_task_certificate(ca_cert_pem: bytes, ca_key_pem: bytes, hosts: Sequence[str], common_name: str,
                           now: datetime.datetime | None = None) -> tuple[bytes, bytes]:
    """A new task certificate and key (PEM) for ``hosts``, signed by the given CA."""
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{CA_KEY_KEY}: the job CA's key must be an EC key, got {type(ca_key).__name__}")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(min(now + datetime.timedelta(days=VALIDITY_DAYS), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue_job_credentials(job: str, hosts: Sequence[str], now: datetime.datetime | None = None) -> JobCredentials:
    """A new CA for job ``job`` and the task certificate for ``hosts`` it signed."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kubeps"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"kubeps job CA {job}"[:64])])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + datetime.timedelta(days=VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_cert_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    ca_key_pem = _pem_key(ca_key)
    cert, key = issue_task_certificate(ca_cert_pem, ca_key_pem, hosts, f"kubeps job {job}", now)
    return JobCredentials(ca_cert_pem, ca_key_pem, cert, key)
