"""The MLP example learns in-process (variables local, updates through the PS optimizer code path)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"example_{Path(path).parent.name}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mlp_example_learns_the_teacher(capsys):
    mlp = load("examples/mlp/train.py")
    chance = mlp.main(["--steps", "10", "--steps-per-execution", "10", "--learning-rate", "1e-9"])
    result = mlp.main(["--steps", "300", "--steps-per-execution", "10"])
    assert result["accuracy"] > 0.8 and result["accuracy"] > chance["accuracy"] + 0.3
    assert result["loss"] < 0.5 * chance["loss"]
    assert "final: eval loss" in capsys.readouterr().out


def test_train_steps_runs_n_steps_per_call():
    mlp = load("examples/mlp/train.py")
    calls = []

    class Counting:
        def __init__(self, it):
            self.it = it

        def __next__(self):
            calls.append(1)
            return next(self.it)

    import argparse

    args = argparse.Namespace(hidden=[4], classes=3, features=5, seed=0, learning_rate=0.01, steps=8,
                              optimizer="Adagrad")
    model, opt = mlp.build(args)
    it = Counting(mlp.batches(5, 16, mlp.make_teacher(5, 3, seed=1), seed=0))
    loss = mlp.train_steps(model, opt, it, 4)
    assert len(calls) == 4 and np.isfinite(loss)
