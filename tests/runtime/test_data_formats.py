"""Input files: Parquet, TFRecord of tf.Example and typed CSV, read in blocks, sharded exactly between workers,
read in parallel in a deterministic order, and read from a real S3-compatible server (versitygw, built by
hack/s3server.sh) on loopback."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kubeps.runtime as kp
from kubeps.runtime.data import (
    AutoShardPolicy, ColumnValueError, CorruptRecordError, CsvDataset, FixedLenFeature, ParquetDataset,
    TFRecordDataset, TFRecordWriter, VarLenFeature, auto_shard, parse_example, serialize_example, to_ragged, to_sparse,
)
from kubeps.runtime.data.file_blocks import FileBlocksNode
from kubeps.runtime.data.sources import FileListNode

REPO = Path(__file__).resolve().parents[2]
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
google_crc32c = pytest.importorskip("google_crc32c")


# -- CSV ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(params=["pyarrow", "python"])
def csv_path(request, monkeypatch):
    """Every CSV test runs on both readers: pyarrow's (when installed) and the python path it falls back to."""
    if request.param == "python":
        from kubeps.runtime.data import csvfiles

        monkeypatch.setattr(csvfiles, "_pyarrow_csv", lambda: None)
    return request.param


def test_csv_pyarrow_hands_the_rest_of_the_file_to_the_python_path_once(tmp_path, csv_path):
    path = tmp_path / "mixed.csv"
    lines = [f"{i},{i * 0.5},n{i}" for i in range(100)]
    lines[57] += ",more"  # pyarrow's reader wants every row as wide as the first; select_cols takes wider rows
    lines.insert(30, "")  # blank lines are skipped by both
    path.write_text("\n".join(lines) + "\n")
    ds = CsvDataset(str(path), [np.int64, np.float32, ""], select_cols=[0, 1, 2], block_rows=16)
    blocks = list(ds._node.blocks())
    ids = np.concatenate([b[0] for b in blocks])
    assert ids.tolist() == list(range(100))
    assert np.concatenate([b[2] for b in blocks]).tolist() == [f"n{i}" for i in range(100)]
    path.write_text("1,2,a\n3,4,b,extra\n")
    with pytest.raises(ColumnValueError, match=r"line 2: 4 fields, expected 3"):
        list(CsvDataset(str(path), [np.int64, np.int64, ""]))
    assert [b[0].tolist() for b in CsvDataset(str(path), [np.int64, ""], select_cols=[0, 2])._node.blocks()] == [[1, 3]]
    path.write_text("a,b\n")
    assert list(CsvDataset(str(path), [np.int64, np.int64], header=True)) == []
    path.write_text("")
    assert list(CsvDataset(str(path), [np.int64, np.int64])) == []


def test_csv_refuses_an_id_float32_would_round_and_int64_keeps_it(tmp_path, csv_path):
    path = tmp_path / "ids.csv"
    path.write_text("16777216,1\n16777217,0\n")
    with pytest.raises(ColumnValueError) as err:
        list(CsvDataset(str(path), [np.float32, np.float32]))
    message = str(err.value)
    assert f"{path}: line 2, column 0" in message and "16777217" in message and "float32" in message
    ids, labels = next(iter(CsvDataset(str(path), [np.int64, np.float32]).batch(2)))
    assert ids.dtype == np.int64 and ids.tolist() == [16777216, 16777217]
    assert labels.dtype == np.float32 and labels.tolist() == [1.0, 0.0]


def test_csv_defaults_names_select_cols_and_header(tmp_path, csv_path):
    path = tmp_path / "rows.csv"
    path.write_text("id,score,name,label\n1,0.5,a,1\n2,,b,0\n3,2.25,\"c,d\",1\n")
    ds = CsvDataset(str(path), [np.int64, -1.0, ""], header=True, select_cols=[0, 1, 2], names=["id", "score", "name"])
    (batch,) = list(ds.batch(10))
    assert batch["id"].tolist() == [1, 2, 3]
    assert batch["score"].dtype == np.float32 and batch["score"].tolist() == [0.5, -1.0, 2.25]
    assert batch["name"].tolist() == ["a", "b", "c,d"]


def test_csv_errors_name_file_line_column_and_value(tmp_path, csv_path):
    path = tmp_path / "bad.csv"
    path.write_text("1,2\n3,4.5\n")
    with pytest.raises(ColumnValueError, match=r"line 2, column 1: value '4.5' is not an integer"):
        list(CsvDataset(str(path), [np.int64, np.int64]))
    path.write_text("1,2\n,4\n")
    with pytest.raises(ColumnValueError, match=r"line 2, column 0: the field is empty and the column is required"):
        list(CsvDataset(str(path), [np.int64, np.int64]))
    path.write_text("1,2\n300,4\n")
    with pytest.raises(ColumnValueError, match=r"value 300 \(int64\) does not fit the column's dtype int8"):
        list(CsvDataset(str(path), [np.int8, np.int64]))
    path.write_text("1,2\n3\n")
    with pytest.raises(ColumnValueError, match=r"line 2: 1 fields, expected 2"):
        list(CsvDataset(str(path), [np.int64, np.int64]))


def test_csv_blocks_feed_a_vectorised_batch(tmp_path, csv_path):
    path = tmp_path / "n.csv"
    path.write_text("".join(f"{i},{i * 0.5}\n" for i in range(1000)))
    ds = CsvDataset(str(path), [np.int64, np.float32], block_rows=256)
    blocks = list(ds._node.blocks())
    assert [len(b[0]) for b in blocks] == [256, 256, 256, 232]
    ids = np.concatenate([b[0] for b in ds.batch(100)])
    assert ids.tolist() == list(range(1000))


def test_csv_blocks_are_cut_across_pyarrows_batches(tmp_path, csv_path):
    """A file of a few MB: pyarrow parses it in batches of about 1 MB, which the blocks of ``block_rows`` rows
    straddle; every block but the last has exactly ``block_rows`` rows, and every row, of every column, is there
    once, in order."""
    rows = 120_000
    path = tmp_path / "big.csv"
    path.write_text("".join(f"{i},{i * 0.25},name-{i % 997}\n" for i in range(rows)))
    assert path.stat().st_size > 2 << 20
    blocks = list(CsvDataset(str(path), [np.int64, np.float32, ""], block_rows=7000)._node.blocks())
    assert [len(b[0]) for b in blocks] == [7000] * (rows // 7000) + [rows % 7000]
    assert np.concatenate([b[0] for b in blocks]).tolist() == list(range(rows))
    assert np.array_equal(np.concatenate([b[1] for b in blocks]), np.arange(rows, dtype=np.float32) * 0.25)
    assert np.concatenate([b[2] for b in blocks]).tolist() == [f"name-{i % 997}" for i in range(rows)]


# -- Parquet ------------------------------------------------------------------------------------------------------------
def write_parquet(path, start, rows, row_group_size=64):
    ids = np.arange(start, start + rows, dtype=np.int64)
    table = pa.table({
        "id": ids,
        "dense": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 3).astype(np.float32)), 3),
        "tags": pa.array([list(range(i % 4)) for i in ids], type=pa.list_(pa.int64())),
        "label": (ids % 2).astype(np.float32),
        "note": [f"n{i}" for i in ids],
    })
    pq.write_table(table, str(path), row_group_size=row_group_size)


def test_parquet_columns_selected_typed_and_read_by_row_group(tmp_path):
    path = tmp_path / "part-0.parquet"
    write_parquet(path, 0, 200, row_group_size=64)
    ds = ParquetDataset(str(path), columns={"id": np.int64, "dense": None, "tags": np.int32})
    blocks = list(ds._node.blocks())
    assert [len(b["id"]) for b in blocks] == [64, 64, 64, 8]  # one block per row group
    assert set(blocks[0]) == {"id", "dense", "tags"}
    batch = next(iter(ds.batch(5)))
    assert batch["id"].tolist() == [0, 1, 2, 3, 4]
    assert batch["dense"].shape == (5, 3) and batch["dense"].dtype == np.float32
    values, splits = to_ragged(batch["tags"])
    assert values.dtype == np.int32 and values.tolist() == [0, 0, 1, 0, 1, 2] and splits.tolist() == [0, 0, 1, 3, 6, 6]
    indices, sparse_values, shape = to_sparse(batch["tags"])
    assert indices.tolist() == [[1, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2]] and shape.tolist() == [5, 3]
    assert sparse_values.tolist() == values.tolist()


def test_parquet_refuses_values_the_dtype_does_not_hold_and_names_missing_columns(tmp_path):
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"id": np.array([1, 16777217], dtype=np.int64)}), str(path))
    with pytest.raises(ColumnValueError, match=r"row group 0, row 1, column 'id': value 16777217 .* float32"):
        list(ParquetDataset(str(path), columns={"id": np.float32}))
    assert next(iter(ParquetDataset(str(path), columns={"id": np.int64}).batch(2)))["id"].tolist() == [1, 16777217]
    with pytest.raises(ColumnValueError, match=r"no column\(s\) \['label'\] .* columns are \['id'\]"):
        list(ParquetDataset(str(path), columns=["label"]))
    pq.write_table(pa.table({"id": pa.array([1, None], type=pa.int64())}), str(path))
    with pytest.raises(ColumnValueError, match=r"row 1, column 'id': value is null"):
        list(ParquetDataset(str(path)))


# -- TFRecord -----------------------------------------------------------------------------------------------------------
def test_crc32c_known_vectors():
    # RFC 3720 B.4 and the common check value of CRC-32C
    assert google_crc32c.value(b"123456789") == 0xE3069283
    assert google_crc32c.value(bytes(32)) == 0x8A9136AA
    assert google_crc32c.value(b"\xff" * 32) == 0x62A8AB43
    from kubeps.runtime.data.tfrecord import masked_crc32c

    assert masked_crc32c(b"") == 0xA282EAD8  # crc 0, masked: the mask delta alone


def _masked(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _frame(data: bytes) -> bytes:
    """TFRecord framing written independently of kubeps (record_writer.cc's layout)."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked(length)) + data + struct.pack("<I", _masked(data))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _example(features: dict) -> bytes:
    """A tf.Example encoded by hand from the protobuf wire format (example.proto/feature.proto)."""
    entries = b""
    for name, (kind, values) in sorted(features.items()):
        if kind == "int64":
            body = _ld(3, _ld(1, b"".join(_varint(v) for v in values)))
        elif kind == "float":
            body = _ld(2, _ld(1, struct.pack(f"<{len(values)}f", *values)))
        else:
            body = _ld(1, b"".join(_ld(1, v) for v in values))
        entries += _ld(1, _ld(1, name.encode()) + _ld(2, body))
    return _ld(1, entries)


SPEC = {"ids": FixedLenFeature([2], np.int64), "dense": FixedLenFeature([], np.float32),
        "tags": VarLenFeature(np.int64), "name": FixedLenFeature([], bytes, default_value=b"?")}


def _record(i: int) -> bytes:
    features = {"ids": ("int64", [i, -i]), "dense": ("float", [i / 4]), "tags": ("int64", list(range(i % 3)))}
    if i % 2:
        features["name"] = ("bytes", [f"r{i}".encode()])
    return _example(features)


def test_tfrecord_hand_built_file_parses_with_the_spec_and_the_writer_matches(tmp_path):
    path = tmp_path / "data.tfrecord"
    records = [_record(i) for i in range(5)]
    path.write_bytes(b"".join(_frame(r) for r in records))
    (batch,) = list(TFRecordDataset(str(path), features=SPEC).batch(5))
    assert batch["ids"].dtype == np.int64 and batch["ids"].tolist() == [[i, -i] for i in range(5)]
    assert batch["dense"].dtype == np.float32 and batch["dense"].tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert batch["name"].tolist() == [b"?", b"r1", b"?", b"r3", b"?"]
    values, splits = to_ragged(batch["tags"])
    assert values.tolist() == [0, 0, 1, 0] and splits.tolist() == [0, 0, 1, 3, 3, 4]
    # raw records, then tf.io.parse_example's way: batch the serialized records, parse the batch
    raw = next(iter(TFRecordDataset(str(path)).batch(5)))
    assert list(raw) == records
    assert parse_example(raw, SPEC)["ids"].tolist() == batch["ids"].tolist()
    # kubeps' writer writes the same bytes as the hand-built framing
    out = tmp_path / "written.tfrecord"
    with TFRecordWriter(str(out)) as writer:
        for r in records:
            writer.write(r)
    assert out.read_bytes() == path.read_bytes()
    # and serialize_example round-trips through the hand-checked parser
    again = parse_example([serialize_example({"ids": [7, -7], "dense": 1.5, "tags": [4, 5]})], SPEC)
    assert again["ids"].tolist() == [[7, -7]] and again["dense"].tolist() == [1.5]


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_tfrecord_compressed(tmp_path, compression):
    path = tmp_path / "c.tfrecord"
    with TFRecordWriter(str(path), compression_type=compression) as writer:
        writer.write_all(_record(i) for i in range(50))
    batch = next(iter(TFRecordDataset(str(path), compression_type=compression, features=SPEC).batch(50)))
    assert batch["ids"][:, 0].tolist() == list(range(50))


def test_tfrecord_corruption_is_detected_named_or_skipped(tmp_path):
    path = tmp_path / "bad.tfrecord"
    frames = [_frame(_record(i)) for i in range(4)]
    data = bytearray(b"".join(frames))
    third = len(frames[0]) + len(frames[1])
    data[third + 14] ^= 0x01  # a data byte of record 2
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError, match=rf"{path}: corrupt TFRecord record at byte offset {third}: the data's CRC"):
        list(TFRecordDataset(str(path), features=SPEC))
    kept = list(TFRecordDataset(str(path), features=SPEC, skip_corrupt=True).batch(10))[0]
    assert kept["ids"][:, 0].tolist() == [0, 1, 3]
    data = bytearray(b"".join(frames))
    data[len(frames[0]) + 2] ^= 0x40  # the length of record 1: the rest of the file cannot be framed
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError, match=rf"offset {len(frames[0])}: the length's CRC"):
        list(TFRecordDataset(str(path)))
    assert len(list(TFRecordDataset(str(path), skip_corrupt=True))) == 1
    path.write_bytes(b"".join(frames)[:-3])  # truncated
    with pytest.raises(CorruptRecordError, match=r"ends inside a record"):
        list(TFRecordDataset(str(path)))


def _reference_records(data: bytes, skip: bool):
    """Records of a TFRecord file read one frame at a time, written independently of kubeps: (offsets, records,
    warnings, error)."""
    offsets, records, notes, at = [], [], [], 0
    while at < len(data):
        if len(data) - at < 12 or len(data) - at < 16 + struct.unpack_from("<Q", data, at)[0] and (
                struct.unpack_from("<I", data, at + 8)[0] == _masked(data[at : at + 8])):
            what = f"offset {at}: the file ends inside a record"
            if not skip:
                return offsets, records, notes, what
            notes.append(what)
            break
        (length,) = struct.unpack_from("<Q", data, at)
        if struct.unpack_from("<I", data, at + 8)[0] != _masked(data[at : at + 8]):
            what = f"offset {at}: the length's CRC"
            if not skip:
                return offsets, records, notes, what
            notes.append(what)
            break
        record = data[at + 12 : at + 12 + length]
        if struct.unpack_from("<I", data, at + 12 + length)[0] != _masked(record):
            if not skip:
                return offsets, records, notes, f"offset {at}: the data's CRC"
            notes.append(f"offset {at}: the data's CRC")
        else:
            offsets.append(at)
            records.append(record)
        at += 16 + length
    return offsets, records, notes, None


@pytest.mark.parametrize("damage", ["none", "data", "two data", "length", "truncated"])
@pytest.mark.parametrize("skip", [False, True])
def test_read_records_matches_a_frame_by_frame_reader_across_buffers(tmp_path, monkeypatch, caplog, damage, skip):
    """Records of many lengths (a length's CRC is checked once per length, the data's CRCs a buffer at a time)
    across buffers that end inside frames: the same records, offsets, chunks and errors, in file order, as a
    reader of one frame at a time."""
    from kubeps.runtime.data import tfrecord

    monkeypatch.setattr(tfrecord, "_CHUNK", 97)
    records = [bytes([i % 251]) * (i % 40) for i in range(300)]
    frames = [_frame(r) for r in records]
    data = bytearray(b"".join(frames))
    starts = np.cumsum([0] + [len(f) for f in frames]).tolist()
    if damage in ("data", "two data"):
        data[starts[120] + 12 + 5] ^= 0x10
    if damage == "two data":
        data[starts[250] + 12] ^= 0x01
    if damage == "length":
        data[starts[200] + 1] ^= 0x01
    if damage == "truncated":
        data = data[:-7]
    path = tmp_path / "r.tfrecord"
    path.write_bytes(bytes(data))
    want_offsets, want_records, want_notes, want_error = _reference_records(bytes(data), skip)
    got_offsets, got_records, chunks = [], [], []
    with caplog.at_level("WARNING", logger="kubeps.data"):
        try:
            for offsets, chunk in tfrecord.read_records(str(path), skip_corrupt=skip, chunk_records=64):
                chunks.append(len(chunk))
                got_offsets += offsets
                got_records += chunk
            error = None
        except CorruptRecordError as err:
            error = str(err)
    if want_error is not None:  # the error ends the reading: the chunk it was filling is not handed out
        whole = len(want_records) // 64 * 64
        want_offsets, want_records = want_offsets[:whole], want_records[:whole]
    assert got_offsets == want_offsets and got_records == want_records
    assert chunks[:-1] == [64] * (len(chunks) - 1)  # full chunks but the last (and none empty)
    if want_error is None:
        assert error is None
    else:
        assert error is not None and want_error in error and error.startswith(f"{path}: corrupt TFRecord record at byte")
    assert [n for n in want_notes if not any(n in r.getMessage() for r in caplog.records)] == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.floats(), st.integers(-(1 << 60), 1 << 60).map(float),
                          st.integers(-(1 << 26), 1 << 26).map(float)), max_size=40),
       st.sampled_from([np.float32, np.float16]))
def test_a_narrower_float_dtype_refuses_exactly_the_values_it_would_change(values, dtype):
    """float64 values read as float32 (or float16): refused are those that overflow it and the whole numbers it
    rounds; fractions, infinities and NaN are taken (a float column holds floats, rounded)."""
    from kubeps.runtime.data.columns import _bad_rows

    def refused(v: float) -> bool:
        with np.errstate(over="ignore"):
            narrow = float(np.float64(v).astype(dtype))
        return np.isfinite(v) and (not np.isfinite(narrow) or (v.is_integer() and narrow != v))

    assert _bad_rows(np.array(values, dtype=np.float64), np.dtype(dtype)).tolist() == \
        [i for i, v in enumerate(values) if refused(v)]


def test_length_crcs_from_the_table_are_each_lengths_own():
    """The masked CRCs of all lengths below 2**16, built from 513 CRCs by CRC-32C being affine, are those of each
    length field computed on its own; longer lengths are computed on their own."""
    from kubeps.runtime.data import tfrecord

    lengths = np.arange(1 << 16, dtype=np.int64)
    assert tfrecord._length_crcs(lengths).tolist() == [_masked(struct.pack("<Q", n)) for n in range(1 << 16)]
    big = np.array([5, 1 << 16, 1 << 33], dtype=np.int64)
    assert tfrecord._length_crcs(big).tolist() == [_masked(struct.pack("<Q", n)) for n in big.tolist()]


def _walked(buf: bytes):
    """The frames a walk from offset 0 takes in ``buf`` (those that fit), and where it stops."""
    at, starts = 0, []
    while at + 12 <= len(buf) and at + 16 + struct.unpack_from("<Q", buf, at)[0] <= len(buf):
        starts.append(at)
        at += 16 + struct.unpack_from("<Q", buf, at)[0]
    return starts, at


def test_frames_found_by_numpy_are_the_walks_or_none():
    """numpy's frames (headers found by their zero bytes and length CRC) are the walk's -- with records of zeros,
    a last frame cut short, a last header cut short -- and where they might not be (a record holding a frame, a
    record of 2**16 bytes or more, a bad length CRC) it gives None and the walk decides."""
    from kubeps.runtime.data import tfrecord

    scratch = [np.empty((4, 0), dtype=bool)]
    records = [bytes(i % 7) * (i % 30) + bytes([i % 256]) * (i % 3) for i in range(200)]
    plain = b"".join(_frame(r) for r in records)
    for buf in (plain, plain[:-9], plain[:-len(_frame(records[-1])) + 5], _frame(b""), _frame(b"x") + _frame(b"")):
        found = tfrecord._frames_found(buf, scratch)
        assert found is not None and (found[0].tolist(), found[1]) == _walked(buf)
    inner = _frame(b"a" + _frame(b"hidden") + b"b")  # a record that holds a frame: its header is found too
    long = _frame(bytes(1 << 16))
    bad = bytearray(plain)
    bad[len(_frame(records[0])) + 8] ^= 1  # the second frame's length CRC
    for buf in (_frame(b"x") + inner, long + plain, bytes(bad)):
        assert tfrecord._frames_found(buf, scratch) is None
    assert tfrecord._frames_found(plain[:15], scratch) is None  # shorter than a frame: the walk decides


def test_tfrecord_parse_errors_name_the_record_and_feature(tmp_path):
    path = tmp_path / "x.tfrecord"
    path.write_bytes(_frame(_record(0)) + _frame(_example({"ids": ("int64", [1, 2, 3]), "dense": ("float", [0.0])})))
    with pytest.raises(ColumnValueError, match=rf"byte offset {len(_frame(_record(0)))}: feature 'ids' holds a "
                                               r"int64_list of 3 values; .* exactly 2 values"):
        list(TFRecordDataset(str(path), features=SPEC))
    with pytest.raises(ColumnValueError, match=r"feature 'dense' holds a float_list of 1 values; .* int64"):
        list(TFRecordDataset(str(path), features={"dense": FixedLenFeature([], np.int64)}))
    with pytest.raises(ColumnValueError, match=r"feature 'label' is missing .* no default_value"):
        list(TFRecordDataset(str(path), features={"label": FixedLenFeature([], np.float32)}))


def test_parse_example_block_path_matches_the_record_by_record_path(monkeypatch):
    """A block is parsed by one protobuf call and its lists concatenated in C; the record-by-record path (defaults,
    errors) must give the same columns."""
    from kubeps.runtime.data import example

    rng = np.random.default_rng(3)
    records = [serialize_example({"ids": rng.integers(-(1 << 62), 1 << 62, 4), "dense": rng.random(3).astype(np.float32),
                                  "tags": rng.integers(0, 9, i % 4), "name": [b"x" * (i % 3)] * (i % 2)})
               for i in range(50)]
    spec = {"ids": FixedLenFeature([2, 2], np.int64), "dense": FixedLenFeature([3], np.float64),
            "tags": VarLenFeature(np.int32), "name": VarLenFeature(bytes)}
    block = example._parse_block(records, example.feature_spec(spec))
    assert block is not None
    monkeypatch.setattr(example, "_parse_block", lambda *args: None)
    each = parse_example(records, spec)
    for name in spec:
        assert block[name].dtype == each[name].dtype and block[name].shape == each[name].shape
        for a, b in zip(block[name].reshape(-1), each[name].reshape(-1)):
            assert np.array_equal(a, b)
    # a default to fill, or a value the dtype does not hold: left to the record-by-record path
    assert example._parse_block(records, example.feature_spec({"x": FixedLenFeature([], np.int64, 0)})) is None
    assert example._parse_block(records, example.feature_spec({"ids": FixedLenFeature([4], np.int8)})) is None


# -- the columnar path of parse_example: protobuf's merge of a block, checked, or the record-by-record path --------
def _list(kind: str, values: list, packed: bool = True, runs: int = 1) -> bytes:
    """A Feature holding one list (``kind``: int64, float, bytes; None: no list), packed in ``runs`` runs or
    unpacked, as a hand-made writer may."""
    if kind is None:
        return b""
    if kind == "bytes":
        return _ld(1, b"".join(_ld(1, v) for v in values))
    number, item = (3, _varint) if kind == "int64" else (2, lambda v: struct.pack("<f", v))
    if not packed:
        return _ld(number, b"".join(_varint(1 << 3 | (0 if kind == "int64" else 5)) + item(v) for v in values))
    cut = -(-len(values) // runs) if values else 1
    return _ld(number, b"".join(_ld(1, b"".join(item(v) for v in values[i : i + cut]))
                                for i in range(0, max(len(values), 1), cut) if values or runs))


def _record_of(*entries: tuple[str, bytes]) -> bytes:
    """A tf.Example of ``(name, Feature bytes)`` entries in this order (a map's order is the writer's)."""
    return _ld(1, b"".join(_ld(1, _ld(1, name.encode()) + _ld(2, feature)) for name, feature in entries))


def _each(records, spec):
    """parse_example's record-by-record path alone: its columns, or its error's message."""
    from unittest import mock

    from kubeps.runtime.data import example

    with mock.patch.object(example, "_parse_columns", lambda *a: None), mock.patch.object(example, "_parse_block",
                                                                                          lambda *a: None):
        try:
            return parse_example(records, spec)
        except ColumnValueError as err:
            return str(err)


def _columnar(records, spec):
    from kubeps.runtime.data import example

    return example._parse_columns(records, example.feature_spec(spec))


def _run_of(records):
    """The records framed one after another in one buffer, as read_runs hands them out."""
    from kubeps.runtime.data.tfrecord import RecordRun

    frames = [_frame(r) for r in records]
    at = np.cumsum([0] + [len(f) for f in frames])
    return RecordRun(bytearray(b"".join(frames)), at[:-1] + 12, at[1:] - 4, at[:-1])


def _in_a_run(records, spec):
    """parse_run of the records framed in one buffer, read where they lie (their framing bytes rewritten), as a
    TFRecordDataset reads them; its columns, or its error's message."""
    from kubeps.runtime.data import example

    try:
        return example.parse_run(_run_of(records), spec)
    except ColumnValueError as err:
        return str(err)


def _with_offsets(records, spec):
    """parse_example's columns, or its error's message naming records by their frames' offsets (as _in_a_run)."""
    at = np.cumsum([0] + [len(_frame(r)) for r in records]).tolist()
    try:
        return parse_example(records, spec, offsets=at)
    except ColumnValueError as err:
        return str(err)


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if a.keys() != b.keys():
        return False
    for name in a:
        if a[name].dtype != b[name].dtype or a[name].shape != b[name].shape:
            return False
        for x, y in zip(a[name].reshape(-1), b[name].reshape(-1)):
            if not np.array_equal(x, y) or np.asarray(x).dtype != np.asarray(y).dtype:
                return False
    return True


def test_columnar_path_parses_plain_blocks_as_the_record_by_record_path():
    """A block from one writer (serialize_example: same features, same order) goes the columnar way -- ids that take
    1-byte and 10-byte varints (negative), multi-hot ids of 0..5 values, narrower and wider dtypes, a feature no
    record has (its default) -- and gives exactly the record-by-record path's columns."""
    rng = np.random.default_rng(5)
    records = [serialize_example({
        "ids": np.array([i % 100, -i - 1, rng.integers(-(1 << 63), 1 << 63, dtype=np.int64), (1 << 63) - 1]),
        "dense": rng.random(3).astype(np.float32), "tags": rng.integers(0, 1 << 40, i % 6), "label": [i % 2]})
        for i in range(300)]
    spec = {"ids": FixedLenFeature([2, 2], np.int64), "dense": FixedLenFeature([3], np.float64),
            "tags": VarLenFeature(np.int64), "label": FixedLenFeature([], np.int8),
            "missing": FixedLenFeature([2], np.float32, default_value=[0.5, 1.5]),
            "absent_tags": VarLenFeature(np.int32)}
    fast = _columnar(records, spec)
    assert fast is not None
    assert _same(fast, _each(records, spec))
    assert _same(parse_example(records, spec), fast)
    assert fast["ids"][7, 0].tolist() == [7, -8] and fast["ids"][7, 1, 1] == (1 << 63) - 1
    assert [len(r) for r in fast["tags"][:7]] == [0, 1, 2, 3, 4, 5, 0]
    assert fast["missing"].tolist() == [[0.5, 1.5]] * 300


def test_columnar_path_leaves_other_blocks_to_the_record_by_record_path():
    """Whatever the merge would not tell apart goes the record-by-record way, with the same columns or error."""
    one = ("a", _list("int64", [1, 2]))
    two = ("b", _list("float", [0.5]))
    spec = {"a": FixedLenFeature([2], np.int64), "b": FixedLenFeature([], np.float32)}
    cases = {
        "key order differs": [_record_of(one, two), _record_of(two, one)],
        "a feature missing in one record": [_record_of(one, two), _record_of(one)],
        "a feature twice in one record": [_record_of(one, two), _record_of(one, two, one)],
        "an entry of no value": [_record_of(one, two), _ld(1, _ld(1, _ld(1, b"a")) + _ld(1, _ld(1, b"b") + _ld(2, two[1])))],
        # 'a' one value short and 'b' one value long in the same record: the block's counts add up, the columns
        # would shift by one value
        "short and long in one record": [_record_of(one, two),
                                         _record_of(("a", _list("int64", [3])), ("b", _list("float", [1.0, 2.0])))],
        "unpacked list": [_record_of(one, two), _record_of(("a", _list("int64", [5, 6], packed=False)), two)],
        "list in two runs": [_record_of(one, two), _record_of(("a", _list("int64", [5, 6], runs=2)), two)],
        "list of another kind": [_record_of(one, two), _record_of(("a", _list("float", [5.0, 6.0])), two)],
        "two lists in one feature": [_record_of(one, two),
                                     _record_of(("a", _list("int64", [7]) + _list("int64", [8])), two)],
        "kinds swapped, same sizes": [_record_of(one, two),
                                      _record_of(("a", _list("float", [1.0])), ("b", _list("int64", [1, 2, 3, 4])))],
        "no list": [_record_of(one, two), _record_of(("a", b""), two)],
        "empty list": [_record_of(one, two), _record_of(("a", _list("int64", [])), two)],
        "not a tf.Example": [_record_of(one, two), b"\x0a\x05\x0a"],
    }
    # features of one kind and size: only the keys tell a record's order, or a shifted value, apart
    a1, b1 = ("a", _list("int64", [1])), ("b", _list("int64", [2]))
    same = {"a": FixedLenFeature([], np.int64), "b": FixedLenFeature([], np.int64)}
    packed_and_not = _ld(3, _ld(1, _varint(5)) + _varint(1 << 3) + _varint(6))  # one packed run, one unpacked value
    long_tag = b"\x9a\x00" + _list("int64", [5])[1:]  # int64_list's tag as a 2-byte varint
    same_cases = {
        "key order differs, same kinds": [_record_of(a1, b1), _record_of(b1, a1)],
        "a feature twice in every record (the last one counts)": [_record_of(a1, b1, ("a", _list("int64", [9])))] * 2,
        "a record of two records' entries, then one of none": [_record_of(a1, b1), _record_of(a1, b1, a1, b1),
                                                                 _record_of()],
        "packed and unpacked values in one list": [_record_of(a1, b1), _record_of(("a", packed_and_not), b1)],
        "a tag written long": [_record_of(a1, b1), _record_of(("a", long_tag), b1)],
        "a value's varint written long": [_record_of(a1, b1), _record_of(("a", _ld(3, _ld(1, b"\x85\x00"))), b1)],
        # 'a' a value short and 'b' one long in the same record, both int64: the block's values add up, the
        # columns would shift by one value
        "a value moved between int64 lists": [_record_of(a1, b1), _record_of(("a", _list("int64", [])),
                                                                    ("b", _list("int64", [300, 300])))],
    }
    for what, (records, case_spec) in [*((w, (r, spec)) for w, r in cases.items()),
                                       *((w, (r, same)) for w, r in same_cases.items())]:
        assert _columnar(records, case_spec) is None, what
        each = _each(records, case_spec)
        try:
            got = parse_example(records, case_spec)
        except ColumnValueError as err:
            got = str(err)
        assert _same(got, each), what
    # a float run's length written 1 and 4 bytes long: read as written, the columns still right; 5 bytes long (a
    # varint of 6 bytes): the block goes record by record
    floats = {"a": FixedLenFeature([], np.float32), "b": FixedLenFeature([], np.int64)}
    for long_length in (b"\x84\x00", b"\x84\x80\x80\x80\x00"):
        written = [_record_of(("a", _list("float", [1.0])), b1),
                   _record_of(("a", _ld(2, b"\x0a" + long_length + struct.pack("<f", 2.0))), b1)]
        fast = _columnar(written, floats)
        assert fast is not None and _same(fast, _each(written, floats)) and fast["a"].tolist() == [1.0, 2.0]
    six = [written[0], _record_of(("a", _ld(2, b"\x0a\x84\x80\x80\x80\x80\x00" + struct.pack("<f", 2.0))), b1)]
    assert _columnar(six, floats) is None
    with pytest.raises(ColumnValueError, match="record 1: not a tf.Example"):  # nor does protobuf take it
        parse_example(six, floats)
    assert _each(same_cases["key order differs, same kinds"], same)["a"].tolist() == [1, 1]
    assert _each(same_cases["a feature twice in every record (the last one counts)"], same)["a"].tolist() == [9, 9]
    assert _each(same_cases["packed and unpacked values in one list"], same).startswith("<records>: record 1: feature 'a' holds a int64_list of 2")
    assert _each(cases["key order differs"], spec)["a"].tolist() == [[1, 2], [1, 2]]
    assert _each(cases["unpacked list"], spec)["a"].tolist() == [[1, 2], [5, 6]]
    assert "record 1: feature 'a' holds a int64_list of 1 values" in _each(cases["short and long in one record"], spec)
    assert "record 1: feature 'a' holds a float_list of 1 values" in _each(cases["kinds swapped, same sizes"], spec)


def _fields(data: bytes):
    """``data``'s fields in wire order, as protobuf decodes them: ``(number, wire_type, payload)``."""
    from google.protobuf import empty_pb2
    from google.protobuf.unknown_fields import UnknownFieldSet

    return [(f.field_number, f.wire_type, f.data) for f in UnknownFieldSet(empty_pb2.Empty.FromString(data))]


def _layout_both_ways(records):
    """``_layout`` of a block (the first record's keys), and each entry's list tag and run bytes as protobuf's
    decoding of the wire tells them (None where a record is not ``len(keys)`` entries of a key of that length and
    a Feature of at most one list of at most one run)."""
    from kubeps.runtime.data import example

    keys = [k.encode() for k in example._messages()["RawExample"].FromString(records[0]).features.feature.key]
    stream = example._messages()["Records"](record=records).SerializeToString()
    lengths = np.array([len(r) for r in records], dtype=np.int64)
    ends = np.cumsum(1 + example._varint_size(lengths) + lengths)
    read = example._layout(np.frombuffer(stream, dtype=np.uint8), ends - lengths, ends, keys)
    from google.protobuf.message import DecodeError

    try:
        return read, _entry_runs(records, keys)
    except DecodeError:  # a record protobuf does not take
        return read, None


def _entry_runs(records, keys):
    """Each entry's list tag and run bytes, from protobuf's decoding of each record (see _layout_both_ways)."""
    tags, runs = [], []
    for record in records:
        top = _fields(record)
        entries = _fields(top[0][2]) if [f[:2] for f in top] == [(1, 2)] else None
        if entries is None or len(entries) != len(keys) or any(f[:2] != (1, 2) for f in entries):
            return None
        for key, (_, _, entry) in zip(keys, entries):
            inner = _fields(entry)
            if [f[:2] for f in inner] != [(1, 2), (2, 2)] or len(inner[0][2]) != len(key):
                return None
            lists = _fields(inner[1][2])
            if len(lists) > 1 or any(f[1] != 2 or f[0] not in (1, 2, 3) for f in lists):
                return None
            number, _, payload = lists[0] if lists else (0, 2, b"")
            values = _fields(payload) if number in (2, 3) else []
            if len(values) > 1 or any(f[:2] != (1, 2) for f in values):
                return None
            tags.append(number << 3 | 2 if lists else 0)
            runs.append(len(payload) if number == 1 else len(values[0][2]) if values else 0)
    return tags, runs


def test_layout_read_by_numpy_is_protobufs_or_none():
    """The list tags and run bytes numpy reads for a whole block are those protobuf's decoding of each record
    gives -- lengths of 1, 2 and 3 bytes, written long or not, included -- and a block of records of other
    entries gets None, its columns still the record-by-record path's."""
    plain = [serialize_example({"ids": [i, 1 << 40, -i], "dense": [0.5] * (i % 5), "label": [i % 2],
                                "wide": [0.25] * (40 if i == 3 else 2), "huge": [i + (1 << 40)] * (3000 if i == 4 else 1)})
             for i in range(50)]
    assert max(map(len, plain)) > 1 << 14  # a record whose length takes 3 bytes, an entry of 2
    read, protobufs = _layout_both_ways(plain)
    assert read is not None and protobufs is not None
    assert read[0].tolist() == protobufs[0] and read[1].tolist() == protobufs[1]
    spec = {"ids": FixedLenFeature([3], np.int64), "wide": VarLenFeature(np.float32), "huge": VarLenFeature(np.int64)}
    fast = _columnar(plain, spec)
    assert fast is not None and _same(fast, _each(plain, spec)) and fast["huge"][4].tolist() == [4 + (1 << 40)] * 3000
    # lengths written long (legal, never written by protobuf): read as written, the columns still right
    a1, b1 = ("a", _list("int64", [1])), ("b", _list("int64", [2]))
    same = {"a": FixedLenFeature([], np.int64), "b": FixedLenFeature([], np.int64)}
    long_lengths = [_record_of(a1, b1), _record_of(("a", b"\x1a\x83\x00" + _list("int64", [5])[2:]), b1),
                    _record_of(("a", b"\x1a\x04\x0a\x81\x00\x06"), b1),
                    b"\x0a" + bytes([0x80 | _record_of(a1, b1)[1], 0]) + _record_of(a1, b1)[2:]]
    read, protobufs = _layout_both_ways(long_lengths)
    assert read is not None and (read[0].tolist(), read[1].tolist()) == protobufs
    fast = _columnar(long_lengths, same)
    assert fast is not None and fast["a"].tolist() == [1, 5, 6, 1] and _same(fast, _each(long_lengths, same))
    # a record of two records' entries, then one of none: the same keys in the same order, other records
    assert _layout_both_ways([_record_of(a1, b1), _record_of(a1, b1, a1, b1), _record_of()])[0] is None
    # a length of more than 5 bytes: not read (protobuf does not take it either)
    six = [_record_of(a1, b1), _record_of(("a", b"\x1a\x08\x0a\x86\x80\x80\x80\x80\x00\x07"), b1)]
    assert _layout_both_ways(six)[0] is None


def test_columnar_path_takes_empty_lists_no_lists_and_other_kinds_where_the_spec_allows_them():
    """Empty lists (of any kind) and Features of no list are rows of no values for a VarLenFeature and values for
    a FixedLenFeature of size 0; a feature the spec does not read may hold anything, bytes included."""
    records = [_record_of(("tags", _list("int64", list(range(i % 3))) if i % 4 else _list(["float", None][i % 8 // 4], [])),
                          ("none", _list("float", [])), ("raw", _list("bytes", [b"x" * i])),
                          ("id", _list("int64", [-i])))
               for i in range(16)]
    spec = {"tags": VarLenFeature(np.int64), "none": FixedLenFeature([0], np.float32), "id": FixedLenFeature([], np.int64)}
    fast = _columnar(records, spec)
    assert fast is not None and _same(fast, _each(records, spec))
    assert [r.tolist() for r in fast["tags"][:6]] == [[], [0], [0, 1], [], [], [0, 1]] and fast["id"][3] == -3
    # a bytes list whose length is written long, in a feature the spec does not read: still the columnar way
    long_raw = [_record_of(*entries) for entries in (
        [("tags", _list("int64", [i])), ("none", _list("float", [])), ("raw", b"\x0a\x82\x00\x0a\x00"),
         ("id", _list("int64", [-i]))] for i in range(4))]
    fast = _columnar(long_raw, spec)
    assert fast is not None and _same(fast, _each(long_raw, spec))
    # a bytes feature read: left to the block path, same columns
    with_bytes = {**spec, "raw": FixedLenFeature([], bytes)}
    assert _columnar(records, with_bytes) is None and _same(parse_example(records, with_bytes), _each(records, with_bytes))
    # a value the dtype does not hold: the record-by-record path names it
    narrow = {"id": FixedLenFeature([], np.int8), "tags": VarLenFeature(np.int64)}
    big = records + [_record_of(("tags", _list("int64", [])), ("none", _list("float", [])), ("raw", _list("bytes", [])),
                                ("id", _list("int64", [300])))]
    assert _columnar(big, narrow) is None
    with pytest.raises(ColumnValueError, match=r"record 16, feature 'id': value 300 \(int64\) does not fit"):
        parse_example(big, narrow)


_KINDS = ("int64", "float", "bytes", None)


@st.composite
def _blocks(draw):
    """A parse spec and a block of records for it: mostly alike (one writer: same features, order, kinds and
    lengths), sometimes not (another order, a missing feature, another kind or length, an unpacked list, a list
    in two runs), with 1-byte to 10-byte varints, floats, bytes, empty lists and Features of no list."""
    names = draw(st.lists(st.sampled_from("abcde"), min_size=1, max_size=4, unique=True))
    template = {name: (draw(st.sampled_from(_KINDS)), draw(st.integers(0, 4))) for name in names}
    spec = {}
    for name in draw(st.lists(st.sampled_from(names + ["z"]), min_size=1, max_size=3, unique=True)):
        kind, length = template.get(name, (None, 0))
        if kind in ("int64", "float") and draw(st.integers(0, 3)):  # mostly a spec that fits the writer's records
            dtype = draw(st.sampled_from([np.int64, np.int32, np.uint8] if kind == "int64" else [np.float32, np.float64]))
            shape = draw(st.sampled_from([[length], [1, length]] + ([[]] if length == 1 else [])))
        else:
            dtype = draw(st.sampled_from([np.int64, np.int32, np.uint8, np.float32, np.float64]))
            shape = draw(st.sampled_from([[], [0], [1], [2], [2, 2]]))
        if draw(st.booleans()):
            default = draw(st.sampled_from([None, 0, 1]))
            spec[name] = FixedLenFeature(shape, dtype, None if default is None else np.full(shape, default))
        else:
            spec[name] = VarLenFeature(dtype)
    ints = st.one_of(st.integers(-3, 300), st.integers(-(1 << 63), (1 << 63) - 1))
    floats = st.floats(width=32, allow_nan=False)
    records = []
    one_writer = draw(st.integers(0, 2)) > 0
    for _ in range(draw(st.integers(1, 12))):
        alike = one_writer or draw(st.integers(0, 9)) > 1
        order = names if alike else draw(st.permutations(names))
        entries = []
        for name in order:
            kind, length = template[name] if alike else (draw(st.sampled_from(_KINDS)), draw(st.integers(0, 4)))
            if not alike and draw(st.integers(0, 5)) == 0:
                continue  # the feature is missing from this record
            values = draw(st.lists(ints if kind == "int64" else floats if kind == "float" else st.binary(max_size=3),
                                   min_size=length, max_size=length))
            packed, runs = True, 1
            if not alike and kind in ("int64", "float") and values:
                packed, runs = draw(st.booleans()), draw(st.integers(1, 2))
            entries.append((name, _list(kind, values, packed=packed, runs=runs)))
        records.append(_record_of(*entries))
    return spec, records


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_blocks())
def test_columnar_path_gives_the_record_by_record_columns_or_leaves_the_block(block):
    """For any spec and block: the columnar path gives the record-by-record path's columns, or nothing (then
    parse_example gives the record-by-record path's columns or error)."""
    spec, records = block
    each = _each(records, spec)
    fast = _columnar(records, spec)
    read, protobufs = _layout_both_ways(records)
    if read is not None:
        assert protobufs is not None and (read[0].tolist(), read[1].tolist()) == protobufs
    if fast is not None:
        assert not isinstance(each, str) and _same(fast, each)
    try:
        got = parse_example(records, spec)
    except ColumnValueError as err:
        got = str(err)
    assert _same(got, each)
    assert _same(_in_a_run(records, spec), _with_offsets(records, spec))
    from kubeps.runtime.data import example

    assert (example._run_columns(_run_of(records), example.feature_spec(spec)) is None) == (fast is None)


# -- every record once per epoch across workers, for each format and both policies ------------------------------------
def _write_format(fmt: str, folder: Path, files: int, rows: int) -> str:
    for f in range(files):
        ids = range(f * rows, (f + 1) * rows)
        if fmt == "parquet":
            write_parquet(folder / f"part-{f}.parquet", f * rows, rows, row_group_size=17)
        elif fmt == "tfrecord":
            with TFRecordWriter(str(folder / f"part-{f}.tfrecord")) as w:
                w.write_all(serialize_example({"id": [i]}) for i in ids)
        else:
            (folder / f"part-{f}.csv").write_text("".join(f"{i},{i % 2}\n" for i in ids))
    return str(folder / f"part-*.{fmt}")


def _dataset(fmt: str, pattern: str, **kwargs) -> kp.Dataset:
    if fmt == "parquet":
        return ParquetDataset(pattern, columns=["id"], **kwargs)
    if fmt == "tfrecord":
        return TFRecordDataset(pattern, features={"id": FixedLenFeature([], np.int64)}, block_records=13, **kwargs)
    return CsvDataset(pattern, [np.int64, np.int64], names=["id", "label"], block_rows=13, **kwargs)


@pytest.mark.parametrize("fmt", ["parquet", "tfrecord", "csv"])
@pytest.mark.parametrize("policy", [AutoShardPolicy.FILE, AutoShardPolicy.DATA])
def test_every_record_is_read_once_per_epoch_across_workers(tmp_path, fmt, policy):
    pattern = _write_format(fmt, tmp_path, files=5, rows=40)
    workers = 3
    seen = []
    for w in range(workers):
        ds = auto_shard(_dataset(fmt, pattern, num_parallel_reads=2), workers, w, policy).batch(8)
        seen.append(np.concatenate([b["id"] for b in ds]))
    everything = np.concatenate(seen)
    assert sorted(everything.tolist()) == list(range(200))  # each record exactly once
    assert all(len(s) for s in seen)


def test_parallel_reads_keep_the_sequential_interleave_order(tmp_path):
    pattern = _write_format("tfrecord", tmp_path, files=6, rows=30)
    node = _dataset("tfrecord", pattern)._node
    reader = node.read_blocks
    files = FileListNode(pattern, shuffle=False, seed=0)
    one = FileBlocksNode(files, reader, cycle_length=3, num_parallel_calls=1, name="r")
    three = FileBlocksNode(files, reader, cycle_length=3, num_parallel_calls=3, name="r")
    order = [b["id"].tolist() for b in one.blocks()]
    for _ in range(3):
        assert [b["id"].tolist() for b in three.blocks()] == order
    firsts = [block[0] for block in order[:3]]
    assert firsts == [0, 30, 60]  # three files open, one block from each in turn
    ids = TFRecordDataset(pattern, features={"id": FixedLenFeature([], np.int64)}, num_parallel_reads=kp.AUTOTUNE)
    assert sorted(int(e["id"]) for e in ids) == list(range(180))


class _SlowReader:
    """A reader in threads (``read_ahead`` blocks ahead) that counts the blocks it has made, notes any second
    thread inside a file, and raises where told."""

    read_ahead = 3

    def __init__(self, blocks: int, fail_at: tuple[str, int] | None = None):
        import threading

        self._blocks = blocks
        self._fail_at = fail_at
        self._lock = threading.Lock()
        self.made: dict[str, int] = {}
        self.inside: set[str] = set()
        self.overlaps = 0
        self.closed: list[str] = []

    def __call__(self, path: str):
        name = os.path.basename(path)
        try:
            for k in range(self._blocks):
                with self._lock:
                    self.overlaps += name in self.inside
                    self.inside.add(name)
                time.sleep(0.002 * (hash((name, k)) % 3))
                with self._lock:
                    self.inside.discard(name)
                    self.made[name] = self.made.get(name, 0) + 1
                if self._fail_at == (name, k):
                    raise OSError(f"{name}: block {k} cannot be read")
                yield {"id": np.array([int(name.split("-")[1].split(".")[0]) * 100 + k])}
        finally:
            self.closed.append(name)


def _reaches_and_stays(read: Callable[[], dict], want: dict, stay: float = 0.3) -> None:
    """``read()`` comes to equal ``want`` (however slow the machine) and still does ``stay`` seconds later."""
    deadline = time.monotonic() + 30
    while read() != want:
        assert time.monotonic() < deadline, f"{read()} never became {want}"
        time.sleep(0.01)
    time.sleep(stay)
    assert read() == want


def test_reader_threads_work_read_ahead_blocks_ahead_in_order(tmp_path):
    """A reader with ``read_ahead = 3`` in threads: every open file (and the next ones to open) is read up to 3
    blocks ahead of the consumer and no further, one thread at a time in a file; the order is the sequential
    interleave's; an error is raised where its block would be, after the blocks before it; closing a pass mid-way
    closes every file begun, with no thread left inside one."""
    for f in range(4):
        (tmp_path / f"part-{f}.x").write_text("")
    files = FileListNode(str(tmp_path / "part-*.x"), shuffle=False, seed=0)
    sequential = [b["id"].tolist() for b in FileBlocksNode(files, _SlowReader(6), 2, 1, "r").blocks()]
    assert [ids[0] for ids in sequential[:4]] == [0, 100, 1, 101]
    reader = _SlowReader(6)
    it = FileBlocksNode(files, reader, cycle_length=2, num_parallel_calls=2, name="r").blocks()
    assert next(it)["id"].tolist() == [0]
    # part-0: the block taken and 3 more; part-1 and part-2 (opened ahead, 2 files, as the cycle): 3 each, no more
    _reaches_and_stays(lambda: dict(reader.made), {"part-0.x": 4, "part-1.x": 3, "part-2.x": 3})
    assert [[0]] + [b["id"].tolist() for b in it] == sequential
    assert reader.overlaps == 0

    failing = _SlowReader(6, fail_at=("part-1.x", 2))
    got = []
    with pytest.raises(OSError, match="part-1.x: block 2 cannot be read"):
        for b in FileBlocksNode(files, failing, cycle_length=2, num_parallel_calls=2, name="r").blocks():
            got.append(b["id"].tolist())
    assert got == sequential[: sequential.index([102])]
    assert sorted(failing.closed) == sorted(failing.made)  # every file begun is closed

    early = _SlowReader(6)
    it = FileBlocksNode(files, early, cycle_length=2, num_parallel_calls=2, name="r").blocks()
    next(it)
    it.close()
    assert sorted(early.closed) == sorted(early.made)
    assert not early.inside


def _reader_children() -> set[int]:
    """PIDs of this process's living reader children (from /proc)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"reader_processes" in cmdline:
            pids.add(int(entry.name))
    return pids


def _elements(ds) -> list:
    return [{k: np.asarray(v).tolist() for k, v in e.items()} if isinstance(e, dict) else e for e in ds]


def _write_records(folder: Path, files: int, rows: int) -> str:
    for f in range(files):
        (folder / f"part-{f}.tfrecord").write_bytes(b"".join(_frame(_record(f * rows + i)) for i in range(rows)))
    return str(folder / "part-*.tfrecord")


def test_tfrecord_files_are_read_in_child_processes_in_the_threads_order(tmp_path, monkeypatch):
    """num_parallel_reads > 1: TFRecord files are read and parsed in child processes (that work holds the GIL).
    The elements -- fixed, variable-length and bytes features, and raw records -- are those of the same reading in
    threads, in the same order; the next pass reuses the children."""
    from kubeps.runtime.data import formats, reader_processes

    pattern = _write_records(tmp_path, files=5, rows=23)
    parsed = TFRecordDataset(pattern, features=SPEC, num_parallel_reads=2, block_records=7)
    raw = TFRecordDataset(pattern, num_parallel_reads=3)
    in_children = [_elements(parsed), _elements(raw)]
    idle = {c.proc.pid for c in reader_processes._idle}
    assert len(idle) >= 2
    assert _elements(parsed) == in_children[0]
    assert {c.proc.pid for c in reader_processes._idle} & idle  # children of the first passes read again
    monkeypatch.setattr(formats._TFRecordReader, "in_processes", False)
    assert [_elements(parsed), _elements(raw)] == in_children
    assert len(in_children[0]) == 115 and in_children[0][0]["ids"] == [0, 0]


def test_reader_children_keep_their_blocks_memory_unless_the_user_set_malloc(monkeypatch):
    """A reader child starts with glibc's malloc told to serve blocks from its heap and keep the heap between
    blocks (a fresh mmap per block, paged in again each time, cost about 5 % of the TFRecord pipeline); values
    the user set in the environment are kept."""
    from kubeps.runtime.data import reader_processes

    def child_environ() -> dict[str, str]:
        # Popen returns once the exec has begun (its error pipe closes); the kernel fills the new program's
        # environment in a moment later, and until then /proc shows it empty. Wait for it, not for a time.
        child = reader_processes._Child()
        try:
            deadline = time.monotonic() + 30
            while not (raw := Path(f"/proc/{child.proc.pid}/environ").read_bytes()) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            child.kill()
        return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    env = child_environ()
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20) and env["MALLOC_TRIM_THRESHOLD_"] == str(128 << 20)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert child_environ()["MALLOC_MMAP_THRESHOLD_"] == "65536"


def test_a_child_readers_error_names_the_record_and_an_early_close_stops_the_children(tmp_path):
    """A corrupt record read in a child is the same error, named the same way, where its block would be; with
    skip_corrupt the child skips it. A pass closed mid-file kills the children reading it; a child that dies is
    an error naming it, not a hang."""
    from kubeps.runtime.data import reader_processes

    pattern = _write_records(tmp_path, files=3, rows=10)
    bad = tmp_path / "part-1.tfrecord"
    data = bytearray(bad.read_bytes())
    third = len(_frame(_record(10))) + len(_frame(_record(11)))  # record 12's frame
    data[third + 14] ^= 0x01
    bad.write_bytes(bytes(data))
    ds = TFRecordDataset(pattern, features=SPEC, num_parallel_reads=2, block_records=4)
    seen = []
    with pytest.raises(CorruptRecordError, match=rf"{bad}: corrupt TFRecord record at byte offset {third}: the data"):
        for e in ds:
            seen.append(int(e["ids"][0]))
    assert seen[:4] == [0, 1, 2, 3]  # file 0's first block, before file 1's first (the bad one)
    kept = [int(e["ids"][0]) for e in TFRecordDataset(pattern, features=SPEC, num_parallel_reads=2, skip_corrupt=True)]
    assert sorted(kept) == sorted(set(range(30)) - {12})

    it = iter(TFRecordDataset(pattern, features=SPEC, num_parallel_reads=2, block_records=2, skip_corrupt=True))
    next(it)
    busy = _reader_children() - {c.proc.pid for c in reader_processes._idle}  # reading a file for this pass
    assert busy
    it.close()
    assert not busy & _reader_children()  # killed (and reaped): their files were not read to the end

    child = reader_processes._Child()
    child.proc.kill()
    child.proc.wait()
    remote = reader_processes.RemoteBlocks.__new__(reader_processes.RemoteBlocks)
    remote._child = child
    with pytest.raises(RuntimeError, match=rf"reader process \(pid {child.proc.pid}\) ended with status -9"):
        next(remote)


def test_a_reader_error_reaches_the_consumer_and_the_pass_can_be_closed(tmp_path):
    pattern = _write_format("csv", tmp_path, files=4, rows=20)
    (tmp_path / "part-2.csv").write_text("1,x\n")
    ds = CsvDataset(pattern, [np.int64, np.int64], num_parallel_reads=4)
    with pytest.raises(ColumnValueError, match="part-2.csv: line 1, column 1"):
        list(ds)
    it = iter(ds)
    next(it)
    it.close()


# -- object storage: a real S3 server on loopback ---------------------------------------------------------------------
def _versitygw() -> str | None:
    out = subprocess.run([str(REPO / "hack" / "s3server.sh"), "bin"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if out.returncode == 0 and os.access(path, os.X_OK) else None


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    binary = _versitygw()
    if binary is None:
        if os.environ.get("KUBEPS_REQUIRE_S3"):
            pytest.fail("KUBEPS_REQUIRE_S3 is set but versitygw is not built: run `make s3server`")
        pytest.skip("versitygw not built (make s3server builds it; docs/testing.md)")
    pytest.importorskip("s3fs")
    root = tmp_path_factory.mktemp("s3")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, ROOT_ACCESS_KEY="kubeps-test", ROOT_SECRET_KEY="kubeps-test-secret-0123456789")
    log = open(root.parent / "versitygw.log", "wb")
    proc = subprocess.Popen([binary, "--port", f"127.0.0.1:{port}", "posix", str(root)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"versitygw did not start: {(root.parent / 'versitygw.log').read_text()}")
                time.sleep(0.1)
        yield {"endpoint": f"http://127.0.0.1:{port}", "key": env["ROOT_ACCESS_KEY"],
               "secret": env["ROOT_SECRET_KEY"]}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server["endpoint"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    if not fs.exists("data"):
        fs.mkdir("data")  # the bucket
    yield fs
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize("fmt", ["parquet", "tfrecord", "csv"])
def test_object_storage_is_listed_and_sharded_like_local_files(s3_env, tmp_path, fmt):
    local = tmp_path / "local"
    local.mkdir()
    _write_format(fmt, local, files=4, rows=25)
    for f in sorted(local.iterdir()):
        s3_env.put(str(f), f"data/{fmt}/{f.name}")
    url = f"s3://data/{fmt}/part-*.{fmt}"
    files = kp.Dataset.list_files(url, shuffle=False)
    assert [str(f) for f in files] == [f"s3://data/{fmt}/part-{i}.{fmt}" for i in range(4)]
    seen = []
    for policy in (AutoShardPolicy.FILE, AutoShardPolicy.DATA):
        for w in range(2):
            ds = auto_shard(_dataset(fmt, url, num_parallel_reads=2), 2, w, policy)
            seen.append(sorted(int(e["id"]) for e in ds))
        assert sorted(seen[-2] + seen[-1]) == list(range(100))
    assert seen[0] == list(range(0, 25)) + list(range(50, 75))  # FILE: files 0 and 2 on worker 0


def test_object_storage_tfrecord_writer_and_missing_files(s3_env):
    with TFRecordWriter("s3://data/w/one.tfrecord") as writer:
        writer.write_all(_record(i) for i in range(3))
    batch = next(iter(TFRecordDataset("s3://data/w/one.tfrecord", features=SPEC).batch(3)))
    assert batch["ids"][:, 0].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="No files matched pattern: s3://data/nothing/"):
        TFRecordDataset("s3://data/nothing/*.tfrecord")


# -- docs/data.md: its format and storage code blocks run ---------------------------------------------------------------
def test_docs_format_blocks_run(tmp_path, monkeypatch):
    text = (REPO / "docs" / "data.md").read_text()
    section = text.split("## File formats", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in section.split("```python\n")[1:]]
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for block in blocks:
        exec(compile(block.split("```", 1)[0], "docs/data.md", "exec"), scope)  # noqa: S102 - the docs' own code



@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ctr_example_trains_from_parquet_on_object_storage_with_the_loss_of_arrays(s3_env):
    """The CTR example, under kubeps local --ps 2 --workers 2, trained from Parquet files on the
    S3 server reaches the eval log-loss it reaches from in-memory arrays (async training: not bit-identical)."""
    from .test_example_ctr import EXAMPLE, run_example

    flags = ("--steps", "800", "--train-examples", "60000", "--eval-examples", "20000")
    written = subprocess.run([sys.executable, str(EXAMPLE), *flags, "--write-data", "s3://data/ctr"],
                             capture_output=True, text=True, timeout=120)
    assert written.returncode == 0, written.stderr[-2000:]
    assert sorted(s3_env.ls("data/ctr")) == [f"data/ctr/part-{k}.parquet" for k in range(4)]
    _, arrays = run_example(*flags)
    _, parquet = run_example(*flags, "--data", "s3://data/ctr/part-*.parquet")
    print("arrays", arrays, "parquet", parquet)
    assert parquet["logloss"] < parquet["base_logloss"] - 0.1, parquet
    assert parquet["logloss"] == pytest.approx(arrays["logloss"], abs=0.01), (arrays, parquet)
    assert parquet["auc"] == pytest.approx(arrays["auc"], abs=0.01), (arrays, parquet)
