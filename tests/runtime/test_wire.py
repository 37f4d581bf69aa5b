"""Tensor framing: round trips, chunking, and malformed payloads that must name the field."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from kubeps.runtime.rpc import wire
from kubeps.runtime.rpc.wire import WireError, decode_chunks, decode_message, encode_chunks

pytestmark = pytest.mark.timeout(60)


def _frame(meta, arrays):
    return b"".join(encode_chunks(meta, arrays, chunk_bytes=1 << 30))


def test_round_trip_every_dtype_and_shape():
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((3, 5)).astype(dt) for dt in ("float16", "float32", "float64")]
    arrays += [np.arange(7, dtype=dt) for dt in ("int8", "int16", "int32", "int64", "uint8", "uint64")]
    arrays += [np.array(True), np.zeros((0, 4), np.float32), np.array([1 + 2j], np.complex64), np.float64(3.5)]
    arrays += [np.arange(12, dtype=np.float32).reshape(3, 4).T]  # non-contiguous input
    meta, out = decode_message(_frame({"k": [1, "two", None]}, arrays))
    assert meta == {"k": [1, "two", None]}
    assert len(out) == len(arrays)
    for a, b in zip(arrays, out):
        a = np.asarray(a)
        assert b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(a, b)


def test_single_chunk_decodes_without_copy():
    frame = _frame({}, [np.arange(1000, dtype=np.float64)])
    _, (arr,) = decode_message(frame)
    assert not arr.flags.writeable  # a view on the received bytes
    assert arr.base is not None


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_chunked_round_trip(chunk):
    arrays = [np.arange(3000, dtype=np.int32), np.ones((17, 3), np.float32), np.zeros(0, np.int64)]
    chunks = encode_chunks({"x": 1}, arrays, chunk_bytes=chunk)
    assert len(chunks) > 1
    header_chunk = chunks[0]
    assert header_chunk.startswith(wire.MAGIC)
    assert all(len(c) <= chunk for c in chunks[1:])
    meta, out = decode_chunks(chunks)
    assert meta == {"x": 1}
    for a, b in zip(arrays, out):
        np.testing.assert_array_equal(a, b)
        assert b.flags.writeable


def test_big_frame_chunks_at_default_size():
    big = np.zeros(3 * wire.DEFAULT_CHUNK_BYTES // 4 + 11, np.float32)
    chunks = encode_chunks({}, [big])
    assert len(chunks) == 4
    _, (out,) = decode_chunks(chunks)
    assert out.shape == big.shape


def _rewrite_header(frame: bytes, mutate) -> bytes:
    magic, length = struct.unpack_from("<4sI", frame)
    header = json.loads(frame[8 : 8 + length])
    mutate(header)
    new = json.dumps(header).encode()
    head = struct.pack("<4sI", magic, len(new)) + new
    pad = (-len(head)) % 8
    old_start = 8 + length + ((-(8 + length)) % 8)
    return head + b"\0" * pad + frame[old_start:]


@pytest.mark.parametrize(
    "mutate, field, text",
    [
        (lambda h: h["tensors"][0].update(dtype="object"), "tensors.0.dtype", "'object' is not allowed"),
        (lambda h: h["tensors"][0].update(dtype="float64"), "tensors[0].nbytes", "needs exactly 32 bytes"),
        (lambda h: h["tensors"][0].update(shape=[5]), "tensors[0].nbytes", "needs exactly 20 bytes"),
        (lambda h: h["tensors"][0].update(shape=[-4]), "tensors.0.shape", "negative dimension"),
        (lambda h: h["tensors"][0].update(offset=3), "tensors[0].offset", "multiple of 8"),
        (lambda h: h.update(data_bytes=8), "tensors[0].nbytes", "past the declared data section"),
        (lambda h: h.update(extra=1), "extra", "Extra inputs are not permitted"),
    ],
)
def test_malformed_header_names_field(mutate, field, text):
    frame = _rewrite_header(_frame({}, [np.arange(4, dtype=np.float32)]), mutate)
    with pytest.raises(WireError) as info:
        decode_message(frame)
    assert info.value.field == field
    assert text in str(info.value)


def test_truncated_and_overlong_payloads():
    frame = _frame({}, [np.arange(100, dtype=np.float32)])
    with pytest.raises(WireError, match="truncated: the header declares 400 data bytes but 200 arrived"):
        decode_message(frame[:-200])
    with pytest.raises(WireError, match="field 'data_bytes'.*at least 401"):
        decode_chunks([frame, b"x"])
    with pytest.raises(WireError, match="field 'magic'"):
        decode_message(b"XXXX" + frame[4:])
    with pytest.raises(WireError, match="field 'frame'"):
        decode_message(b"KP")
    with pytest.raises(WireError, match="field 'header_length'"):
        decode_message(frame[:12])
    with pytest.raises(WireError, match="field 'header'.*must be JSON"):
        decode_message(struct.pack("<4sI", wire.MAGIC, 3) + b"{{{")
    with pytest.raises(WireError, match="empty stream"):
        decode_chunks([])


def test_encode_refuses_object_arrays_and_bad_meta():
    with pytest.raises(WireError, match=r"tensors\[1\].dtype.*allowed dtypes"):
        encode_chunks({}, [np.zeros(1), np.array([object()])])
    with pytest.raises(WireError, match="field 'meta'"):
        encode_chunks({"f": object()}, [])


def test_big_endian_input_is_sent_little_endian():
    a = np.arange(5, dtype=">i4")
    _, (out,) = decode_message(_frame({}, [a]))
    assert out.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(out, a)


def test_dtype_names_are_right_whichever_byte_order_came_first():
    """The encoder remembers the wire name of each dtype it met: a big-endian dtype met after its little-endian twin
    (equal kinds, different byte order) is still swapped, and a native-order or Python-list input is named alike."""
    values = np.arange(6)
    for dtype in ("<i4", ">i4", "=i4", "<i4", ">f8", "<f8", "=f8"):
        _, (out,) = decode_message(_frame({}, [values.astype(dtype)]))
        assert out.dtype == np.dtype(dtype).newbyteorder("<")
        np.testing.assert_array_equal(out, values)
    _, (listed, scalar) = decode_message(_frame({}, [[1.5, 2.5], np.float32(3)]))
    assert listed.dtype == np.float64 and scalar.dtype == np.float32 and scalar.shape == ()
    with pytest.raises(WireError, match=r"tensors\[0\].dtype.*allowed dtypes"):
        encode_chunks({}, [np.array(["a"])])
    with pytest.raises(WireError, match=r"tensors\[0\].dtype.*allowed dtypes"):
        encode_chunks({}, [np.zeros(2, dtype=">U3")])


def _raw_frame(header: dict, data: bytes = b"") -> bytes:
    body = json.dumps(header).encode()
    head = struct.pack("<4sI", wire.MAGIC, len(body)) + body
    return head + b"\0" * ((-len(head)) % 8) + data


@pytest.mark.parametrize(
    "header, data, field",
    [
        ({"data_bytes": -5}, b"", "data_bytes"),
        ({"data_bytes": 10**30}, b"", "data_bytes"),
        ({"data_bytes": 2**63}, b"", "data_bytes"),
        ({"tensors": [{"dtype": "float32", "shape": [0, 10**30], "offset": 0, "nbytes": 0}]}, b"", "tensors[0].shape"),
        ({"tensors": [{"dtype": "float32", "shape": [2**70], "offset": 0, "nbytes": 4 * 2**70}],
          "data_bytes": 4 * 2**70}, b"", "data_bytes"),
        ({"data_bytes": 1 << 60}, b"", "data_bytes"),  # in range, but no machine can allocate it
        ({"tensors": [{"dtype": "float32", "shape": [1] * 65, "offset": 0, "nbytes": 4}], "data_bytes": 8},
         b"\0" * 8, "tensors[0].shape"),
    ],
)
def test_absurd_sizes_and_ranks_are_wire_errors(header, data, field):
    """Sizes numpy cannot allocate and ranks it cannot represent are malformed frames (WireError, which servers
    answer INVALID_ARGUMENT), not a bare ValueError from numpy escaping the decoder."""
    frame = _raw_frame(header, data)
    for chunks in ([frame], [frame[: len(frame) - len(data)], data]):  # one chunk, and header then data
        with pytest.raises(WireError) as info:
            decode_chunks(chunks)
        assert info.value.field == field


@pytest.mark.parametrize("mutate, strict_refusal", [
    (lambda h: None, False),
    (lambda h: h["tensors"][0].update(shape=[4.0]), True),  # an int is an int: no path coerces a float
    (lambda h: h["tensors"][0].update(nbytes=16.0), True),
    (lambda h: h["tensors"][0].update(offset=True), True),
    (lambda h: h.pop("meta"), False),
    (lambda h: h["meta"].update(nested={"a": [1, 2.5, None, "x"]}), False),
])
def test_fast_header_path_agrees_with_the_model(mutate, strict_refusal):
    """Frames take a plain-checks fast path; whatever it does not plainly accept goes to the pydantic model. Both
    must decode a frame to the same header, and the fast path may never accept what the model refuses."""
    frame = _rewrite_header(_frame({"k": 1}, [np.arange(4, dtype=np.float32)]), mutate)
    length = struct.unpack_from("<4sI", frame)[1]
    raw = json.loads(frame[8 : 8 + length])
    fast = wire._plain_header(raw)
    if strict_refusal:
        assert fast is None
        with pytest.raises(WireError, match="valid integer"):
            decode_message(frame)
        return
    assert fast is None or fast == wire._validated_header(raw)
    meta, (array,) = decode_message(frame)
    np.testing.assert_array_equal(array, np.arange(4, dtype=np.float32))
    assert meta == raw.get("meta", {})
