"""Reading ``.npy``/``.npz`` headers safely from many threads.

numpy parses a ``.npy`` header with ``ast.literal_eval``. On CPython before 3.11.8/3.12.1, ``ast.parse`` in two
threads at once can fail with ``SystemError: AST constructor recursion depth mismatch`` (python/cpython#106905).
Checkpoint restores read many files from thread pools and dataset readers run in prefetch threads, so every header
parse in kubeps goes through this one process-wide lock. A header is a few hundred bytes: the lock costs nothing.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np

__all__ = ["load", "load_npz", "read_header"]

_HEADER_LOCK = threading.Lock()


class Readable(Protocol):
    """What :func:`read_header` needs of a stream: a file, or a wrapper that hashes what it reads."""

    def read(self, n: int = -1, /) -> bytes: ...


def read_header(reader: Readable) -> tuple[tuple[int, ...], bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` stream at its start; ValueError if it is not one."""
    version = np.lib.format.read_magic(reader)
    with _HEADER_LOCK:
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(reader)
        if version == (2, 0):
            return np.lib.format.read_array_header_2_0(reader)
    raise ValueError(f"unsupported .npy version {version}")


def load(path: str, **kwargs: Any) -> Any:
    """``np.load`` with the header parse under the lock (``.npz`` members are parsed on access: use
    :func:`load_npz` for those)."""
    with _HEADER_LOCK:
        return np.load(path, **kwargs)


def load_npz(path: str) -> dict[str, np.ndarray]:
    """Every array of a ``.npz`` file, read under the lock."""
    with _HEADER_LOCK, np.load(path, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}
