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
import functools
import gzip
import io
import logging
import struct
import zlib
from typing import IO, Any, Iterable, Iterator, NamedTuple

import numpy as np

from kubeps.runtime.data.filesystems import open_binary
from kubeps.runtime.errors import RuntimeConfigError

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
        raise RuntimeConfigError("compression_type", compression_type, "None, '', 'GZIP' or 'ZLIB' (as TensorFlow's)")
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


class RecordRun(NamedTuple):
    """Consecutive records of a TFRecord file, checked, as they lie in the buffer they were read in: record ``i``
    is ``data[starts[i]:ends[i]]`` and its frame starts at byte ``offsets[i]`` of the (uncompressed) stream. Each
    record's framing -- the 12 header bytes before it, the 4 trailer bytes after it -- has been checked and is the
    reader's to overwrite (so between two records of a run lie 16 such bytes); the records' bytes are not. Runs of
    one buffer share ``data``."""

    data: bytearray
    starts: np.ndarray
    ends: np.ndarray
    offsets: np.ndarray

    def records(self) -> list[bytes]:
        view = memoryview(self.data)
        return [view[a:b].tobytes() for a, b in zip(self.starts.tolist(), self.ends.tolist())]

    def pieces(self, size: int) -> Iterator["RecordRun"]:
        """The run in runs of up to ``size`` records, in order."""
        for k in range(0, len(self.starts), size):
            cut = slice(k, k + size)
            yield RecordRun(self.data, self.starts[cut], self.ends[cut], self.offsets[cut])


def read_records(
    path: str, compression_type: str = "", skip_corrupt: bool = False, chunk_records: int = 4096
) -> Iterator[tuple[list[int], list[bytes]]]:
    """The records of a TFRecord file, checked (see :func:`read_runs`), in chunks of ``chunk_records`` (the last
    one fewer): ``(offsets, records)``, where ``offsets`` are the byte offsets of the records' frames (in the
    uncompressed stream). A corrupt record's error comes before the chunk it would have been in."""
    pending_offsets: list[int] = []
    pending: list[bytes] = []
    for run in read_runs(path, compression_type, skip_corrupt):
        pending_offsets += run.offsets.tolist()
        pending += run.records()
        while len(pending) >= chunk_records:
            yield pending_offsets[:chunk_records], pending[:chunk_records]
            del pending_offsets[:chunk_records], pending[:chunk_records]
    if pending:
        yield pending_offsets, pending


def read_runs(path: str, compression_type: str = "", skip_corrupt: bool = False) -> Iterator[RecordRun]:
    """The records of a TFRecord file, checked, as runs of records that lie together in a read buffer: those of
    each buffer, or, around a corrupt record skipped, those before and after it.

    Both CRCs of every record are checked, with as little Python per record as can be. A buffer's frames are found
    by numpy where it can (:func:`_frames_found`: frames below 64 KB, every length's CRC good), else by a walk
    over the frames that reads each frame's length and nothing else; numpy then takes every length from the
    frames' starts and gathers their stored CRCs, comparing each with the masked CRC of that length. A length the
    walk took before its CRC was checked cannot mislead it: the buffer's frames are cut at the first bad length
    CRC. The data CRCs are checked by one CRC over the whole buffer, rewritten (see :func:`_all_data_crcs_match`);
    only if that fails is each record's CRC computed, to find the corrupt ones. Corrupt records are reported (or
    skipped) in file order, as a record-by-record check would, after the runs of records before them."""
    crc = _crc32c().value
    length_at = _LENGTH.unpack_from
    scratch = [np.empty((4, 0), dtype=bool)]
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
            found = _frames_found(buf, scratch)
            if found is not None:
                frames, at = found
                ends = np.append(frames[1:], at) if frames.size else frames  # each one's end: the next one's start
                bad_length = None  # found by their lengths' CRCs
            else:
                starts: list[int] = []
                take = starts.append
                while at + 12 <= size:  # the walk: each frame's start, from the lengths alone
                    end = at + 16 + length_at(buf, at)[0]
                    if end > size:
                        break
                    take(at)
                    at = end
                frames = np.array(starts, dtype=np.int64)
                ends = np.append(frames[1:], at) if starts else frames
                bad_length = _first_bad_length(buf, frames, ends)
                if bad_length is not None:
                    at = starts[bad_length]
                    frames, ends = frames[:bad_length], ends[:bad_length]
            if bad_length is None and at + 12 <= size and not _length_ok(buf, at):  # the frame the buffer ends inside
                bad_length = frames.size
            if frames.size:
                data = bytearray(buf)
                bad = [] if _all_data_crcs_match(data, frames, ends, crc) else _bad_data(buf, frames, ends, crc)
                first = 0
                for i in [*bad, frames.size]:
                    if i > first:
                        kept = slice(first, i)
                        yield RecordRun(data, frames[kept] + 12, ends[kept] - 4, frames[kept] + pos)
                    if i < frames.size:
                        _corrupt(path, pos + int(frames[i]), f"the data's CRC does not match (record of "
                                 f"{int(ends[i] - frames[i]) - 16} bytes skipped)", skip_corrupt)
                    first = i + 1
            if bad_length is not None:
                _corrupt(path, pos + at, "the length's CRC does not match (the rest of the file is skipped)",
                         skip_corrupt)
                buf, at = b"", 0
                break
        if len(buf) - at:
            _corrupt(path, pos + at, f"the file ends inside a record ({len(buf) - at} bytes left)", skip_corrupt)


@functools.cache
def _crc_constants() -> tuple[int, int, int]:
    """CRC-32C's register values for :func:`_all_data_crcs_match`: ``(after, start, residue)``. In terms of the
    register ``r`` (``value(d)`` is ``~F(~0, d)``, where ``F(r, d)`` is the register after ``d`` from ``r``):
    ``F(r, d)`` is linear in ``r`` and ``d`` together, and ``F(r, le32(r)) = 0`` (each byte cancels the register's
    low byte). So after a record and its CRC (``le32(value(d))``, the complement of the register) the register is
    ``after = F(0, ff ff ff ff)`` whatever the record; ``le32(after)`` then clears it; four zero bytes keep it clear;
    ``le32(start)``, found by solving ``F(0, x) = ~0`` (linear in ``x``: 32 equations over GF(2)), sets it to
    ``~0``, where a record's CRC starts. ``residue`` is ``value()`` of a stream that ends with a record and its
    CRC: ``~after``."""
    google = _crc32c()
    mask = 0xFFFFFFFF

    def register(r: int, data: bytes) -> int:
        return ~google.extend(~r & mask, data) & mask

    after = register(0, b"\xff" * 4)
    pivots: dict[int, tuple[int, int]] = {}  # leading bit -> (image, the input bits that give it)
    for k in range(32):
        image, bits = register(0, (1 << k).to_bytes(4, "little")), 1 << k
        for bit in range(31, -1, -1):
            if image >> bit & 1:
                if bit not in pivots:
                    pivots[bit] = (image, bits)
                    break
                image, bits = image ^ pivots[bit][0], bits ^ pivots[bit][1]
    target, start = mask, 0
    for bit in range(31, -1, -1):
        if target >> bit & 1:
            target, start = target ^ pivots[bit][0], start ^ pivots[bit][1]
    assert register(0, start.to_bytes(4, "little")) == mask and target == 0
    return after, start, ~after & mask


def _all_data_crcs_match(data: bytearray, frames: np.ndarray, ends: np.ndarray, crc: Any) -> bool:
    """Whether every frame's (``frames``: their starts, ``ends``: their ends, in ``data``) data CRC matches its
    trailer, by one CRC computation over them all. ``data`` is rewritten in place: each trailer becomes its CRC
    unmasked, and the 12-byte header after it the four bytes that clear the register, four zero bytes and the four
    that set it to where a CRC starts (:func:`_crc_constants`). If every record's CRC matches, the CRC of the
    stream from the first record to the last trailer is then the residue of CRC-32C; a record whose CRC does not
    match changes it (by a register value that no later bytes cancel, F being invertible in the register: only
    two or more corrupt records can cancel out, with odds of 2**-32, those of one corrupt record going unseen by
    its own CRC)."""
    after, start, residue = _crc_constants()
    at32 = np.ndarray(shape=(len(data) - 3,), dtype="<u4", buffer=data, strides=(1,))  # a uint32 at every byte
    masked = at32[ends - 4].astype(np.uint64)
    rotated = (masked - np.uint64(_MASK_DELTA)) & np.uint64(0xFFFFFFFF)  # masked: the CRC rotated right by 15, + delta
    at32[ends - 4] = ((rotated << np.uint64(15)) | (rotated >> np.uint64(17))) & np.uint64(0xFFFFFFFF)
    gaps = ends[:-1]  # the next frame's header
    at32[gaps] = after
    at32[gaps + 4] = 0
    at32[gaps + 8] = start
    return crc(bytes(memoryview(data)[int(frames[0]) + 12 : int(ends[-1])])) == residue


@functools.cache
def _small_length_crcs() -> np.ndarray:
    """The masked CRC of every length field below 2**16 (a record's length is its frame's header), by CRC-32C
    being affine: ``crc(x ^ y ^ z) = crc(x) ^ crc(y) ^ crc(z)`` for messages of one length, and a length ``n``
    below 2**16 is ``le64(n & 255) ^ le64((n >> 8) << 8) ^ le64(0)``: 513 CRCs computed, the rest by numpy."""
    google = _crc32c()
    low = np.array([google.value(bytes([b]) + bytes(7)) for b in range(256)], dtype=np.uint64)
    high = np.array([google.value(bytes([0, b]) + bytes(6)) for b in range(256)], dtype=np.uint64)
    raw = (high[:, None] ^ low[None, :] ^ np.uint64(google.value(bytes(8)))).reshape(-1)  # [n >> 8, n & 255]
    return _masked(raw).astype(np.uint32)


def _length_crcs(lengths: np.ndarray) -> np.ndarray:
    """The masked CRC of each length field (``lengths``: int64, not negative)."""
    if lengths.size and int(lengths.max()) < 1 << 16:
        return _small_length_crcs()[lengths]
    distinct, which = np.unique(lengths, return_inverse=True)
    return np.array([masked_crc32c(_LENGTH.pack(n)) for n in distinct.tolist()], dtype=np.uint32)[which.reshape(-1)]


def _frames_found(buf: bytes, scratch: list[np.ndarray]) -> tuple[np.ndarray, int] | None:
    """The walk's frames in ``buf`` (their starts, and where the walk stops: the end of the last one), found by
    numpy, or None where that does not work out (the caller then walks). ``scratch``: an array reused between
    calls.

    A frame whose length is below 2**16 has six zero bytes after the first two of its header, and its length's
    masked CRC after them: numpy takes every offset where both hold. That those are the walk's frames is checked,
    not assumed: the first at offset 0, each one ending where the next begins, and only the last not fitting in
    ``buf``, or the frame after the last, if its header is whole, not fitting either. A frame of 2**16 bytes or
    more, a length whose CRC is bad (the walk's checks then name it), or bytes inside a record that look like a
    header, and the walk decides."""
    size = len(buf)
    if size < 16:
        return None
    if scratch[0].shape[1] < size:
        scratch[0] = np.empty((4, size), dtype=bool)
    zero, two, four, six = scratch[0][:, :size]
    u8 = np.frombuffer(buf, dtype=np.uint8)
    np.equal(u8, 0, out=zero)
    np.logical_and(zero[:-1], zero[1:], out=two[:-1])  # two[p]: bytes p, p + 1 zero
    np.logical_and(two[: size - 3], two[2 : size - 1], out=four[: size - 3])
    np.logical_and(four[: size - 5], two[4 : size - 1], out=six[: size - 5])  # six[p]: bytes p .. p + 5 zero
    at = np.flatnonzero(six[: size - 5]) - 2
    at = at[(at >= 0) & (at + 12 <= size)]
    lengths = u8[at].astype(np.int64) | u8[at + 1].astype(np.int64) << 8
    found = _small_length_crcs()[lengths] == _uint32_at(buf, at + 8)
    frames, lengths = at[found], lengths[found]
    if not frames.size or frames[0] != 0:
        return None
    ends = frames + 16 + lengths
    if (ends[:-1] != frames[1:]).any():
        return None
    whole = int(np.searchsorted(ends, size, side="right"))  # the frames that fit: the walk takes those
    if frames.size - whole > 1:
        return None
    stop = int(ends[whole - 1]) if whole else 0
    if whole == frames.size and stop + 12 <= size and stop + 16 + _LENGTH.unpack_from(buf, stop)[0] <= size:
        return None  # a frame after the last found, that the walk would take
    return frames[:whole], stop


def _length_ok(buf: bytes, at: int) -> bool:
    length, stored = _HEADER.unpack_from(buf, at)
    return int(_length_crcs(np.array([length], dtype=np.int64))[0]) == stored


def _uint32_at(buf: bytes, at: np.ndarray) -> np.ndarray:
    """The little-endian uint32 at each offset ``at`` of ``buf``: a gather from a view of ``buf`` as a uint32 at
    every byte."""
    return np.ndarray(shape=(len(buf) - 3,), dtype="<u4", buffer=buf, strides=(1,))[at]


def _first_bad_length(buf: bytes, frames: np.ndarray, ends: np.ndarray) -> int | None:
    """The index of the first frame (``frames``: their starts, ``ends``: their ends) whose length's CRC is not its
    header's, or None. Each length is its frame's size less the 16 bytes of framing: the walk took it from the
    header."""
    if not frames.size:
        return None
    bad = np.flatnonzero(_length_crcs(ends - frames - 16) != _uint32_at(buf, frames + 8))
    return int(bad[0]) if bad.size else None


def _bad_data(buf: bytes, frames: np.ndarray, ends: np.ndarray, crc: Any) -> list[int]:
    """The indices of the frames (``frames``: their starts, ``ends``: their ends, in ``buf``) whose data's masked
    CRC is not their trailer's, in order: each record's CRC computed by Google's C code (one call each)."""
    records = [buf[a + 12 : b - 4] for a, b in zip(frames.tolist(), ends.tolist())]
    crcs = np.fromiter(map(crc, records), dtype=np.uint64, count=len(records))
    return np.flatnonzero(_masked(crcs) != _uint32_at(buf, ends - 4)).tolist()


def _masked(crcs: np.ndarray) -> np.ndarray:
    """TFRecord's masking (:func:`masked_crc32c`) of each CRC (uint64 holding 32-bit values)."""
    return (((crcs >> np.uint64(15)) | (crcs << np.uint64(17))) + np.uint64(_MASK_DELTA)) & np.uint64(0xFFFFFFFF)


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
