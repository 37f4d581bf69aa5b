"""TFRecord files without TensorFlow: the record framing, with its CRC checks, for reading and writing.

A TFRecord file is a sequence of records, each framed as TensorFlow's ``record_writer.cc`` writes it::

    uint64 length            little-endian
    uint32 masked_crc32c(length bytes)
    byte   data[length]
    uint32 masked_crc32c(data)

where ``masked(crc) = ((crc >> 15 | crc << 17) + 0xa282ead8) mod 2**32`` over CRC-32C (Castagnoli). The CRC comes
from the ``google-crc32c`` package (Google's C implementation, the one the Cloud Storage client verifies downloads
with). A record whose CRC does not match is an error naming the file and the byte offset of the record, or, with
``skip_corrupt=True``, skipped with a warning: a bad data CRC skips that record; a bad length CRC (the position
of every later record is then unknown) or a truncated last record skips the rest of the file.
Files compressed as TensorFlow's ``compression_type="GZIP"`` or ``"ZLIB"`` are read and written too.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import struct
import zlib
from typing import IO, Any, Iterable, Iterator

import numpy as np

from kubeps.runtime.data.filesystems import open_binary

log = logging.getLogger("kubeps.data")

_MASK_DELTA = 0xA282EAD8
_HEADER = struct.Struct("<QI")
_LENGTH = struct.Struct("<Q")
COMPRESSION_TYPES = ("", "GZIP", "ZLIB")
_CHUNK = 1 << 20  # bytes read from the file per step (larger buffers walk slower: 0.90 vs 0.67 us a record at 4 MB)


class CorruptRecordError(ValueError):
    """A TFRecord record whose framing or CRC is wrong."""


def _crc32c() -> Any:
    try:
        import google_crc32c  # noqa: PLC0415 - optional dependency, needed for TFRecord only
    except ImportError:
        raise ImportError("TFRecord files need the optional 'google-crc32c' package: pip install 'kubeps[tfrecord]'") from None
    return google_crc32c


def masked_crc32c(data: bytes | memoryview) -> int:
    """TFRecord's masked CRC-32C of ``data``."""
    crc = _crc32c().value(bytes(data)) if isinstance(data, memoryview) else _crc32c().value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def compression_arg(compression_type: str | None) -> str:
    value = "" if compression_type is None else str(compression_type).upper()
    if value not in COMPRESSION_TYPES:
        raise ValueError(
            f"argument `compression_type` must be None, '' , 'GZIP' or 'ZLIB' (as TensorFlow's), got {compression_type!r}"
        )
    return value


class _Inflate(io.RawIOBase):
    """A ZLIB-compressed stream, decompressed as it is read."""

    def __init__(self, raw: IO[bytes]):
        self._raw = raw
        self._z = zlib.decompressobj()
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            chunk = self._raw.read(_CHUNK)
            if not chunk:
                self._pending = self._z.flush()
                break
            self._pending = self._z.decompress(chunk)
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


@contextlib.contextmanager
def open_records(path: str, compression_type: str = "") -> Iterator[IO[bytes]]:
    """The file's (decompressed) bytes; the file is closed at the end of the block."""
    with open_binary(path) as raw:
        if compression_type == "GZIP":
            with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                yield unzipped  # type: ignore[misc]  # a GzipFile is a binary file (typeshed's type is narrower)
        elif compression_type == "ZLIB":
            yield io.BufferedReader(_Inflate(raw))
        else:
            yield raw


def read_records(
    path: str, compression_type: str = "", skip_corrupt: bool = False, chunk_records: int = 4096
) -> Iterator[tuple[list[int], list[bytes]]]:
    """The records of a TFRecord file, checked, in chunks of up to ``chunk_records``: ``(offsets, records)``, where
    ``offsets`` are the byte offsets of the records' frames (in the uncompressed stream).

    Both CRCs of every record are checked, with as little Python per record as can be: the walk over the frames
    of a buffer reads each frame's length and nothing else; then numpy takes every length from the frames' starts
    and gathers their stored CRCs, comparing each with the masked CRC of that length (computed once per distinct
    length: records of one writer share a few); the records are sliced out and their data CRCs computed by
    Google's C code (one call each, from ``map``), and numpy compares those with the trailers. A length the walk
    took before its CRC was checked cannot mislead it: the buffer's frames are cut at the first bad length CRC.
    Corrupt records are reported (or skipped) in file order, as a record-by-record check would."""
    crc = _crc32c().value
    length_at = _LENGTH.unpack_from
    known: dict[int, int] = {}  # length -> its masked CRC
    pending_offsets: list[int] = []
    pending: list[bytes] = []
    with open_records(path, compression_type) as f:
        buf = b""
        pos = 0  # of buf[0] in the stream
        at = 0  # next frame in buf
        eof = False
        while not eof:
            chunk = f.read(_CHUNK)
            eof = not chunk
            buf, pos, at = buf[at:] + chunk, pos + at, 0
            size = len(buf)
            starts: list[int] = []
            take = starts.append
            while at + 12 <= size:  # the walk: each frame's start, from the lengths alone
                end = at + 16 + length_at(buf, at)[0]
                if end > size:
                    break
                take(at)
                at = end
            frames = np.array(starts, dtype=np.int64)
            ends = np.append(frames[1:], at) if starts else frames  # each frame's end: the next one's start
            bad_length = _first_bad_length(buf, frames, ends, known)
            if bad_length is not None:
                at = starts[bad_length]
                del starts[bad_length:]
                frames, ends = frames[:bad_length], ends[:bad_length]
            elif at + 12 <= size and not _length_ok(buf, at, known):  # the frame the buffer ends inside
                bad_length = len(starts)
            records = [buf[a + 12 : b - 4] for a, b in zip(starts, starts[1:] + [at])]
            crcs = np.fromiter(map(crc, records), dtype=np.uint64, count=len(records))
            offsets = (frames + pos).tolist()
            for i in _bad_data(buf, ends, crcs):
                pending_offsets += offsets[:i]
                pending += records[:i]
                yield from _full_chunks(pending_offsets, pending, chunk_records)
                _corrupt(path, offsets[i], f"the data's CRC does not match (record of {len(records[i])} bytes "
                         "skipped)", skip_corrupt)
                offsets, records = offsets[i + 1 :], records[i + 1 :]
            pending_offsets += offsets
            pending += records
            yield from _full_chunks(pending_offsets, pending, chunk_records)
            if bad_length is not None:
                _corrupt(path, pos + at, "the length's CRC does not match (the rest of the file is skipped)",
                         skip_corrupt)
                buf, at = b"", 0
                break
        if len(buf) - at:
            _corrupt(path, pos + at, f"the file ends inside a record ({len(buf) - at} bytes left)", skip_corrupt)
        if pending:
            yield pending_offsets, pending


def _length_crc(length: int, known: dict[int, int]) -> int:
    """The masked CRC of a frame's length field, remembered for up to 1024 distinct lengths."""
    masked = known.get(length)
    if masked is None:
        masked = masked_crc32c(struct.pack("<Q", length))
        if len(known) < 1024:
            known[length] = masked
    return masked


def _length_ok(buf: bytes, at: int, known: dict[int, int]) -> bool:
    length, stored = _HEADER.unpack_from(buf, at)
    return _length_crc(length, known) == stored


def _uint32_at(buf: bytes, at: np.ndarray) -> np.ndarray:
    """The little-endian uint32 at each offset ``at`` of ``buf``."""
    return np.frombuffer(buf, dtype=np.uint8)[at[:, None] + np.arange(4)].view("<u4").reshape(-1)


def _first_bad_length(buf: bytes, frames: np.ndarray, ends: np.ndarray, known: dict[int, int]) -> int | None:
    """The index of the first frame (``frames``: their starts, ``ends``: their ends) whose length's CRC is not its
    header's, or None. Each length is its frame's size less the 16 bytes of framing: the walk took it from the
    header."""
    if not frames.size:
        return None
    distinct, which = np.unique(ends - frames - 16, return_inverse=True)
    expected = np.array([_length_crc(int(n), known) for n in distinct], dtype=np.uint32)[which.reshape(-1)]
    bad = np.flatnonzero(expected != _uint32_at(buf, frames + 8))
    return int(bad[0]) if bad.size else None


def _bad_data(buf: bytes, ends: np.ndarray, crcs: np.ndarray) -> list[int]:
    """The indices of the records whose masked data CRC (``crcs``: unmasked) is not their trailer's (the 4 bytes
    before each frame's end in ``ends``), in order; each index counts from the record after the previous one (the
    caller drops what it has handled)."""
    if not crcs.size:
        return []
    masked = ((crcs >> np.uint64(15) | crcs << np.uint64(17)) + np.uint64(_MASK_DELTA)) & np.uint64(0xFFFFFFFF)
    bad = np.flatnonzero(masked != _uint32_at(buf, ends - 4)).tolist()
    return [b - a - 1 for a, b in zip([-1, *bad], bad)]


def _full_chunks(offsets: list[int], records: list[bytes], chunk_records: int) -> Iterator[tuple[list[int], list[bytes]]]:
    """Yields (and removes) the leading ``chunk_records``-sized chunks of ``offsets``/``records``."""
    while len(records) >= chunk_records:
        yield offsets[:chunk_records], records[:chunk_records]
        del offsets[:chunk_records], records[:chunk_records]


def _corrupt(path: str, offset: int, what: str, skip: bool) -> None:
    message = f"{path}: corrupt TFRecord record at byte offset {offset}: {what}"
    if not skip:
        raise CorruptRecordError(message + "; pass skip_corrupt=True to skip corrupt records")
    log.warning("%s", message)


def frame(record: bytes) -> bytes:
    """One record framed as TFRecord."""
    header = struct.pack("<Q", len(record))
    return header + struct.pack("<I", masked_crc32c(header)) + record + struct.pack("<I", masked_crc32c(record))


class TFRecordWriter:
    """Writes records to a TFRecord file (a path or an fsspec URL), as ``tf.io.TFRecordWriter``; a context
    manager. Use :func:`~kubeps.runtime.data.example.serialize_example` for ``tf.Example`` records."""

    def __init__(self, path: str, compression_type: str | None = None):
        self._path = path
        kind = compression_arg(compression_type)
        from kubeps.runtime.data.filesystems import is_url, local_path  # noqa: PLC0415 - the writer only

        if is_url(path):
            import fsspec  # noqa: PLC0415 - optional dependency, needed for URLs only

            raw: IO[bytes] = fsspec.open(path, "wb").open()
        else:
            raw = open(local_path(path), "wb")
        self._raw = raw
        self._z = zlib.compressobj() if kind == "ZLIB" else None
        # a GzipFile is a binary file (typeshed's type is narrower than IO[bytes])
        self._f: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="wb") if kind == "GZIP" else raw  # type: ignore[assignment]

    def write(self, record: bytes) -> None:
        data = frame(record)
        self._f.write(self._z.compress(data) if self._z is not None else data)

    def write_all(self, records: Iterable[bytes]) -> None:
        for record in records:
            self.write(record)

    def close(self) -> None:
        if self._z is not None:
            self._f.write(self._z.flush())
        self._f.close()
        if self._f is not self._raw:
            self._raw.close()

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
