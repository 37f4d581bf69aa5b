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

from kubeps.runtime.data.filesystems import open_binary

log = logging.getLogger("kubeps.data")

_MASK_DELTA = 0xA282EAD8
_HEADER = struct.Struct("<QI")
COMPRESSION_TYPES = ("", "GZIP", "ZLIB")
_CHUNK = 1 << 22  # bytes read from the file per step


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
    ``offsets`` are the byte offsets of the records' frames (in the uncompressed stream)."""
    crc = _crc32c().value
    unpack = _HEADER.unpack_from
    with open_records(path, compression_type) as f:
        buf = b""
        pos = 0  # of buf[0] in the stream
        at = 0  # next frame in buf
        offsets: list[int] = []
        records: list[bytes] = []
        eof = False
        while True:
            avail = len(buf) - at
            if avail >= 12:
                length, length_crc = unpack(buf, at)
                if (((c := crc(buf[at : at + 8])) >> 15 | c << 17) + _MASK_DELTA) & 0xFFFFFFFF != length_crc:
                    _corrupt(path, pos + at, "the length's CRC does not match (the rest of the file is skipped)",
                             skip_corrupt)
                    buf, at = b"", 0
                    break
                if avail >= 16 + length:
                    data = buf[at + 12 : at + 12 + length]
                    (data_crc,) = struct.unpack_from("<I", buf, at + 12 + length)
                    if (((c := crc(data)) >> 15 | c << 17) + _MASK_DELTA) & 0xFFFFFFFF != data_crc:
                        _corrupt(path, pos + at, f"the data's CRC does not match (record of {length} bytes skipped)",
                                 skip_corrupt)
                    else:
                        offsets.append(pos + at)
                        records.append(data)
                        if len(records) == chunk_records:
                            yield offsets, records
                            offsets, records = [], []
                    at += 16 + length
                    continue
            if eof:
                break
            chunk = f.read(_CHUNK)
            eof = not chunk
            buf, pos, at = buf[at:] + chunk, pos + at, 0
        if len(buf) - at:
            _corrupt(path, pos + at, f"the file ends inside a record ({len(buf) - at} bytes left)", skip_corrupt)
        if records:
            yield offsets, records


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
