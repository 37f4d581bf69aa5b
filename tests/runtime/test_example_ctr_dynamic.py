"""The CTR example with raw ids from a 2**40 space in a ``DynamicEmbedding``, under
``kubeps local --ps 2 --workers 2`` (``--ids raw40``)."""

from __future__ import annotations

import json
import re

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


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_dynamic_table_is_checkpointed_evaluated_and_resumed(tmp_path):
    """--ids raw40 --checkpoint-dir: the evaluator restores the table into its own process and scores the final
    checkpoint as the chief scored its live table; a second run resumes the table with its rows."""
    from kubeps.runtime.checkpoint import CheckpointReader, latest_checkpoint

    ckpt, metrics_path = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    small = ("--ids", "raw40", "--train-examples", "50000", "--eval-examples", "10000", "--checkpoint-every", "300",
             "--checkpoint-dir", str(ckpt))
    result, metrics = run_example("--steps", "600", "--metrics", str(metrics_path), *small, evaluator=True)
    assert "saved ckpt-1 (final)" in result.stdout, result.stdout[-3000:]
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert records[-1]["final"] and records[-1]["step"] == 600
    # unseen ids read the default row in both: the evaluator's restored table admits nothing
    assert records[-1]["metrics"]["logloss"] == pytest.approx(metrics["logloss"], abs=1e-5)
    table = CheckpointReader(latest_checkpoint(str(ckpt))).table("model/embedding")
    assert table.size() == metrics["table_rows"] and table.entry.num_shards == 2

    result, resumed = run_example("--steps", "900", *small)
    assert re.search(r"^\[chief-0\] resumed from step 600 ", result.stdout, re.M), result.stdout[-3000:]
    assert resumed["table_rows"] >= metrics["table_rows"] and resumed["resumed_from_step"] == 600
    assert resumed["logloss"] < metrics["logloss"] + 0.02
