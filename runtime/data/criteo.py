"""Criteo's click-log format (the Kaggle Display Advertising set and the Criteo 1TB logs), read in blocks of lines
parsed with numpy over the whole block: no Python step per line or per field.

A line is 40 tab-separated fields: the label, 13 integer features ``I1``-``I13`` and 26 categorical features
``C1``-``C26``, each an 8-hex-digit hash; any feature may be empty. A block is
``{"label": int64[n], "dense": float32[n, 13], "categorical": int64[n, 26]}``, so an element is
``{"label": int64, "dense": float32[13], "categorical": int64[26]}``:

- an empty integer feature reads as 0.0, an empty categorical as -1 (the label may not be empty);
- a categorical is the unsigned 32-bit value of its 8 hex digits (either case): 0 to 2**32 - 1;
- an integer feature (a count, possibly negative) is read exactly as int64 and given to ``dense`` as float32
  (which rounds counts above 2**24, as any float32 feature does).

Nothing is skipped: a line with another number of fields, or a value that does not parse, is an error naming the
file, the line and the field (``label``, ``I7``, ``C12``). A file ending in ``.gz``, or starting with gzip's magic
bytes, is decompressed as it is read; lines may end with ``\\n`` or ``\\r\\n``.
"""

from __future__ import annotations

import gzip
import zlib
from typing import IO, Iterator

import numpy as np

from kubeps.runtime.data.columns import ColumnValueError
from kubeps.runtime.data.filesystems import open_binary

#: the fields of a line, in order
FIELD_NAMES = ("label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27)))
NUM_DENSE = 13
NUM_CATEGORICAL = 26
_FIELDS = len(FIELD_NAMES)
_INTEGERS = 1 + NUM_DENSE  # the label and I1-I13
_MAX_DIGITS = 18  # int64 holds every 18-digit integer
_GZIP_MAGIC = b"\x1f\x8b"
_MAX_LINE_BYTES = 1 << 20  # Criteo's lines are a few hundred bytes: a file without line ends is refused early



def open_criteo(path: str) -> IO[bytes]:
    """``path`` opened for reading bytes, decompressed when it is gzip'd (by its ``.gz`` suffix or its magic)."""
    raw = open_binary(path)
    try:
        gzipped = path.endswith(".gz") or raw.read(2) == _GZIP_MAGIC
        raw.seek(0)
    except BaseException:
        raw.close()
        raise
    return gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw  # type: ignore[return-value]  # binary either way


class CriteoReader:
    """``path -> blocks`` for :class:`~kubeps.runtime.data.file_blocks.FileBlocksNode`: one block per
    ``block_bytes`` of text (whole lines: about 1000 lines of 250 bytes in 256 KiB, small enough for the
    parsing's arrays to stay in the CPU's caches)."""

    def __init__(self, block_bytes: int = 256 << 10):
        self._block_bytes = block_bytes

    def __call__(self, path: str) -> Iterator[dict[str, np.ndarray]]:
        with open_criteo(path) as f:
            lines_before, tail = 0, b""
            while True:
                chunk = _read(f, self._block_bytes, path)
                if not chunk:
                    break
                data = tail + chunk if tail else chunk
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    if len(data) > _MAX_LINE_BYTES:
                        raise ColumnValueError(f"{path}: line {lines_before + 1}: no end of line in its first "
                                               f"{_MAX_LINE_BYTES >> 20} MiB; not a file in Criteo's format")
                    tail = data
                    continue
                block, n = parse_block(data[:cut], path, lines_before)
                tail = data[cut:]
                lines_before += n
                yield block
            if tail:
                yield parse_block(tail + b"\n", path, lines_before)[0]


def _read(f: IO[bytes], size: int, path: str) -> bytes:
    try:
        return f.read(size)
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:  # a gzip'd file that is not, or is cut short
        raise ColumnValueError(f"{path}: cannot decompress it as gzip: {err}") from None


def parse_block(data: bytes, path: str, lines_before: int = 0) -> tuple[dict[str, np.ndarray], int]:
    """The block of ``data`` (whole lines, each ending in ``\\n``) and its number of lines; ``lines_before`` (lines
    of the file before it) makes errors name the file's line numbers."""
    buf = np.frombuffer(data, dtype=np.uint8)
    separators = np.flatnonzero((buf == 9) | (buf == 10))  # where each field ends: its tab, or the line's newline
    lines = separators.size // _FIELDS
    if separators.size != lines * _FIELDS or not np.all(buf[separators[_FIELDS - 1 :: _FIELDS]] == 10) \
            or np.count_nonzero(buf[separators] == 10) != lines:
        _refuse_field_count(data, buf, path, lines_before)
    if not lines:
        return _empty_block(), 0
    ends = separators.reshape(lines, _FIELDS)
    starts = np.empty_like(ends)
    starts[:, 1:] = ends[:, :-1] + 1
    starts[0, 0] = 0
    starts[1:, 0] = ends[:-1, -1] + 1
    if buf[ends[:, -1] - 1].max() == 13:  # "\r\n" line endings: the last field ends before "\r"
        crlf = (buf[ends[:, -1] - 1] == 13) & (ends[:, -1] > starts[:, -1])
        ends[crlf, -1] -= 1
    lengths = ends - starts
    # every field's first 8 bytes as one big-endian word (its first byte on top), read at once
    words = np.ndarray((len(data) + 1,), dtype=">u8", buffer=data + bytes(8), strides=(1,))[starts].astype(np.uint64)
    integers, bad_integers = _integers(words[:, :_INTEGERS], lengths[:, :_INTEGERS])
    long = np.flatnonzero(lengths[:, :_INTEGERS] > 8)
    if long.size:  # more than 8 characters (rare in counts): digit by digit
        rows, cols = np.divmod(long, _INTEGERS)
        integers[rows, cols], bad_integers[rows, cols] = _long_integers(buf, starts[rows, cols], lengths[rows, cols])
    bad_integers[:, 0] |= lengths[:, 0] == 0  # the label is required
    hashes, bad_hashes = _hashes(words[:, _INTEGERS:], lengths[:, _INTEGERS:])
    bad = np.concatenate([bad_integers, bad_hashes], axis=1)
    if bad.any():
        line, field = (int(i) for i in np.argwhere(bad)[0])
        _refuse_value(data, starts[line, field], ends[line, field], path, lines_before + line + 1, field)
    block = {
        "label": integers[:, 0],
        "dense": integers[:, 1:].astype(np.float32),
        "categorical": hashes,
    }
    return block, lines


def _empty_block() -> dict[str, np.ndarray]:
    return {"label": np.zeros(0, np.int64), "dense": np.zeros((0, NUM_DENSE), np.float32),
            "categorical": np.zeros((0, NUM_CATEGORICAL), np.int64)}


def _lanes(byte: int) -> np.uint64:
    """``byte`` in each of a word's 8 bytes."""
    return np.uint64(byte * 0x0101010101010101)


_EVEN_BYTES = np.uint64(0x00FF00FF00FF00FF)
_EVEN_PAIRS = np.uint64(0x0000FFFF0000FFFF)
_LOW_HALF = np.uint64(0xFFFFFFFF)


def _integers(words: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The decimal integers (an empty field is 0) of fields of at most 8 characters, from their words, eight
    digits at a time in the word's bytes ("SWAR"), and where such a field is not an integer."""
    short = np.minimum(lengths, 8).astype(np.uint64)
    shift = np.where(short == 0, 0, (8 - short) * 8).astype(np.uint64)
    x = np.where(short == 0, np.uint64(0), words >> shift)  # right-aligned: the last digit in the lowest byte
    top = (x >> ((np.maximum(short, 1) - 1) * np.uint64(8))) & np.uint64(0xFF)
    negative = (short > 0) & (top == ord("-"))
    digits = short - negative.astype(np.uint64)
    mask = np.where(digits >= 8, ~np.uint64(0), (np.uint64(1) << (np.minimum(digits, 7) * np.uint64(8))) - np.uint64(1))
    x = (x & mask) | (_lanes(0x30) & ~mask)  # the bytes that are not digits read as "0"
    valid = ((x & _lanes(0xF0)) == _lanes(0x30)) & ((((x & _lanes(0x0F)) + _lanes(0x06)) & _lanes(0xF0)) == 0)
    d = x & _lanes(0x0F)
    d = (d & _EVEN_BYTES) + ((d >> np.uint64(8)) & _EVEN_BYTES) * np.uint64(10)
    d = (d & _EVEN_PAIRS) + ((d >> np.uint64(16)) & _EVEN_PAIRS) * np.uint64(100)
    d = ((d & _LOW_HALF) + (d >> np.uint64(32)) * np.uint64(10000)).astype(np.int64)
    bad = (lengths <= 8) & (~valid | (negative & (digits == 0)))
    return np.where(negative, -d, d), bad


def _long_integers(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The decimal integers of fields longer than 8 characters (1-D), digit by digit, and where one is not an
    integer of at most 18 digits."""
    width = min(int(lengths.max()), _MAX_DIGITS + 1)
    chars = buf[np.minimum(starts[:, None] + np.arange(width), buf.size - 1)]
    negative = chars[:, 0] == ord("-")
    digits = chars.astype(np.int64) - ord("0")
    counted = np.arange(width) < lengths[:, None]
    counted[:, 0] &= ~negative
    is_digit = (digits >= 0) & (digits <= 9)
    bad = (lengths > _MAX_DIGITS + 1) | (counted & ~is_digit).any(axis=1) | ((lengths == _MAX_DIGITS + 1) & ~negative)
    value = np.zeros(len(starts), dtype=np.int64)
    for k in range(width):
        value = np.where(counted[:, k] & is_digit[:, k], value * 10 + digits[:, k], value)
    return np.where(negative, -value, value), bad


def _hashes(words: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The unsigned 32-bit values (an empty field is -1) of 8-hex-digit fields, from their words, and where a
    field is not 8 hex digits. A digit's value is its low nibble, plus 9 for a letter (bit 6 set); a field is
    valid when its value written back in hex is the field, up to the letters' case."""
    v = ((words & _lanes(0x0F)) + np.uint64(9) * ((words >> np.uint64(6)) & _lanes(0x01))) & _lanes(0x0F)
    letter = ((v + _lanes(0x06)) >> np.uint64(4)) & _lanes(0x01)  # the digits above 9
    written = v + _lanes(0x30) + np.uint64(39) * letter  # "0"-"9", "a"-"f"
    valid = ((words ^ written) & ~(np.uint64(0x20) * letter)) == 0
    x = (v | (v >> np.uint64(4))) & _EVEN_BYTES
    x = (x | (x >> np.uint64(8))) & _EVEN_PAIRS
    x = ((x | (x >> np.uint64(16))) & _LOW_HALF).astype(np.int64)
    full = lengths == 8
    return np.where(full, x, -1), (lengths != 0) & ~(full & valid)


def _refuse_field_count(data: bytes, buf: np.ndarray, path: str, lines_before: int) -> None:
    """Raise for the first line of ``data`` that does not have 40 fields (or for a bad value before it)."""
    line_starts = np.concatenate([[0], np.flatnonzero(buf == 10) + 1])
    for i in range(len(line_starts) - 1):
        text = data[line_starts[i] : line_starts[i + 1] - 1].rstrip(b"\r")
        count = text.count(b"\t") + 1
        if count != _FIELDS:
            parse_block(data[: line_starts[i]], path, lines_before)  # a bad value on an earlier line comes first
            raise ColumnValueError(
                f"{path}: line {lines_before + i + 1}: {count} field{'s' if count != 1 else ''}, expected "
                f"{_FIELDS} tab-separated fields (label, I1-I13, C1-C26) in Criteo's format"
            )
    raise AssertionError("parse_block found a line without 40 fields, and none was")  # pragma: no cover


def _refuse_value(data: bytes, start: int, end: int, path: str, lineno: int, field: int) -> None:
    name = FIELD_NAMES[field]
    text = data[start:end].decode("utf-8", errors="replace")
    if field == 0 and not text:
        allowed = "the label may not be empty"
    elif field < _INTEGERS:
        allowed = f"{name} must be empty or an integer of at most {_MAX_DIGITS} digits"
    else:
        allowed = f"{name} must be empty or 8 hex digits"
    raise ColumnValueError(f"{path}: line {lineno}, field {name}: value {text!r} does not parse: {allowed}")
