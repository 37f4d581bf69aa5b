"""Input pipeline throughput: the CTR pipeline's batches per second, block-wise vs element-wise, in one run.

    .venv/bin/python bench/input_pipeline.py [--rows 262144] [--batches 400]

The pipeline of ``bench/ctr``: ``from_tensor_slices((ids [N, 8] int64, dense [N, 13] float32, labels [N]))
.shard(2, 0).shuffle(10_000).repeat().batch(512, drop_remainder=True)``. Array sources pass *blocks* through
shard/shuffle/repeat, so batches are cut with slicing and gathers; the baseline is the same pipeline fed from a
generator, which has no blocks, so every node works one element at a time (what every pipeline did before).
Both give the same batches (``tests/runtime/test_data.py``). Prints ms per batch of each and the speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kubeps.runtime.data import Dataset


def pipeline(source, batch: int) -> Dataset:
    return source.shard(2, 0).shuffle(10_000, seed=1).repeat().batch(batch, drop_remainder=True)


def ms_per_batch(ds: Dataset, batches: int) -> float:
    it = iter(ds)
    next(it)  # fill the shuffle buffer outside the timing
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return (time.perf_counter() - t0) / batches * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1 << 18)
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    data = (rng.integers(0, 1 << 20, size=(args.rows, 8)), rng.normal(size=(args.rows, 13)).astype(np.float32),
            (rng.random(args.rows) < 0.3).astype(np.float32))
    blocked, elements = [], []
    for _ in range(args.rounds):  # alternate, so load on a shared machine falls on both
        blocked.append(ms_per_batch(pipeline(Dataset.from_tensor_slices(data), args.batch_size), args.batches))
        source = Dataset.from_generator(lambda: Dataset.from_tensor_slices(data).as_numpy_iterator())
        elements.append(ms_per_batch(pipeline(source, args.batch_size), max(20, args.batches // 10)))
    b, e = statistics.median(blocked), statistics.median(elements)
    print(f"batch {args.batch_size}: block-wise {b:.3f} ms/batch, element-wise (baseline) {e:.3f} ms/batch: "
          f"{e / b:.1f}x faster (medians of {args.rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
