"""Reading Criteo-format files: lines/s of ``Dataset.from_files(paths, reader="criteo").batch(512)`` against a plain
Python loop (``for line in f``, ``split("\\t")``, ``int()`` per field) that makes the same arrays, in one run.

    .venv/bin/python bench/criteo_reader.py [--lines 400000] [--rounds 3] [--gzip]

The files are written once by ``examples/criteo/generate.py`` (two files, Criteo's Kaggle per-field
cardinalities and empty-value rates) into a temporary folder and read once untimed (page cache, imports). Then
the rounds alternate between the two readers, so load on a shared machine falls on both; each figure is the median
of ``--rounds``, as lines per second of this process's CPU time (per core: the reader runs in one thread) and of
wall time. ``--gzip`` writes ``.txt.gz`` files instead (the figure then includes decompression).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "criteo"))
import generate  # noqa: E402 - examples/criteo/generate.py

import kubeps.runtime as kp  # noqa: E402
from kubeps.runtime.data.criteo import open_criteo  # noqa: E402

BATCH = 512


def read_kubeps(paths: list[str]) -> int:
    lines = 0
    for batch in kp.Dataset.from_files(paths, reader="criteo").batch(BATCH):
        lines += len(batch["label"])
    return lines


def read_python(paths: list[str]) -> int:
    """The baseline: a line at a time, a field at a time, into the same arrays (batches of 512)."""
    lines = 0
    for path in paths:
        with open_criteo(path) as f:
            labels, dense, categorical = [], [], []
            for line in f:
                fields = line.rstrip(b"\r\n").split(b"\t")
                labels.append(int(fields[0]))
                dense.append([int(v) if v else 0 for v in fields[1:14]])
                categorical.append([int(v, 16) if v else -1 for v in fields[14:]])
                if len(labels) == BATCH:
                    np.asarray(labels, np.int64), np.asarray(dense, np.float32), np.asarray(categorical, np.int64)
                    lines += BATCH
                    labels, dense, categorical = [], [], []
            lines += len(labels)
    return lines


def measure(read: Callable[[list[str]], int], paths: list[str]) -> tuple[float, float]:
    """(lines per CPU second, lines per wall second) of one pass."""
    cpu, wall = time.process_time(), time.perf_counter()
    lines = read(paths)
    return lines / (time.process_time() - cpu), lines / (time.perf_counter() - wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gzip", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        record = generate.generate(folder, args.lines, files=2, gzipped=args.gzip, seed=1)
        paths = [os.path.join(folder, name) for name in record["files"]]
        size = sum(os.path.getsize(p) for p in paths)
        readers = {"kubeps criteo reader": read_kubeps, "python line loop (baseline)": read_python}
        for read in readers.values():
            assert read(paths) == args.lines  # warm-up: page cache, imports
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in readers}
        for _ in range(args.rounds):
            for name, read in readers.items():
                figures[name].append(measure(read, paths))
    print(f"{args.lines} lines in 2 {'gzip ' if args.gzip else ''}files ({size / 2**20:.0f} MiB), batches of {BATCH}, "
          f"median of {args.rounds} rounds")
    print(f"{'reader':30} {'lines/s (CPU)':>14} {'lines/s (wall)':>15}")
    medians = {}
    for name, values in figures.items():
        medians[name] = cpu, wall = (statistics.median(v[0] for v in values), statistics.median(v[1] for v in values))
        print(f"{name:30} {cpu:14.0f} {wall:15.0f}")
    ours, base = medians["kubeps criteo reader"], medians["python line loop (baseline)"]
    print(f"ratio to the python loop: {ours[0] / base[0]:.2f}x (CPU), {ours[1] / base[1]:.2f}x (wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
