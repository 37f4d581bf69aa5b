"""File readers for ``Dataset.from_files``: each maps a path to an iterator of records (text lines, CSV rows,
rows of a ``.npy`` array or of the arrays in a ``.npz`` file); block readers (Criteo's format) map a path to blocks
of records, for :class:`~kubeps.runtime.data.file_blocks.FileBlocksNode`."""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from kubeps.runtime.data.criteo import CriteoReader
from kubeps.runtime.data.sources import TensorSlicesNode
from kubeps.runtime.util import npyfiles


def read_lines(path: str) -> Iterator[str]:
    """Lines of a text file, without their line ending."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield line.rstrip("\r\n")


#: a CSV field that is an integer literal: read with ``dtype``, it must keep its exact value
_INTEGER = re.compile(r"\s*[+-]?\d+\s*")


def read_csv(
    path: str, delimiter: str = ",", skip_header: bool = False, dtype: Any = np.float32
) -> Iterator[np.ndarray]:
    """One 1-D array per CSV row (``dtype`` float32 by default; ``dtype=str`` keeps the text).

    Nothing is rounded silently: an integer field (an id) that ``dtype`` cannot hold exactly -- ``16777217`` in
    float32, ``2**53 + 1`` in float64 -- and a finite number that overflows it are refused with the file, the line
    and the value; read ids with ``dtype=np.int64`` (or ``str``). Fractions round as floating point does."""
    dt = np.dtype(dtype)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if (skip_header and lineno == 1) or not line:
                continue
            fields = line.split(delimiter)
            try:
                with np.errstate(over="ignore"):  # an overflow is refused below, naming the value
                    row = np.asarray(fields, dtype=dtype)
            except (ValueError, OverflowError) as err:
                raise ValueError(f"{path}:{lineno}: cannot read {fields!r} as {dt}: {err}") from None
            if dt.kind == "f":
                _check_exact(row, fields, dt, f"{path}:{lineno}")
            yield row


def _check_exact(row: np.ndarray, fields: list[str], dt: np.dtype, where: str) -> None:
    """Refuse a row whose integer fields changed value, or whose finite fields became infinite, when read."""
    for text, value in zip(fields, row.tolist()):
        if _INTEGER.fullmatch(text):
            if not math.isfinite(value) or int(value) != int(text):
                raise ValueError(f"{where}: value {text.strip()!r} is not exactly representable as {dt} (it would "
                                 f"read as {value!r}); read ids with dtype=np.int64 or dtype=str")
        elif not math.isfinite(value) and math.isfinite(float(text)):
            raise ValueError(f"{where}: value {text.strip()!r} overflows {dt} (it would read as {value!r})")


def read_npy(path: str) -> Iterator[np.ndarray]:
    """Rows (axis-0 slices) of a ``.npy`` array, memory-mapped."""
    array = npyfiles.load(path, mmap_mode="r", allow_pickle=False)
    if array.ndim == 0:
        raise ValueError(f"{path}: holds a scalar; read_npy needs an array with at least one dimension")
    for i in range(array.shape[0]):
        yield np.array(array[i])


def read_npz(path: str) -> Iterator[dict[str, np.ndarray]]:
    """Rows of the arrays of a ``.npz`` file as ``{name: row}`` dicts (all arrays need the same row count)."""
    arrays = npyfiles.load_npz(path)
    yield from TensorSlicesNode(arrays).iterate()


#: the readers ``Dataset.from_files`` knows by name
READERS: dict[str, Callable[[str], Iterable[Any]]] = {
    "lines": read_lines,
    "csv": read_csv,
    "npy": read_npy,
    "npz": read_npz,
}

#: the block readers ``Dataset.from_files`` knows by name: each makes a ``path -> blocks`` reader
BLOCK_READERS: dict[str, Callable[[], Callable[[str], Iterator[Any]]]] = {
    "criteo": CriteoReader,
}
