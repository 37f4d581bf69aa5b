"""Input from files: examples/s reading Parquet, TFRecord (tf.Example) and CSV into 512-row batches of the CTR
workload's columns, against in-memory arrays (the baseline), in one run; optionally TensorFlow's tf.data on the
same files.

    .venv/bin/python bench/input_formats.py [--rows 262144] [--files 4] [--rounds 3] [--tf-python /path/tfenv/bin/python]

The data: ``bench/ctr/workload.py``'s teacher, ``--rows`` examples of 8 hashed ids (int64), 13 dense features
(float32) and a label, written once to ``--files`` files of each format under a temporary folder: Parquet with
columns ``ids`` (``fixed_size_list<int64>[8]``), ``dense`` (``fixed_size_list<float>[13]``), ``label``; TFRecord
of ``tf.Example`` with the same three features; CSV with 22 columns (``C1..C8`` int64, ``I1..I13`` float32,
``label``). Each pipeline yields batches ``{"ids": [512, 8] int64, "dense": [512, 13] float32, "label": [512]}``
(CSV: its 22 columns stacked into the same by a vectorised ``map`` after ``batch``) through the CTR workload's
``shuffle(10_000)`` and ``batch(512, drop_remainder=True)``: one epoch, timed from the start to the last batch, after
one untimed warm-up epoch of each (imports, page cache). The baseline is ``from_tensor_slices`` of the same arrays
through the same ``shuffle`` and ``batch`` (the "in-memory arrays" the goal is stated against). Every
figure is the median of ``--rounds``, the rounds alternating between pipelines so load on a shared machine falls on
all. With ``--tf-python``, the same files are read by ``tf.data`` (``TFRecordDataset`` + ``batch`` +
``tf.io.parse_example``; ``CsvDataset`` + ``batch``; Parquet needs TF I/O: tensorflow-io 0.37.1, the latest, installs
beside TensorFlow 2.21 but its op library fails to load (an undefined symbol), so it is reported as skipped) in
that interpreter, reading the files one after another: its fastest way here (``TFRecordDataset(...,
num_parallel_reads=2)`` read 100k examples/s against 205k without, in one run). kubeps reads TFRecord
files with ``num_parallel_reads`` > 1 in as many child processes (``kubeps.runtime.data.reader_processes``), Parquet
and CSV in threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ctr.workload import DENSE, FIELDS, SHUFFLE_BUFFER, Teacher  # noqa: E402

import kubeps.runtime as kp  # noqa: E402
from kubeps.runtime.data import FixedLenFeature, TFRecordWriter, serialize_example  # noqa: E402

BATCH = 512


def write_files(folder: str, rows: int, files: int) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = Teacher().sample(rows, seed=1)
    ids, dense, labels = data["ids"], data["dense"], data["labels"]
    per = -(-rows // files)
    for f in range(files):
        sl = slice(f * per, min(rows, (f + 1) * per))
        table = pa.table({
            "ids": pa.FixedSizeListArray.from_arrays(pa.array(ids[sl].reshape(-1)), FIELDS),
            "dense": pa.FixedSizeListArray.from_arrays(pa.array(dense[sl].reshape(-1)), DENSE),
            "label": labels[sl],
        })
        pq.write_table(table, os.path.join(folder, f"part-{f}.parquet"), row_group_size=65536)
        with TFRecordWriter(os.path.join(folder, f"part-{f}.tfrecord")) as w:
            for i in range(sl.start, sl.stop):
                w.write(serialize_example({"ids": ids[i], "dense": dense[i], "label": labels[i]}))
        text = np.concatenate([ids[sl].astype(str), np.char.mod("%.7g", dense[sl]),
                               np.char.mod("%g", labels[sl][:, None])], axis=1)
        with open(os.path.join(folder, f"part-{f}.csv"), "w") as fh:
            fh.write("\n".join(",".join(row) for row in text.tolist()) + "\n")
    np.save(os.path.join(folder, "ids.npy"), ids)
    np.save(os.path.join(folder, "dense.npy"), dense)
    np.save(os.path.join(folder, "label.npy"), labels)
    return {fmt: os.path.join(folder, f"part-*.{fmt}") for fmt in ("parquet", "tfrecord", "csv")}


FEATURES = {"ids": FixedLenFeature([FIELDS], np.int64), "dense": FixedLenFeature([DENSE], np.float32),
            "label": FixedLenFeature([], np.float32)}


def _stack_csv(*columns):
    return {"ids": np.stack(columns[:FIELDS], axis=1), "dense": np.stack(columns[FIELDS:FIELDS + DENSE], axis=1),
            "label": columns[-1]}


def _ctr(ds: kp.Dataset) -> kp.Dataset:
    return ds.shuffle(SHUFFLE_BUFFER, seed=1).batch(BATCH, drop_remainder=True)


def pipelines(folder: str, patterns: dict[str, str], readers: int) -> dict:
    arrays = {k: np.load(os.path.join(folder, f"{k}.npy")) for k in ("ids", "dense", "label")}
    csv_defaults = [np.int64] * FIELDS + [np.float32] * DENSE + [np.float32]
    return {
        "arrays": lambda: _ctr(kp.Dataset.from_tensor_slices(arrays)),
        "parquet": lambda: _ctr(kp.ParquetDataset(patterns["parquet"], columns={"ids": np.int64, "dense": np.float32,
                                                                               "label": np.float32},
                                                  num_parallel_reads=readers)),
        "tfrecord": lambda: _ctr(kp.TFRecordDataset(patterns["tfrecord"], features=FEATURES,
                                                    num_parallel_reads=readers)),
        "csv": lambda: _ctr(kp.CsvDataset(patterns["csv"], csv_defaults, num_parallel_reads=readers)).map(_stack_csv),
    }


def examples_per_s(make) -> float:
    t0 = time.perf_counter()
    n = 0
    for batch in make():
        n += len(batch["label"])
    return n / (time.perf_counter() - t0)


TF_SCRIPT = r"""
import sys, time, glob
import tensorflow as tf
fields, dense, batch, tfrecord, csv = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
buffer = int(sys.argv[6])
spec = {"ids": tf.io.FixedLenFeature([fields], tf.int64), "dense": tf.io.FixedLenFeature([dense], tf.float32),
        "label": tf.io.FixedLenFeature([], tf.float32)}
def tfr():
    return (tf.data.TFRecordDataset(sorted(glob.glob(tfrecord))).shuffle(buffer, seed=1)
            .batch(batch, drop_remainder=True).map(lambda b: tf.io.parse_example(b, spec)))
def csvd():
    defaults = [tf.int64] * fields + [tf.float32] * dense + [tf.float32]
    def stack(*c):
        return {"ids": tf.stack(c[:fields], 1), "dense": tf.stack(c[fields:fields + dense], 1), "label": c[-1]}
    return (tf.data.experimental.CsvDataset(sorted(glob.glob(csv)), defaults).shuffle(buffer, seed=1)
            .batch(batch, drop_remainder=True).map(stack))
for name, make in (("tfrecord", tfr), ("csv", csvd), ("tfrecord", tfr), ("csv", csvd)):  # the first two: warm-up
    t0 = time.perf_counter(); n = 0
    for b in make():
        n += int(b["label"].shape[0])
    print(name, n / (time.perf_counter() - t0), flush=True)
"""


def tf_examples_per_s(python: str, patterns: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([python, "-c", TF_SCRIPT, str(FIELDS), str(DENSE), str(BATCH), patterns["tfrecord"],
                          patterns["csv"], str(SHUFFLE_BUFFER)], capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                                                                                    CUDA_VISIBLE_DEVICES=""))
    if out.returncode:
        raise RuntimeError(f"tf.data side failed: {out.stderr[-2000:]}")
    return {line.split()[0]: float(line.split()[1]) for line in out.stdout.splitlines() if line.strip()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1 << 18)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-parallel-reads", type=int, default=2)
    p.add_argument("--tf-python", help="an interpreter that imports tensorflow: tf.data reads the same files")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kubeps-input-formats-") as folder:
        t0 = time.perf_counter()
        patterns = write_files(folder, args.rows, args.files)
        print(f"wrote {args.rows} examples x {args.files} files per format in {time.perf_counter() - t0:.1f} s",
              flush=True)
        made = pipelines(folder, patterns, args.num_parallel_reads)
        for make in made.values():  # warm-up: imports, page cache
            examples_per_s(make)
        figures: dict[str, list[float]] = {name: [] for name in made}
        tf_figures: dict[str, list[float]] = {"tfrecord": [], "csv": []}
        for _ in range(args.rounds):
            for name, make in made.items():
                figures[name].append(examples_per_s(make))
            if args.tf_python:
                for name, value in tf_examples_per_s(args.tf_python, patterns).items():
                    tf_figures[name].append(value)
        base = statistics.median(figures["arrays"])
        goals = {"parquet": 0.5, "tfrecord": 0.25, "csv": 0.25}
        print(f"batches of {BATCH}, {args.rows} examples in {args.files} files, num_parallel_reads="
              f"{args.num_parallel_reads}, medians of {args.rounds} rounds:")
        print(f"  arrays (baseline)  {base:12,.0f} examples/s")
        for name, goal in goals.items():
            value = statistics.median(figures[name])
            line = f"  {name:<18} {value:12,.0f} examples/s  {value / base:.3f}x arrays (goal >= {goal}x)"
            if args.tf_python and name in tf_figures and tf_figures[name]:
                tf_value = statistics.median(tf_figures[name])
                line += f"; tf.data {tf_value:,.0f} examples/s: {value / tf_value:.2f}x tf.data"
            elif args.tf_python:
                line += "; tf.data: skipped (tensorflow-io 0.37.1 installs but its ops do not load in TF 2.21)"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
