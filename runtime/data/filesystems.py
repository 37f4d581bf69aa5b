"""Where input files live: local paths and fsspec URLs (``s3://``, ``gs://``, ``hdfs://``, ``memory://`` ...).

Every file reader of this package opens its files through :func:`open_binary`, and ``list_files`` expands a URL
pattern with :func:`glob_url`, so a dataset over ``s3://bucket/train/*.parquet`` is listed, sorted and sharded
between workers exactly as one over a local folder. URLs need the optional ``fsspec`` package and the backend of
their scheme (``s3fs`` for ``s3://``: the ``kubeps[s3]`` extra); credentials and endpoints come from the backend's
usual environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL`` ...) or from ``storage_options``.
"""

from __future__ import annotations

import os
import re
from typing import IO, Any

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL with a scheme other than ``file://`` (a plain path or ``file://`` is local)."""
    match = _SCHEME.match(path)
    return match is not None and match.group(1) != "file"


def local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def _filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    try:
        import fsspec  # noqa: PLC0415 - optional dependency, needed for URLs only
    except ImportError:
        raise ImportError(
            f"reading {url!r} needs the optional 'fsspec' package and the backend of its scheme "
            "(pip install 'kubeps[s3]' for s3://); plain paths need nothing"
        ) from None
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as err:
        raise ImportError(f"cannot read {url!r}: {err}") from None


def glob_url(pattern: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """The files (not folders) matching a URL pattern, as full URLs, sorted; ``[]`` when none match."""
    fs, path = _filesystem(pattern, storage_options)
    if any(c in path for c in "*?["):
        matches = fs.glob(path, detail=True)
    else:
        matches = {path: fs.info(path)} if fs.exists(path) else {}
    files = [name for name, info in matches.items() if info.get("type") != "directory"]
    return sorted(fs.unstrip_protocol(name) for name in files)


def open_binary(path: str, storage_options: dict[str, Any] | None = None) -> IO[bytes]:
    """``path`` opened for reading bytes: a local file, or the fsspec file of a URL."""
    if not is_url(path):
        return open(local_path(os.fspath(path)), "rb")
    fs, stripped = _filesystem(path, storage_options)
    return fs.open(stripped, "rb")
