"""The CTR example, run the way users run it: ``kubeps local --ps 2 --workers 2 examples/ctr/train.py``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ctr" / "train.py"


def load_example():
    spec = importlib.util.spec_from_file_location("ctr_train_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(*script_args: str) -> tuple[subprocess.CompletedProcess, dict]:
    result = subprocess.run(
        [sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "2", "--workers", "2", str(EXAMPLE),
         "--", *script_args],
        capture_output=True, text=True, timeout=170,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("[chief-0] RESULT ")]
    assert len(lines) == 1, result.stdout[-3000:]
    return result, json.loads(lines[0].split(" RESULT ", 1)[1])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctr_example_gets_within_2_percent_of_the_teacher_under_kubeps_local():
    """The README's claim, with the README's command (default flags: 2400 steps of 512, ~4 passes, ~20 s)."""
    result, metrics = run_example()
    assert metrics["embedding_shards"] == 2  # MinSizePartitioner split the one table across both ps
    assert metrics["logloss"] <= 1.02 * metrics["teacher_logloss"], metrics
    assert metrics["gap_pct"] == pytest.approx(100 * (metrics["logloss"] / metrics["teacher_logloss"] - 1))
    assert metrics["logloss"] > metrics["teacher_logloss"] - 0.01  # nobody beats the teacher by much
    assert metrics["logloss"] < metrics["base_logloss"] - 0.15
    assert metrics["auc"] > metrics["teacher_auc"] - 0.015
    assert metrics["passes"] == pytest.approx(2400 * 512 / 300_000)
    assert "[chief-0] embedding table 65536x8 float32 in 2 shard(s)" in result.stdout
    assert "[chief-0]   gap to the teacher: " in result.stdout
    assert "chief-0 exited with status 0" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctr_example_short_run_beats_the_base_rate_with_the_old_flags():
    """A short run with the flags scripts used before the nn-layer version (batch 256, fewer examples)."""
    _, metrics = run_example("--steps", "400", "--batch-size", "256", "--train-examples", "50000",
                             "--eval-examples", "20000", "--steps-per-execution", "20")
    assert metrics["logloss"] < metrics["base_logloss"] - 0.05
    assert metrics["logloss"] > metrics["teacher_logloss"] - 0.02
    assert metrics["auc"] > 0.7


def test_ctr_model_trains_in_process_on_local_variables():
    """The same model code, built outside a strategy scope: local variables updated in place by Adagrad."""
    from kubeps.runtime.data import InputContext

    ex = load_example()
    args = ex.parse_args(["--steps", "200", "--train-examples", "20000", "--eval-examples", "5000",
                          "--vocab-size", "4096"])
    model, optimizer = ex.build_model(args), ex.make_optimizer(args)
    assert model.embedding.embeddings.shape == (4096, 8)
    assert model.embedding.embeddings.is_remote is False
    before = ex.evaluate(model, args)
    iterator = iter(ex.make_dataset(args, InputContext()))
    first = ex.train_steps(model, optimizer, iterator, 20)
    for _ in range(9):
        last = ex.train_steps(model, optimizer, iterator, 20)
    after = ex.evaluate(model, args)
    assert last < first
    assert after["logloss"] < before["logloss"] - 0.05
    assert after["logloss"] < after["base_logloss"]
    assert after["teacher_logloss"] == before["teacher_logloss"]  # the same held-out examples


def test_ctr_example_without_tf_config_explains_how_to_run_it(monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert load_example().main([]) == 2
    assert "kubeps local --ps 2 --workers 2" in capsys.readouterr().err


def test_ctr_example_metrics_and_hashing():
    ex = load_example()
    rng = np.random.default_rng(0)
    labels = (rng.random(300) < 0.3).astype(np.float32)
    scores = np.round(rng.random(300) + labels * 0.3, 1)  # with ties
    pos, neg = scores[labels > 0.5], scores[labels < 0.5]
    brute = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (pos.size * neg.size)
    assert ex.auc(labels, scores) == pytest.approx(brute)
    assert ex.log_loss(np.array([1.0, 0.0]), np.array([0.5, 0.5])) == pytest.approx(np.log(2))
    values = rng.integers(0, ex.VALUES_PER_FIELD, size=(1000, ex.FIELDS))
    ids = ex.hash_ids(values, 1 << 16)
    assert ids.min() >= 0 and ids.max() < 1 << 16
    assert np.array_equal(ids, ex.hash_ids(values, 1 << 16))
    # the same value in different fields lands on different rows
    same = np.zeros((1, ex.FIELDS), dtype=np.int64)
    assert len(set(ex.hash_ids(same, 1 << 16)[0].tolist())) == ex.FIELDS


def test_ctr_example_rejects_bad_arguments(capsys):
    ex = load_example()
    with pytest.raises(SystemExit) as err:
        ex.parse_args(["--steps", "30", "--steps-per-execution", "20"])
    assert err.value.code == 2
    assert "--steps=30 must be a multiple of --steps-per-execution=20" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ex.parse_args(["--batch-size", "0"])
    assert "--batch-size must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ex.parse_args(["--hidden", "16", "0"])
    assert "--hidden units must be >= 1, got [16, 0]" in capsys.readouterr().err
