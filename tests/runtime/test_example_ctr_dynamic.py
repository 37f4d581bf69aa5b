"""The CTR example with raw ids from a 2**40 space in a ``DynamicEmbedding``, under
``kubeps local --ps 2 --workers 2`` (``--ids raw40``)."""

from __future__ import annotations

import pytest

from .test_example_ctr import run_example


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctr_example_with_a_dynamic_table_of_raw_40_bit_ids():
    result, metrics = run_example("--ids", "raw40")
    assert "[chief-0] dynamic embedding table of dim 8 float32 in 2 shard(s) (by key hash)" in result.stdout
    assert 0 < metrics["table_rows"] <= 6 * 200  # one row per (field, value) seen: no hashing, no collisions
    assert metrics["logloss"] <= 1.02 * metrics["teacher_logloss"], metrics
    assert metrics["logloss"] < metrics["base_logloss"] - 0.15


def test_raw_ids_are_distinct_40_bit_ids():
    from .test_example_ctr import load_example

    import numpy as np

    example = load_example()
    values = np.repeat(np.arange(200)[:, None], 6, axis=1)
    ids = example.raw_ids(values)
    assert ids.min() >= 0 and ids.max() < 2**40 and np.unique(ids).size == ids.size
