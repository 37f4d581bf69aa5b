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
def test_jax_example_gets_within_2_percent_of_the_teacher_under_kubeps_local(ctr_default_run):
    """``kubeps local --ps 2 --workers 2 examples/ctr/train_jax.py`` with the default flags (2400 steps of 512): the
    README's claim for the numpy example holds for the JAX one, on the same held-out data. (Two workers update the
    ps asynchronously, so two runs differ by up to ~0.6%; the models are compared with one worker below.)"""
    result, jax_metrics = run_example(script=JAX_EXAMPLE)
    _, numpy_metrics = ctr_default_run
    assert jax_metrics["teacher_logloss"] == numpy_metrics["teacher_logloss"]  # the same held-out data
    assert jax_metrics["logloss"] <= 1.02 * jax_metrics["teacher_logloss"], jax_metrics
    assert jax_metrics["logloss"] < jax_metrics["base_logloss"] - 0.15
    assert jax_metrics["embedding_shards"] == 2
    assert "[chief-0] embedding table 65536x8 float32 in 2 shard(s)" in result.stdout
    assert "chief-0 exited with status 0" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_jax_example_with_one_worker_computes_the_numpy_examples_log_loss(ctr_one_worker_run):
    """With one worker a run is deterministic, so the JAX model (gradients from ``jax.value_and_grad``) is held to the
    hand-written numpy model's exact result: same data, seed, initial weights and optimizer, default flags. Observed
    equal to the last bit; 1e-5 leaves room for another BLAS."""
    _, jax_metrics = run_example(script=JAX_EXAMPLE, workers=1)
    _, numpy_metrics = ctr_one_worker_run
    assert jax_metrics["logloss"] == pytest.approx(numpy_metrics["logloss"], rel=1e-5), (jax_metrics, numpy_metrics)
    assert jax_metrics["auc"] == pytest.approx(numpy_metrics["auc"], rel=1e-5)


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
