"""Tensor framing: how numpy arrays travel between kubeps processes.

A *message* is a small JSON header (a pydantic model) plus a list of arrays whose bytes follow the header raw, never
pickled. One message is one logical frame::

    b"KPS1" | u32 little-endian header length | header JSON | pad to 8 | tensor 0 | pad | tensor 1 | pad | ...

The header names, for every tensor, its dtype (numpy's string, explicit little-endian), its shape, its offset in the
data section and its byte count. A frame above :data:`DEFAULT_CHUNK_BYTES` is cut into chunks that travel as the
messages of a gRPC stream; the first chunk always holds the whole header. The receiver allocates one buffer for the
data section and copies each chunk into it once; a frame that fits one chunk is decoded without any copy
(``np.frombuffer`` on the received bytes, so such arrays are read-only).

Malformed frames (unknown dtype, shape that does not match the byte count, truncated or overlong data) raise
:class:`WireError` naming the field, the value and what is allowed; servers answer ``INVALID_ARGUMENT`` with it.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError, field_validator

from kubeps.runtime.errors import FieldError

__all__ = [
    "ALLOWED_DTYPES",
    "DEFAULT_CHUNK_BYTES",
    "MAGIC",
    "MessageDecoder",
    "MessageHeader",
    "TensorHeader",
    "WireError",
    "decode_chunks",
    "decode_message",
    "encode_chunks",
    "encode_message",
]

MAGIC = b"KPS1"
_PREFIX = struct.Struct("<4sI")
_ALIGN = 8
#: Frames larger than this travel as several stream messages (tuned with ``bench/pushpull.py``).
DEFAULT_CHUNK_BYTES = 4 << 20
#: Upper bound on a header; a bigger one is refused before parsing (servers pass their own, smaller bound:
#: ``KUBEPS_MAX_HEADER_BYTES``).
MAX_HEADER_BYTES = 16 << 20
#: Deepest nesting of arrays and objects a header may have (kubeps sends 4 at most); deeper is refused unparsed.
MAX_JSON_DEPTH = 64
#: Most arrays and objects a header may hold, counted by their opening brackets before it is parsed (brackets inside
#: strings count too): parsing makes one Python object per container, so a header of nothing but ``[]`` would cost
#: ~1 us of the server's CPU per 2 bytes (a 1 MiB one ~0.5-1 s). The biggest header kubeps sends, 16,000 tensors in
#: 1 MiB, holds ~33,000; at this bound the costliest header parses in ~50 ms.
MAX_JSON_CONTAINERS = 1 << 17
#: Most tensors a frame may carry where no server setting applies (answers a client decodes); servers apply
#: ``KUBEPS_MAX_TENSORS`` to requests.
MAX_TENSORS = 1 << 20

#: dtypes allowed on the wire (numpy names; always little-endian). No object dtype: that would be pickle.
ALLOWED_DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in ALLOWED_DTYPES}
#: Largest size (elements or bytes) numpy can index on this platform.
_MAX_SIZE = int(np.iinfo(np.intp).max)


def _numpy_max_rank() -> int:
    for rank in (64, 32):  # numpy 2 allows 64 dimensions, numpy 1 allows 32
        try:
            np.empty((0,) * rank)
            return rank
        except ValueError:
            continue
    return 32


#: Most dimensions an array may have on the wire (numpy's own limit).
MAX_RANK = _numpy_max_rank()


class WireError(FieldError):
    """A malformed message: names the field, the value and what is allowed."""

    template = "malformed message: field '{field}' has value {value}: {allowed}"
    value_chars = 120


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class TensorHeader(BaseModel):
    """Where one tensor lies in the data section and how to read it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # strict: an int is an int ("2", 2.0 and true are refused, as the fast path refuses them)
    dtype: StrictStr
    shape: tuple[StrictInt, ...]
    offset: StrictInt
    nbytes: StrictInt

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in _DTYPES:
            raise ValueError(f"dtype {value!r} is not allowed; allowed dtypes are {', '.join(ALLOWED_DTYPES)}")
        return value

    @field_validator("shape")
    @classmethod
    def _dims(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(d < 0 for d in value):
            raise ValueError(f"shape {list(value)} has a negative dimension; dimensions must be >= 0")
        return value

    @field_validator("offset", "nbytes")
    @classmethod
    def _non_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"{value} is negative; must be >= 0")
        return value


class MessageHeader(BaseModel):
    """The typed header of a message: free-form JSON ``meta`` plus the tensor table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    meta: dict[str, Any] = {}
    tensors: list[TensorHeader] = []
    data_bytes: StrictInt = 0

    @field_validator("data_bytes")
    @classmethod
    def _data_size(cls, value: int) -> int:
        if not 0 <= value <= _MAX_SIZE:
            raise ValueError(f"{value} is out of range; must be in [0, {_MAX_SIZE}]")
        return value


#: the wire name of every little-endian or native dtype met so far (``dtype.name`` is Python code in numpy, ~1.5 us;
#: a dict lookup by dtype ~50 ns, and every tensor of every RPC asks). Filled on first use; bounded by the variants of
#: the allowed dtypes (byte order ``<``, ``=`` or ``|``).
_WIRE_NAMES: dict[np.dtype, str] = {}
_MAX_WIRE_NAMES = 256


def _tensor_header(name: str, array: np.ndarray, offset: int) -> dict[str, Any]:
    """The header entry of one tensor (the JSON form of :class:`TensorHeader`)."""
    return {"dtype": name, "shape": list(array.shape), "offset": offset, "nbytes": array.nbytes}


def _as_wire_array(i: int, value: Any) -> tuple[np.ndarray, str]:
    """``value`` (``tensors[i]``) as a little-endian C-contiguous array, with its dtype's wire name; a dtype the wire
    does not carry is a :class:`WireError`."""
    array = value if type(value) is np.ndarray else np.asarray(value)
    name = _WIRE_NAMES.get(array.dtype)
    if name is None:  # a dtype not met yet: check it; a big-endian one is swapped (and never remembered)
        name = array.dtype.name
        if name not in _DTYPES:
            raise WireError(f"tensors[{i}].dtype", str(array.dtype), f"allowed dtypes are {', '.join(ALLOWED_DTYPES)}")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        elif len(_WIRE_NAMES) < _MAX_WIRE_NAMES:
            _WIRE_NAMES[array.dtype] = name
    return (array if array.flags.c_contiguous else array.copy(order="C")), name  # (ascontiguousarray would make 0-d 1-d)


def encode_message(meta: Mapping[str, Any] | None = None, arrays: Sequence[Any] = ()) -> list[memoryview | bytes]:
    """The frame of a message as a list of buffers (no tensor bytes copied); join them or chunk them."""
    named = [_as_wire_array(i, a) for i, a in enumerate(arrays)]
    arrays = [array for array, _ in named]
    headers = []
    offset = 0
    for array, name in named:
        headers.append(_tensor_header(name, array, offset))
        offset = _align(offset + array.nbytes)
    # the JSON of a MessageHeader, written directly (every RPC encodes one: no model object per message)
    header = {"meta": dict(meta or {}), "tensors": headers, "data_bytes": offset}
    try:
        header_bytes = json.dumps(header, separators=(",", ":")).encode()
    except (TypeError, ValueError) as err:  # values JSON cannot hold
        raise WireError("meta", meta, f"must be JSON-serialisable ({err})") from None
    head_len = _PREFIX.size + len(header_bytes)
    pad = _align(head_len) - head_len
    segments: list[memoryview | bytes] = [_PREFIX.pack(MAGIC, len(header_bytes)) + header_bytes + b"\0" * pad]
    for array in arrays:
        if array.nbytes:
            segments.append(memoryview(array.reshape(-1)).cast("B"))
        tail = _align(array.nbytes) - array.nbytes
        if tail:
            segments.append(b"\0" * tail)
    return segments


def encode_chunks(
    meta: Mapping[str, Any] | None = None, arrays: Sequence[Any] = (), chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[bytes]:
    """The frame cut into stream messages of at most ``chunk_bytes`` (the first one always holds the header)."""
    segments = encode_message(meta, arrays)
    return list(_chunk(segments, chunk_bytes))


def _chunk(segments: list[memoryview | bytes], chunk_bytes: int) -> Iterator[bytes]:
    pending: list[memoryview | bytes] = []
    size = 0
    first = True
    for seg in segments:
        view = memoryview(seg)
        if first:  # the header segment is never split
            pending.append(view)
            size = len(view)
            first = False
            continue
        pos = 0
        while pos < len(view):
            room = chunk_bytes - size
            if room <= 0:
                yield b"".join(pending)
                pending, size = [], 0
                room = chunk_bytes
            piece = view[pos : pos + room]
            pending.append(piece)
            size += len(piece)
            pos += len(piece)
    if pending or first:
        yield b"".join(pending)


class MessageDecoder:
    """Incremental decoder: ``feed()`` every received chunk, then ``finish()`` returns ``(meta, arrays)``."""

    def __init__(self, max_data_bytes: int | None = None, max_header_bytes: int = MAX_HEADER_BYTES,
                 max_tensors: int = MAX_TENSORS):
        self._max_data_bytes = max_data_bytes
        self._max_header_bytes = max_header_bytes
        self._max_tensors = max_tensors
        self._header: _Header | None = None
        self._single: memoryview | None = None
        self._buffer: np.ndarray | None = None
        self._filled = 0
        self._chunks = 0

    def feed(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        self._chunks += 1
        if self._header is None:
            self._header, start = _parse_header(view, self._max_header_bytes, self._max_tensors)
            if self._max_data_bytes is not None and self._header.data_bytes > self._max_data_bytes:
                raise WireError(
                    "data_bytes", self._header.data_bytes, f"at most {self._max_data_bytes} bytes are accepted"
                )
            rest = view[start:]
            if len(rest) == self._header.data_bytes:
                self._single = rest
                self._filled = len(rest)
                return
            self._buffer = _allocate(self._header.data_bytes)
            view = rest
        elif self._single is not None:
            self._buffer = _allocate(self._header.data_bytes)
            self._buffer[: self._filled] = np.frombuffer(self._single, dtype=np.uint8)
            self._single = None
        end = self._filled + len(view)
        if end > self._header.data_bytes:
            raise WireError(
                "data_bytes",
                self._header.data_bytes,
                f"the header declares {self._header.data_bytes} data bytes but at least {end} arrived",
            )
        if len(view):
            assert self._buffer is not None, "allocated above, or for an earlier chunk"
            self._buffer[self._filled : end] = np.frombuffer(view, dtype=np.uint8)
        self._filled = end

    def finish(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        if self._header is None:
            raise WireError("frame", b"", "an empty stream carries no message; expected at least a header chunk")
        header = self._header
        if self._filled != header.data_bytes:
            raise WireError(
                "data_bytes",
                header.data_bytes,
                f"message truncated: the header declares {header.data_bytes} data bytes but {self._filled} arrived",
            )
        source: Any = self._single if self._single is not None else self._buffer
        arrays = []
        for i, (dtype, shape, offset, _) in enumerate(header.tensors):
            count = math.prod(shape)
            try:
                arrays.append(np.frombuffer(source, dtype=_DTYPES[dtype], count=count, offset=offset).reshape(shape))
            except (ValueError, MemoryError) as err:  # the header checks should have refused it already
                raise WireError(f"tensors[{i}].shape", list(shape), f"cannot be read from the data section ({err})") from None
        return header.meta, arrays


def _allocate(data_bytes: int) -> np.ndarray:
    try:
        return np.empty(data_bytes, dtype=np.uint8)
    except (MemoryError, ValueError) as err:
        raise WireError("data_bytes", data_bytes, f"cannot allocate the declared data section ({err})") from None


class _Header(NamedTuple):
    """A checked header: ``tensors`` holds ``(dtype, shape, offset, nbytes)`` per tensor."""

    meta: dict[str, Any]
    tensors: list[tuple[str, tuple[int, ...], int, int]]
    data_bytes: int


_HEADER_KEYS = frozenset(MessageHeader.model_fields)
_TENSOR_KEYS = frozenset(TensorHeader.model_fields)


def _plain_header(raw: Any) -> _Header | None:
    """The header if ``raw`` is plainly well-typed (what every kubeps peer sends), else None.

    The fast path of every RPC: plain type checks instead of a pydantic validation. Anything unusual (a missing
    or extra field, a wrong type, a value pydantic would coerce) returns None, and :class:`MessageHeader` then
    decides, with its error messages; both accept the same frames."""
    if type(raw) is not dict or not raw.keys() <= _HEADER_KEYS:
        return None
    meta, tensors, data_bytes = raw.get("meta", {}), raw.get("tensors", []), raw.get("data_bytes", 0)
    if type(meta) is not dict or type(tensors) is not list or type(data_bytes) is not int:
        return None
    if not 0 <= data_bytes <= _MAX_SIZE:
        return None
    table = []
    for t in tensors:
        if type(t) is not dict or t.keys() != _TENSOR_KEYS:
            return None
        dtype, shape, offset, nbytes = t["dtype"], t["shape"], t["offset"], t["nbytes"]
        if type(dtype) is not str or dtype not in _DTYPES or type(shape) is not list:
            return None
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
            return None
        for d in shape:
            if type(d) is not int or d < 0:
                return None
        table.append((dtype, tuple(shape), offset, nbytes))
    return _Header(meta, table, data_bytes)


def _validated_header(raw: Any) -> _Header:
    """The header checked by :class:`MessageHeader` (pydantic), or a :class:`WireError` naming the field."""
    try:
        header = MessageHeader.model_validate(raw)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or "header"
        raise WireError(field, first.get("input"), first["msg"]) from None
    return _Header(header.meta, [(t.dtype, t.shape, t.offset, t.nbytes) for t in header.tensors], header.data_bytes)


def _parse_header(view: memoryview, max_header_bytes: int = MAX_HEADER_BYTES,
                  max_tensors: int = MAX_TENSORS) -> tuple[_Header, int]:
    if len(view) < _PREFIX.size:
        raise WireError("frame", bytes(view[:16]), f"message truncated: a frame starts with {_PREFIX.size} bytes")
    magic, length = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireError("magic", bytes(magic), f"a kubeps frame starts with {MAGIC!r}")
    if length > max_header_bytes:
        raise WireError("header_length", length, f"at most {max_header_bytes} bytes")
    end = _PREFIX.size + length
    if len(view) < end:
        raise WireError("header_length", length, f"message truncated: only {len(view) - _PREFIX.size} header bytes")
    text = bytes(view[_PREFIX.size : end])
    containers = text.count(b"[") + text.count(b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise WireError("header", text[:60], f"holds {containers} arrays and objects (opening brackets); at most "
                        f"{MAX_JSON_CONTAINERS} allowed")
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise WireError("header", text[:60], f"must be JSON ({type(err).__name__}: {err})") from None
    tensors = raw.get("tensors") if type(raw) is dict else None
    if type(tensors) is list and len(tensors) > max_tensors:
        raise WireError("tensors", f"{len(tensors)} tensors", f"a request carries at most {max_tensors} "
                        "(KUBEPS_MAX_TENSORS on a server)")
    depth = _json_depth(text) if containers > MAX_JSON_DEPTH else 0
    if depth > MAX_JSON_DEPTH:
        raise WireError("header", text[:60], f"nests arrays and objects {depth} deep; at most {MAX_JSON_DEPTH} allowed")
    header = _plain_header(raw) or _validated_header(raw)
    _check_tensor_table(header)
    return header, _align(end)


def _json_depth(text: bytes) -> int:
    """How deep arrays and objects nest in a JSON text that :func:`json.loads` accepted (brackets inside strings
    skipped): deep nesting makes anything walking the parsed header recurse past Python's limit. A few vectorised
    passes over the bytes (numpy), linear and in C whatever the text: a quote escaped by an odd run of backslashes is
    not a string's end, so the bytes between the real quotes are inside strings. The caller runs it only when the
    text holds more brackets than the limit."""
    data = np.frombuffer(text, dtype=np.uint8)
    position = np.arange(data.size)
    backslash = data == 0x5C
    # the backslashes in a row that end at each byte (0 where the byte is no backslash)
    run = position - np.maximum.accumulate(np.where(backslash, -1, position))
    escaped = np.zeros(data.size, dtype=bool)
    escaped[1:] = (run[:-1] & 1).astype(bool)
    quote = (data == 0x22) & ~escaped
    outside = ((np.cumsum(quote) - quote) & 1) == 0  # an even number of real quotes before the byte
    opens = ((data == 0x5B) | (data == 0x7B)) & outside
    closes = ((data == 0x5D) | (data == 0x7D)) & outside
    return int(np.cumsum(opens.astype(np.int32) - closes).max(initial=0))


def _check_tensor_table(header: _Header) -> None:
    position = 0
    for i, (dtype, shape, offset, nbytes) in enumerate(header.tensors):
        itemsize = _DTYPES[dtype].itemsize
        if len(shape) > MAX_RANK:
            raise WireError(f"tensors[{i}].shape", list(shape), f"at most {MAX_RANK} dimensions are allowed")
        # numpy multiplies the non-zero dimensions (and the item size) and refuses a product past intp, even when
        # another dimension is 0: [2**40, 2**40, 0] holds nothing but cannot be made
        expected = math.prod(shape) * itemsize
        if (expected or math.prod(d for d in shape if d) * itemsize) > _MAX_SIZE:
            raise WireError(f"tensors[{i}].shape", list(shape),
                            f"the product of the non-zero dimensions times the item size must be at most {_MAX_SIZE}")
        if nbytes != expected:
            raise WireError(f"tensors[{i}].nbytes", nbytes, f"shape {list(shape)} of {dtype} needs exactly {expected} bytes")
        if offset < position or offset % _ALIGN:
            raise WireError(f"tensors[{i}].offset", offset, f"must be a multiple of {_ALIGN} at or after byte {position}")
        position = offset + nbytes
        if position > header.data_bytes:
            raise WireError(
                f"tensors[{i}].nbytes",
                nbytes,
                f"tensor ends at byte {position}, past the declared data section of {header.data_bytes} bytes",
            )


def decode_chunks(chunks: Iterable[bytes], max_data_bytes: int | None = None, max_header_bytes: int = MAX_HEADER_BYTES,
                  max_tensors: int = MAX_TENSORS) -> tuple[dict[str, Any], list[np.ndarray]]:
    decoder = MessageDecoder(max_data_bytes, max_header_bytes, max_tensors)
    for chunk in chunks:
        decoder.feed(chunk)
    return decoder.finish()


def decode_message(frame: bytes) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Decode a frame received as one buffer (zero-copy)."""
    return decode_chunks([frame])
