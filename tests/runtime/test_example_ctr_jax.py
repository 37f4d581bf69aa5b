"""The CTR example written with jax.numpy (``examples/ctr/train_jax.py``), run as a user runs it, against the numpy
example on the same data, seed and steps."""

from __future__ import annotations

import json

import pytest

from .test_example_ctr import EXAMPLE, load_example, run_example

pytest.importorskip("jax")

JAX_EXAMPLE = EXAMPLE.with_name("train_jax.py")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_jax_example_matches_the_numpy_example_within_half_a_percent(ctr_default_run):
    """``kubeps local --ps 2 --workers 2 examples/ctr/train_jax.py`` with the default flags (2400 steps of 512):
    its eval log-loss is within 0.5% of the numpy example's, measured here with the same flags."""
    result, jax_metrics = run_example(script=JAX_EXAMPLE)
    _, numpy_metrics = ctr_default_run
    assert jax_metrics["logloss"] == pytest.approx(numpy_metrics["logloss"], rel=0.005), (jax_metrics, numpy_metrics)
    assert jax_metrics["teacher_logloss"] == numpy_metrics["teacher_logloss"]  # the same held-out data
    assert jax_metrics["logloss"] <= 1.02 * jax_metrics["teacher_logloss"]
    assert jax_metrics["embedding_shards"] == 2
    assert "[chief-0] embedding table 65536x8 float32 in 2 shard(s)" in result.stdout
    assert "chief-0 exited with status 0" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_jax_example_checkpoints_feed_its_evaluator_and_restore_into_the_numpy_model(tmp_path):
    """With --checkpoint-dir the JAX example's sidecar evaluator reports the chief's eval log-loss; the checkpoint
    carries the numpy model's variable names, so the numpy example's model restores it and predicts the same."""
    from kubeps.runtime.checkpoint import Checkpoint, latest_checkpoint

    ckpt, metrics_path = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    flags = ["--steps", "400", "--train-examples", "50000", "--eval-examples", "10000"]
    _, metrics = run_example(*flags, "--checkpoint-every", "400", "--checkpoint-dir", str(ckpt), "--metrics",
                             str(metrics_path), script=JAX_EXAMPLE, evaluator=True)
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert len(records) == 1 and records[0]["metrics"]["logloss"] == pytest.approx(metrics["logloss"], rel=1e-5)

    ex = load_example()
    args = ex.parse_args(flags)
    model = ex.build_model(args)  # the numpy layers, local variables
    Checkpoint(model=model).restore(latest_checkpoint(str(ckpt)))
    assert ex.evaluate(model, args)["logloss"] == pytest.approx(metrics["logloss"], rel=1e-5)
