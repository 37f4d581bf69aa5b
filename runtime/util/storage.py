"""Where checkpoints live: a tiny filesystem interface with a local and an fsspec-backed implementation.

Checkpoints are written by several processes at once (every parameter server writes its own shards, the
coordinator writes the manifest), to a local directory, a shared filesystem (a PVC in Kubernetes) or an object
store. Everything the checkpoint code needs from a filesystem is the handful of operations of :class:`Storage`.

- :class:`LocalStorage` is used for plain paths (and ``file://`` URLs). Atomic writes go to a temporary file in
  the same directory, are flushed and ``fsync``-ed, renamed over the target with :func:`os.replace`, and the
  directory is ``fsync``-ed, so after a crash the target holds either the old or the new content, never a part.
- :class:`FsspecStorage` is used when the path is a URL with another scheme (``s3://``, ``gs://``,
  ``memory://`` ...). It needs the optional ``fsspec`` package (the ``kubeps[fsspec]`` extra). Atomic writes go
  to a temporary name and are moved into place; on object stores an object only becomes visible once its upload
  completed, which gives the same guarantee for the manifest.

:func:`storage_for` picks the implementation from the path.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import shutil
import uuid
from typing import IO, Iterable, Iterator, Protocol

__all__ = ["FsspecStorage", "LocalStorage", "Storage", "StorageError", "checkpoint_roots", "confine", "normalize_path",
           "storage_for"]

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")


class StorageError(OSError):
    """A storage path cannot be used (unknown scheme, missing optional dependency)."""


class Storage(Protocol):
    """The filesystem operations checkpoints need. Paths are strings in the storage's own form."""

    def join(self, *parts: str) -> str: ...

    def exists(self, path: str) -> bool: ...

    def isdir(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries of a directory; ``[]`` when it does not exist."""

    def makedirs(self, path: str) -> None: ...

    def size(self, path: str) -> int: ...

    def open_read(self, path: str) -> IO[bytes]: ...

    def open_write_atomic(self, path: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A writable binary file that replaces ``path`` atomically when the block exits without error."""

    def write_bytes_atomic(self, path: str, data: bytes) -> None: ...

    def read_bytes(self, path: str) -> bytes: ...

    def remove(self, path: str) -> None: ...

    def remove_tree(self, path: str) -> None:
        """Delete a directory and everything under it; a missing directory is not an error."""


def _tmp_name(path: str) -> str:
    head, tail = posixpath.split(path) if "://" in path else os.path.split(path)
    name = f".{tail}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return posixpath.join(head, name) if "://" in path else os.path.join(head, name)


def is_temporary(name: str) -> bool:
    """Whether a directory entry is a temporary file left behind by an interrupted atomic write."""
    return name.startswith(".") and ".tmp-" in name


class LocalStorage:
    """Local or shared (NFS, PVC) filesystem, with fsync'ed atomic writes."""

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def open_read(self, path: str) -> IO[bytes]:
        return open(path, "rb")

    @contextlib.contextmanager
    def open_write_atomic(self, path: str) -> Iterator[IO[bytes]]:
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        tmp = _tmp_name(path)
        f = open(tmp, "wb")
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(tmp, path)
            _fsync_dir(directory)
        except BaseException:
            f.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        with self.open_write_atomic(path) as f:
            f.write(data)

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


class FsspecStorage:
    """Any fsspec filesystem (object stores, ``memory://``); paths are full URLs."""

    def __init__(self, url: str):
        try:
            import fsspec  # noqa: PLC0415 - optional dependency
        except ImportError:  # pragma: no cover - depends on the environment
            raise StorageError(
                f"checkpoint path {url!r} is a URL, which needs the optional 'fsspec' package "
                "(pip install 'kubeps[fsspec]'); plain paths need nothing"
            ) from None
        match = _SCHEME.match(url)
        if not match:
            raise StorageError(f"checkpoint path {url!r} is not a URL with a scheme (expected 'scheme://...')")
        self.protocol = match.group(1)
        try:
            self.fs, _ = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as err:
            raise StorageError(
                f"checkpoint URL scheme {self.protocol!r} of {url!r} cannot be used: {err}"
            ) from None

    def _p(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._p(path))

    def isdir(self, path: str) -> bool:
        return self.fs.isdir(self._p(path))

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(self._p(path), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(self._p(path), exist_ok=True)

    def size(self, path: str) -> int:
        return int(self.fs.size(self._p(path)))

    def open_read(self, path: str) -> IO[bytes]:
        return self.fs.open(self._p(path), "rb")

    @contextlib.contextmanager
    def open_write_atomic(self, path: str) -> Iterator[IO[bytes]]:
        target = self._p(path)
        tmp = self._p(_tmp_name(path))
        parent = posixpath.dirname(target)
        if parent:
            self.fs.makedirs(parent, exist_ok=True)
        f = self.fs.open(tmp, "wb")
        try:
            yield f
            f.close()
            self.fs.mv(tmp, target)
        except BaseException:
            with contextlib.suppress(Exception):
                f.close()
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        with self.open_write_atomic(path) as f:
            f.write(data)

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open(self._p(path), "rb") as f:
            return f.read()

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._p(path))

    def remove_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if self.fs.exists(self._p(path)):
                self.fs.rm(self._p(path), recursive=True)


_LOCAL = LocalStorage()


def storage_for(path: str) -> Storage:
    """The storage for ``path``: local for plain paths and ``file://``, fsspec for other URL schemes."""
    if not isinstance(path, (str, os.PathLike)):
        raise StorageError(f"checkpoint path must be a string or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not path:
        raise StorageError("checkpoint path is empty: give a directory or a URL such as 's3://bucket/run'")
    match = _SCHEME.match(path)
    if match is None or match.group(1) == "file":
        return _LOCAL
    return FsspecStorage(path)


def normalize_path(path: str | os.PathLike) -> str:
    """The one form of a checkpoint path, the same on the chief and on a parameter server.

    ``file:///abs`` becomes ``/abs``; a local path becomes absolute with ``.`` and ``..`` resolved (against this
    process's working directory); a URL keeps its scheme (lower case) and loses repeated and trailing slashes.
    Refused (:class:`StorageError`): ``file:`` in any other form (``file:x``, ``file://host/x`` -- today's literal
    ``file:`` folder), and ``..`` in a URL (object stores do not resolve it)."""
    path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise StorageError(f"checkpoint path must be a non-empty string, got {path!r}")
    if "\0" in path:
        raise StorageError(f"checkpoint path {path!r} holds a NUL character")
    if path.startswith("file:"):
        if not path.startswith("file:///"):
            raise StorageError(f"checkpoint path {path!r}: a file URL must be 'file:///<absolute path>'")
        path = path[len("file://"):]
    match = _SCHEME.match(path)
    if match is None:
        return os.path.abspath(path)
    scheme, rest = match.group(1).lower(), path[match.end():]
    parts = [p for p in rest.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise StorageError(f"checkpoint URL {path!r} holds a '.' or '..' component; give the URL without them")
    if not parts:
        raise StorageError(f"checkpoint URL {path!r} names no bucket or path")
    return f"{scheme}://{'/'.join(parts)}"


def checkpoint_roots(roots: Iterable[str]) -> list[str]:
    """The roots of ``KUBEPS_CHECKPOINT_ROOT`` (directories or URLs, as the task's settings split them),
    normalised; ``[]`` if none."""
    return [normalize_path(r.strip()) for r in roots if r.strip()]


def confine(path: str, roots: list[str], field: str = "directory") -> str:
    """``path`` normalised, if it lies inside one of ``roots`` (a local path after resolving symlinks too);
    else :class:`StorageError`. The message is the same whether or not anything exists at ``path``.

    A ps confines the paths it is asked to write and read. Without roots (``KUBEPS_CHECKPOINT_ROOT`` unset) a path
    is only normalised and must be absolute (a relative one would depend on the ps's working directory)."""
    raw = path
    if not isinstance(raw, str) or not raw:
        raise StorageError(f"field '{field}' has value {raw!r}: a checkpoint directory path or URL is required")
    if raw.startswith("file:") and not raw.startswith("file:///"):
        raise StorageError(f"field '{field}' has value {raw!r}: a file URL must be 'file:///<absolute path>'")
    local = _SCHEME.match(raw) is None or raw.startswith("file:")
    bare = raw[len("file://"):] if raw.startswith("file:") else raw
    if local and (not os.path.isabs(bare) or ".." in bare.split("/")):
        raise StorageError(f"field '{field}' has value {raw!r}: a checkpoint path must be absolute and hold no "
                           "'..' component (the chief sends normalised paths)")
    normal = normalize_path(raw)
    if not roots:
        return normal
    for root in roots:
        if _SCHEME.match(root) is None:
            if local and _inside(os.path.realpath(normal), os.path.realpath(root)):
                return normal
        elif not local and (normal == root or normal.startswith(root + "/")):
            return normal
    raise StorageError(f"field '{field}' has value {raw!r}: checkpoints of this job are confined to "
                       f"{', '.join(roots)} (KUBEPS_CHECKPOINT_ROOT)")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
