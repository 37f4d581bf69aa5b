"""Criteo-format files: ``Dataset.from_files(paths, reader="criteo")`` and ``examples/criteo/generate.py``.

The reader's arrays are checked against a plain Python parse of the same lines (written by the generator, by hand
for the edge cases, and at random); every malformed line is refused with the file, the line and the field."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

import kubeps.runtime as kp
from kubeps.runtime.data import ColumnValueError, auto_shard
from kubeps.runtime.data.criteo import FIELD_NAMES, CriteoReader

REPO = Path(__file__).resolve().parents[2]


def _load_generate():
    spec = importlib.util.spec_from_file_location("criteo_generate", REPO / "examples" / "criteo" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load_generate()


def python_parse(text: bytes) -> dict[str, np.ndarray]:
    """The reference: a line at a time, a field at a time."""
    labels, dense, categorical = [], [], []
    for line in text.splitlines():
        fields = line.split(b"\t")
        labels.append(int(fields[0]))
        dense.append([int(v) if v else 0 for v in fields[1:14]])
        categorical.append([int(v, 16) if v else -1 for v in fields[14:]])
    return {"label": np.array(labels, np.int64), "dense": np.array(dense, np.float32),
            "categorical": np.array(categorical, np.int64).reshape(-1, 26)}


def read_all(paths, **kw) -> dict[str, np.ndarray]:
    batches = list(kp.Dataset.from_files(paths, reader="criteo", **kw).batch(1 << 20))
    return {k: np.concatenate([b[k] for b in batches]) for k in ("label", "dense", "categorical")}


def line(label="1", dense=(), categorical=()) -> str:
    """A line of Criteo's format; the features not given are empty."""
    return "\t".join([label, *dense, *[""] * (13 - len(dense)), *categorical, *[""] * (26 - len(categorical))])


def test_generated_files_read_back_as_written_with_the_teacher_s_probabilities(tmp_path):
    record = generate.generate(str(tmp_path), lines=3000, files=3, seed=5)
    assert json.loads((tmp_path / "teacher.json").read_text()) == record
    paths = [str(tmp_path / name) for name in record["files"]]
    got = read_all(paths)
    want = python_parse(b"".join(Path(p).read_bytes() for p in paths))
    for key in want:
        assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key
    assert len(got["label"]) == 3000
    # empty values at each field's rate, heavy-tailed ids, hex values of 32 bits
    empty = (got["categorical"] == -1).mean(axis=0)
    assert np.allclose(empty, generate.EMPTY_RATES[13:], atol=0.05)
    top = np.unique(got["categorical"][:, 2], return_counts=True)[1].max()
    assert top > 30  # C3 has 10M values: a uniform draw would repeat none of them
    assert got["categorical"].max() < 2**32
    # the labels follow the teacher, and teacher.json's log-loss is the teacher's on these lines
    p = generate.Teacher(record["teacher_seed"]).probability(got)
    assert generate.log_loss(got["label"], p) == pytest.approx(record["teacher_logloss"], rel=1e-9)
    assert record["teacher_logloss"] < generate.log_loss(got["label"], np.full(3000, got["label"].mean()))


def test_the_generator_s_hex_ids_invert_to_their_ranks():
    ranks = np.array([0, 1, 999, 10131226, 2**32 - 1])
    for field in (0, 2, 25):
        assert np.array_equal(generate.unscramble(field, generate.scramble(field, ranks)), ranks)
    assert len(np.unique(generate.scramble(2, np.arange(100_000)))) == 100_000


def test_gzip_files_by_suffix_and_by_magic(tmp_path):
    record = generate.generate(str(tmp_path / "gz"), lines=500, files=1, gzipped=True, seed=2)
    gz = tmp_path / "gz" / record["files"][0]
    assert gz.name.endswith(".txt.gz")
    text = gzip.decompress(gz.read_bytes())
    want = python_parse(text)
    assert np.array_equal(read_all(str(gz))["categorical"], want["categorical"])
    unnamed = tmp_path / "day_0"  # Criteo 1TB's files are named day_N: gzip'd, found by the magic bytes
    unnamed.write_bytes(gz.read_bytes())
    assert np.array_equal(read_all(str(unnamed))["dense"], want["dense"])


def test_an_element_and_its_batch(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(line("0", ["1", "-2", "", "123456789012", *[""] * 9], ["0000000a", "FFFFFFFF", "", *["abcdef01"] * 23])
                    + "\n" + line("1") + "\n")
    first = next(iter(kp.Dataset.from_files(str(path), reader="criteo")))
    assert set(first) == {"label", "dense", "categorical"}
    assert first["label"].dtype == np.int64 and first["label"] == 0
    assert first["dense"].dtype == np.float32 and first["dense"].shape == (13,)
    # read exactly as int64, then float32 (which rounds a count above 2**24, as any float32 feature does)
    assert first["dense"][:4].tolist() == [1.0, -2.0, 0.0, float(np.float32(123456789012))]
    assert first["categorical"].dtype == np.int64 and first["categorical"].shape == (26,)
    assert first["categorical"][:4].tolist() == [10, 2**32 - 1, -1, 0xABCDEF01]
    batch = next(iter(kp.Dataset.from_files(str(path), reader="criteo").batch(2)))
    assert batch["label"].tolist() == [0, 1]
    assert batch["dense"].shape == (2, 13) and batch["categorical"].shape == (2, 26)
    assert batch["dense"][1].tolist() == [0.0] * 13 and batch["categorical"][1].tolist() == [-1] * 26


def test_crlf_endings_and_a_last_line_without_newline(tmp_path):
    path = tmp_path / "crlf.txt"
    path.write_bytes((line("1", ["7"] * 13, ["0000000b"] * 26) + "\r\n" + line("0", ["3"] * 13) + "\r\n"
                      + line("1", ["5"] * 13, ["0000000c"] * 26)).encode())
    got = read_all(str(path))
    assert got["label"].tolist() == [1, 0, 1]
    assert got["categorical"][:, -1].tolist() == [11, -1, 12]
    assert got["dense"][:, -1].tolist() == [7.0, 3.0, 5.0]


def test_random_lines_agree_with_a_python_parse_across_block_boundaries(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(700):
        dense = []
        for _ in range(13):
            digits = int(rng.integers(0, 19))
            value = "" if digits == 0 else str(int(rng.integers(0, 10**digits)) * int(rng.choice([1, -1])))
            dense.append(value)
        hexes = ["" if rng.random() < 0.2 else format(int(rng.integers(0, 2**32)), "08" + "xX"[rng.integers(0, 2)])
                 for _ in range(26)]
        rows.append(line(str(int(rng.integers(0, 2))), dense, hexes))
    text = ("\n".join(rows) + "\n").encode()
    path = tmp_path / "random.txt"
    path.write_bytes(text)
    want = python_parse(text)
    for block_bytes in (97, 4096, 1 << 20):  # lines cut by the reads anywhere
        blocks = list(CriteoReader(block_bytes)(str(path)))
        for key in want:
            assert np.array_equal(np.concatenate([b[key] for b in blocks]), want[key]), (block_bytes, key)


@pytest.mark.parametrize("bad_line, field, why", [
    (line("1", ["1", "2", "3", "4", "5", "6", "1.5"]), "I7", "an integer"),
    (line("1", ["x"]), "I1", "an integer"),
    (line("1", ["-"]), "I1", "an integer"),
    (line("1", ["1234567890123456789"]), "I1", "at most 18 digits"),
    (line("1", ["12345678901x"]), "I1", "an integer"),
    (line("1", categorical=[""] * 11 + ["zzzzzzzz"]), "C12", "8 hex digits"),
    (line("1", categorical=["abc"]), "C1", "8 hex digits"),
    (line("1", categorical=[""] * 25 + ["0123456789"]), "C26", "8 hex digits"),
    (line(""), "label", "may not be empty"),
    (line("one"), "label", "an integer"),
])
def test_a_value_that_does_not_parse_names_the_file_line_and_field(tmp_path, bad_line, field, why):
    path = tmp_path / "bad.txt"
    good = line("0", ["1"] * 13, ["00000001"] * 26)
    path.write_text("\n".join([good, good, bad_line, good]) + "\n")
    with pytest.raises(ColumnValueError) as err:
        read_all(str(path))
    message = str(err.value)
    assert f"{path}: line 3, field {field}: value " in message and why in message, message


@pytest.mark.parametrize("bad_line, fields", [
    ("1\t2\t3", 3),
    (line() + "\t", 41),
    ("", 1),
])
def test_a_line_with_another_number_of_fields_is_refused_with_its_number(tmp_path, bad_line, fields):
    path = tmp_path / "short.txt"
    good = line("0", ["1"] * 13)
    path.write_text("\n".join([good] * 5 + [bad_line] + [good]) + "\n")
    for block_bytes in (64, 1 << 20):
        with pytest.raises(ColumnValueError, match=rf"short\.txt: line 6: {fields} fields?, expected 40 tab-separated"):
            list(CriteoReader(block_bytes)(str(path)))


def test_the_first_error_of_a_file_is_the_one_reported(tmp_path):
    path = tmp_path / "two.txt"
    path.write_text("\n".join([line("1", ["1"] * 13), line("1", ["q"]), "1\t2"]) + "\n")
    with pytest.raises(ColumnValueError, match=r"line 2, field I1: value 'q'"):
        read_all(str(path))


def test_field_names_follow_criteo():
    assert FIELD_NAMES[:2] == ("label", "I1") and FIELD_NAMES[13:15] == ("I13", "C1") and FIELD_NAMES[-1] == "C26"


def test_sharding_is_by_file_as_for_the_other_file_readers(tmp_path):
    record = generate.generate(str(tmp_path), lines=400, files=4, seed=3)
    paths = [str(tmp_path / n) for n in record["files"]]
    whole = read_all(paths)
    ds = kp.Dataset.from_files(str(tmp_path / "train-*.txt"), reader="criteo")
    assert ds.is_file_based
    shards = [list(auto_shard(ds.batch(1000), 2, i)) for i in range(2)]
    files_of = [[p for j, p in enumerate(paths) if j % 2 == i] for i in range(2)]
    for shard, files in zip(shards, files_of):
        want = python_parse(b"".join(Path(p).read_bytes() for p in files))
        assert np.array_equal(np.concatenate([b["categorical"] for b in shard]), want["categorical"])
    shipped = cloudpickle.loads(cloudpickle.dumps(ds.batch(1000)))  # as a dataset function's result travels
    assert np.array_equal(np.concatenate([b["label"] for b in shipped]), whole["label"])
    data = [list(auto_shard(ds.batch(10, drop_remainder=True), 2, i, policy="DATA")) for i in range(2)]
    assert np.array_equal(data[1][0]["label"], whole["label"][10:20])
    with pytest.raises(ValueError, match="reader"):
        kp.Dataset.from_files(paths, reader="criteo2")


def test_the_generator_runs_as_a_user_runs_it(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "examples" / "criteo" / "generate.py"), "--out", str(tmp_path),
                           "--lines", "1000", "--files", "2", "--gzip", "--seed", "7"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote 1000 lines in 2 file(s)" in done.stdout
    record = json.loads((tmp_path / "teacher.json").read_text())
    assert record["files"] == ["train-00000.txt.gz", "train-00001.txt.gz"] and record["seed"] == 7
    assert 0.1 < record["positive_rate"] < 0.4 and 0 < record["teacher_logloss"] < 0.69
    assert len(read_all(str(tmp_path / "*.gz"))["label"]) == 1000


def test_a_file_that_is_not_criteo_s_format_is_refused_with_its_path(tmp_path):
    record = generate.generate(str(tmp_path / "gz"), lines=300, files=1, gzipped=True)
    whole = (tmp_path / "gz" / record["files"][0]).read_bytes()
    cut = tmp_path / "cut.txt.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ColumnValueError, match=r"cut\.txt\.gz: cannot decompress it as gzip"):
        read_all(str(cut))
    plain = tmp_path / "plain.gz"
    plain.write_text(line("1") + "\n")
    with pytest.raises(ColumnValueError, match=r"plain\.gz: cannot decompress it as gzip"):
        read_all(str(plain))
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x00" * (3 << 20))  # no line end: refused after 1 MiB, not read whole
    with pytest.raises(ColumnValueError, match=r"blob\.bin: line 1: no end of line in its first 1 MiB"):
        list(CriteoReader(1 << 16)(str(binary)))
