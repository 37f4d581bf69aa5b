"""The CTR example, run the way users run it: ``kubeps local --ps 2 --workers 2 examples/ctr/train.py``."""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest

from ..conftest import CTR_EXAMPLE as EXAMPLE
from ..conftest import run_ctr_example as run_example


def load_example():
    spec = importlib.util.spec_from_file_location("ctr_train_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctr_example_gets_within_2_percent_of_the_teacher_under_kubeps_local(ctr_default_run):
    """The README's claim, with the README's command (default flags: 2400 steps of 512, ~4 passes, ~20 s)."""
    result, metrics = ctr_default_run
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


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctr_example_checkpoints_feed_the_evaluator_and_a_second_run_resumes(tmp_path):
    """With --checkpoint-dir: the sidecar evaluator writes one metrics line per checkpoint and stops by itself after
    the final one (its numbers are the chief's); a second run with the same directory and more steps resumes."""
    from kubeps.runtime.checkpoint import list_checkpoints, verify_checkpoint

    steps, every = 1200, 300  # 4 checkpoints about a second apart: the evaluator polls every 0.5 s
    ckpt, metrics_path = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    small = ("--train-examples", "50000", "--eval-examples", "10000", "--checkpoint-every", str(every),
             "--checkpoint-dir", str(ckpt))
    result, metrics = run_example("--steps", str(steps), "--metrics", str(metrics_path), *small, evaluator=True)
    out = result.stdout
    assert f"[chief-0] no checkpoint in {ckpt}: starting from step 0" in out
    saved = re.findall(rf"^\[chief-0\] step +(\d+)/{steps} .* saved (ckpt-\d+)", out, re.M)
    assert saved == [(str(every * (k + 1)), f"ckpt-{k}") for k in range(4)], out[-3000:]
    assert "saved ckpt-3 (final)" in out and metrics["resumed_from_step"] == 0

    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    # One line per checkpoint it evaluated, in order, none twice; an evaluator that falls behind on a busy machine
    # skips to the newest checkpoint (as TensorFlow's does), so intermediate ones may be missing, never the final.
    seen = [(r["checkpoint_number"], r["step"], r["final"]) for r in records]
    expected = [(0, every, False), (1, 2 * every, False), (2, 3 * every, False), (3, steps, True)]
    assert seen == sorted(set(seen)) and set(seen) <= set(expected) and seen[-1] == expected[-1], records
    # checkpoints are about a second apart: only a stall of seconds makes it skip all but the final one
    assert len(seen) >= 2 or seen == expected[-1:], records
    assert all(set(r["metrics"]) == {"logloss", "auc", "gap_pct"} for r in records)
    # the final checkpoint holds the model the chief evaluated, read from the files without the parameter servers
    assert records[-1]["metrics"]["logloss"] == pytest.approx(metrics["logloss"], abs=1e-5)
    assert records[-1]["metrics"]["auc"] == pytest.approx(metrics["auc"], abs=1e-5)
    assert len(records) == 1 or records[-1]["metrics"]["logloss"] < records[0]["metrics"]["logloss"]
    assert f"[evaluator-0] ckpt-3 (step {steps}): eval log-loss" in out
    assert f"[evaluator-0] evaluated {len(records)} checkpoint(s); metrics in {metrics_path}" in out
    assert re.search(r"evaluator-0 \(pid \d+\) exited with status 0", result.stderr), result.stderr[-2000:]

    # again, with more steps: restores ckpt-3 (variables, Adagrad slots, step) and trains only the rest
    result, resumed = run_example("--steps", str(steps + every), *small)
    assert re.search(rf"^\[chief-0\] resumed from step {steps} \({re.escape(str(ckpt))}/ckpt-3, restored in ",
                     result.stdout, re.M), result.stdout[-3000:]
    assert f"[chief-0] step {steps + every:5d}/{steps + every}  train log-loss" in result.stdout
    assert "saved ckpt-4 (final)" in result.stdout and f"[chief-0] trained {every} steps of 512" in result.stdout
    assert resumed["resumed_from_step"] == steps
    # it went on from the trained model, not from scratch (which would be far worse after so few steps); async
    # updates make the exact figure vary a little from run to run
    assert resumed["logloss"] < metrics["logloss"] + 0.02
    latest = verify_checkpoint(list_checkpoints(str(ckpt))[-1][1])
    assert latest.step == steps + every and latest.final
    assert len(list_checkpoints(str(ckpt))) == 3  # max_to_keep


def test_ctr_example_evaluator_without_a_checkpoint_dir_has_nothing_to_do(monkeypatch, capsys):
    monkeypatch.delenv("KUBEPS_CHECKPOINT_DIR", raising=False)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"evaluator": ["127.0.0.1:1"]},
                                                "task": {"type": "evaluator", "index": 0}}))
    assert load_example().main([]) == 0
    assert "without --checkpoint-dir the evaluator has nothing to do" in capsys.readouterr().out


def test_ctr_example_checkpoint_dir_defaults_to_the_environment(monkeypatch):
    ex = load_example()
    monkeypatch.delenv("KUBEPS_CHECKPOINT_DIR", raising=False)
    assert ex.parse_args([]).checkpoint_dir is None
    monkeypatch.setenv("KUBEPS_CHECKPOINT_DIR", "/ckpt/ctr")
    assert ex.parse_args([]).checkpoint_dir == "/ckpt/ctr"
    assert ex.parse_args(["--checkpoint-dir", "/elsewhere"]).checkpoint_dir == "/elsewhere"


def test_ctr_model_checkpoint_round_trip_on_local_variables(tmp_path):
    """What the evaluator does: a checkpoint of one model restored into a fresh local model evaluates the same."""
    from kubeps.runtime.checkpoint import Checkpoint, CheckpointManager, StepCounter
    from kubeps.runtime.data import InputContext

    ex = load_example()
    args = ex.parse_args(["--train-examples", "20000", "--eval-examples", "5000", "--vocab-size", "4096"])
    model, optimizer = ex.build_model(args), ex.make_optimizer(args)
    ex.train_steps(model, optimizer, iter(ex.make_dataset(args, InputContext())), 40)
    names = [v.name for v in model.variables]
    assert names[0] == "embedding/embeddings" and len(set(names)) == len(names) == 1 + 2 * len(args.hidden) + 2
    path = CheckpointManager(Checkpoint(model=model, step=StepCounter(40)), str(tmp_path)).save(final=True)
    fresh = ex.build_model(ex.parse_args(["--seed", "7", "--eval-examples", "5000", "--vocab-size", "4096"]))
    assert Checkpoint(model=fresh).restore(path) == 40
    assert ex.evaluate(fresh, args)["logloss"] == pytest.approx(ex.evaluate(model, args)["logloss"], abs=1e-7)


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
    with pytest.raises(SystemExit):
        ex.parse_args(["--checkpoint-every", "250"])
    assert "--checkpoint-every=250 must be a positive multiple of --steps-per-execution=20" in capsys.readouterr().err
    assert ex.parse_args([]).checkpoint_every == 480  # a fifth of the run
    assert ex.parse_args(["--steps", "500", "--steps-per-execution", "50"]).checkpoint_every == 100
