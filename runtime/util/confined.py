"""``ConfinedStorage``: local checkpoint storage that cannot leave its root, whatever the file system does meanwhile.

A parameter server writes and reads shards where a request says, inside ``KUBEPS_CHECKPOINT_ROOT``. Checking the
path by name (:func:`~kubeps.runtime.util.storage.confine`) and then opening it by name leaves a window: a
directory swapped for a symlink between the check and the open, or a symlink already inside the root, leads the
open outside. This storage resolves the root once, opens it as a directory descriptor, and reaches every path below
it one component at a time with ``openat``-style calls (``dir_fd``) that never follow a symlink (``O_NOFOLLOW``,
``O_DIRECTORY``); directories it needs are created the same way (``mkdirat``), temporary files are renamed into
place relative to the same descriptors (``renameat``). A symlink anywhere below the root, or a component that is not
what it should be, fails with :class:`~kubeps.runtime.util.storage.StorageError` naming the path as the request
gave it, never what lies at or beyond the link.

POSIX only (``dir_fd`` and ``O_NOFOLLOW``); other platforms and URLs use :func:`~kubeps.runtime.util.storage.storage_for`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from typing import IO, Iterator

from kubeps.runtime.util.storage import _SCHEME, Storage, StorageError, _inside, storage_for

__all__ = ["ConfinedStorage", "confined_storage", "supported"]

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def supported() -> bool:
    """Whether this platform opens relative to directory descriptors without following symlinks."""
    return bool(getattr(os, "O_NOFOLLOW", 0)) and os.open in os.supports_dir_fd and os.mkdir in os.supports_dir_fd


class ConfinedStorage:
    """The :class:`~kubeps.runtime.util.storage.Storage` of the paths below ``base`` (a normalised absolute path),
    which lies ``parts`` components below the (already resolved) directory ``root``."""

    def __init__(self, root: str, base: str, parts: list[str], field: str = "directory"):
        self._root, self._base, self._parts, self._field = root, base.rstrip("/") or "/", parts, field

    # -- paths ------------------------------------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def _components(self, path: str) -> list[str]:
        if path != self._base and not path.startswith(self._base + "/"):
            raise StorageError(f"field '{self._field}': {path!r} is not below {self._base!r}")
        rest = [p for p in path[len(self._base):].split("/") if p]
        if any(p in (".", "..") for p in rest):
            raise StorageError(f"field '{self._field}': {path!r} holds a '.' or '..' component")
        return self._parts + rest

    def _refusal(self, path: str, err: OSError) -> StorageError:
        if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            why = "a component is a symbolic link or not a directory (checkpoints follow no links)"
        elif err.errno == errno.ENOENT:
            why = "it is missing"
        else:
            why = os.strerror(err.errno or 0)
        refused = StorageError(f"field '{self._field}': {path!r} cannot be used: {why}")
        refused.errno = err.errno  # the server maps it to a status code
        return refused

    @contextlib.contextmanager
    def _parent(self, path: str, create: bool) -> Iterator[tuple[int, str]]:
        """The descriptor of ``path``'s directory (made where ``create``) and its last component."""
        parts = self._components(path)
        if not parts:
            raise StorageError(f"field '{self._field}': {path!r} names the checkpoint root itself, not a file")
        fd = os.open(self._root, _DIR_FLAGS)
        try:
            for name in parts[:-1]:
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o755, dir_fd=fd)
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
            yield fd, parts[-1]
        except StorageError:
            raise
        except OSError as err:
            raise self._refusal(path, err) from None
        finally:
            os.close(fd)

    # -- the Storage interface ----------------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        try:
            with self._parent(path, False) as (fd, name):
                os.stat(name, dir_fd=fd, follow_symlinks=False)
            return True
        except OSError:
            return False

    def isdir(self, path: str) -> bool:
        try:
            with self._parent(path, False) as (fd, name):
                os.close(os.open(name, _DIR_FLAGS, dir_fd=fd))
            return True
        except OSError:
            return False

    def listdir(self, path: str) -> list[str]:
        try:
            with self._parent(path, False) as (fd, name):
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                try:
                    return sorted(os.listdir(child))
                finally:
                    os.close(child)
        except OSError:
            return []

    def makedirs(self, path: str) -> None:
        with self._parent(path, True) as (fd, name):
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=fd)
            os.close(os.open(name, _DIR_FLAGS, dir_fd=fd))  # a directory, not a link to one

    def size(self, path: str) -> int:
        with self.open_read(path) as f:
            return os.fstat(f.fileno()).st_size

    def open_read(self, path: str) -> IO[bytes]:
        with self._parent(path, False) as (fd, name):
            try:
                return os.fdopen(os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=fd), "rb")
            except OSError as err:
                if err.errno == errno.ENOENT:
                    raise FileNotFoundError(err.errno, f"{path!r} is missing") from None
                raise self._refusal(path, err) from None

    @contextlib.contextmanager
    def open_write_atomic(self, path: str) -> Iterator[IO[bytes]]:
        with self._parent(path, True) as (fd, name):
            tmp = f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            f = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=fd), "wb")
            try:
                yield f
                f.flush()
                os.fsync(f.fileno())
                f.close()
                os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
                with contextlib.suppress(OSError):
                    os.fsync(fd)
            except BaseException:
                f.close()
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                raise

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        with self.open_write_atomic(path) as f:
            f.write(data)

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    def remove(self, path: str) -> None:
        try:
            with self._parent(path, False) as (fd, name), contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
        except StorageError:
            pass  # a path that cannot be reached holds nothing this storage wrote

    def remove_tree(self, path: str) -> None:
        raise StorageError(f"field '{self._field}': a parameter server does not remove checkpoint directories")


def confined_storage(path: str, roots: list[str], field: str = "directory") -> Storage:
    """The storage of ``path``, which :func:`~kubeps.runtime.util.storage.confine` accepted: a
    :class:`ConfinedStorage` below the root it lies in when it is local and roots are set (the root resolved here,
    once), else :func:`~kubeps.runtime.util.storage.storage_for`'s."""
    local_roots = [r for r in roots if _SCHEME.match(r) is None]
    if not local_roots or _SCHEME.match(path) is not None or not supported():
        return storage_for(path)
    for root in local_roots:  # below a root by name: walk from the root's resolved directory
        if _inside(path, root):
            return ConfinedStorage(os.path.realpath(root), path, _relative(path, root), field)
    real = os.path.realpath(path)
    for root in local_roots:  # below a root once resolved (a root named through a link): walk the resolved parts
        real_root = os.path.realpath(root)
        if _inside(real, real_root):
            return ConfinedStorage(real_root, path, _relative(real, real_root), field)
    raise StorageError(f"field '{field}' has value {path!r}: checkpoints of this job are confined to "
                       f"{', '.join(roots)} (KUBEPS_CHECKPOINT_ROOT)")


def _relative(path: str, root: str) -> list[str]:
    return [p for p in path[len(root.rstrip(os.sep)):].split(os.sep) if p]
