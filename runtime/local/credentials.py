"""The TLS files a local job's tasks are told: a throw-away CA and the tasks' certificate, made for one run.

The CA and the certificate (for the job's host and ``localhost``) are written to a new private directory (mode
0700), which the cluster removes when it stops; the CA's key is never written. A job without TLS
(``--insecure-plaintext``) is told no files; TLS files the user's settings name (``KUBEPS_TLS_*_FILE``) are used as
they are.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from kubeps.runtime import certs
from kubeps.runtime.local.spec import LocalJobSpec

__all__ = ["tls_settings", "throwaway_credentials"]


def throwaway_credentials(host: str) -> tuple[str, dict[str, str]]:
    """Make a CA and the tasks' certificate for ``host`` in a new private directory: the directory, and the
    settings' fields (``tls_*_file``) naming the files."""
    directory = tempfile.mkdtemp(prefix="kubeps-tls-")  # mode 0700
    try:
        made = certs.issue_job_credentials("local", [host, "localhost"])
        files = {"tls_ca_file": (certs.CA_CERT_KEY, made.ca_cert), "tls_cert_file": (certs.TLS_CERT_KEY, made.cert),
                 "tls_key_file": (certs.TLS_KEY_KEY, made.key)}
        paths = {}
        for field, (filename, data) in files.items():
            path = os.path.join(directory, filename)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            paths[field] = path
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, paths


def tls_settings(spec: LocalJobSpec) -> tuple[str | None, dict[str, str | None]]:
    """The directory made for this run (None: none was made; the caller removes it) and the settings' TLS fields
    the tasks are told (none: the user's own stand)."""
    given = spec.settings
    if not spec.tls:
        return None, {"tls_ca_file": None, "tls_cert_file": None, "tls_key_file": None}
    if given.tls_ca_file or given.tls_cert_file or given.tls_key_file:
        return None, {}
    directory, files = throwaway_credentials(spec.host)
    return directory, dict(files)
