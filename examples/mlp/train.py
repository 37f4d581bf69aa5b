"""Dense MLP classifier on synthetic data, trained with kubeps kernels, layers and optimizers.

The data: points in ``--features`` dimensions labelled by a fixed random "teacher" network (argmax of a random
2-layer tanh net), so the best achievable accuracy is 100% and a model that learns gets close to it.

Without TF_CONFIG it runs in-process: the variables are local (no ``strategy.scope()``) and
``optimizer.apply_gradients`` updates them in place through the same code path the parameter servers use.

Under ``kubeps local`` (TF_CONFIG set) the same file runs as every task: ps and worker tasks serve, the chief
builds the model inside ``strategy.scope()`` (variables on the parameter servers, optimizer updates applied there)
and schedules ``train_steps(iterator, n)`` -- ``--steps-per-execution`` steps per scheduled call -- on the workers.

    python examples/mlp/train.py --steps 600 --steps-per-execution 20
    kubeps local --ps 2 --workers 2 examples/mlp/train.py -- --steps 600
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import kubeps.runtime as kp
from kubeps.runtime.server import main as serve  # a ps or worker task: `python -m kubeps.runtime.server`'s main
from kubeps.runtime.ops import kernels
from kubeps.runtime.ops import nn
from kubeps.runtime.settings import TaskSettings


def make_teacher(features: int, classes: int, seed: int):
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(features, 32)) / np.sqrt(features)
    w2 = rng.normal(size=(32, classes)) * 2.0

    def label(x: np.ndarray) -> np.ndarray:
        return np.argmax(np.tanh(x @ w1) @ w2, axis=1)

    return label


def batches(features: int, batch_size: int, teacher, seed: int):
    """An endless stream of ``(x, y)`` batches (datasets repeat; the program schedules a fixed number of steps)."""
    rng = np.random.default_rng(seed)
    while True:
        x = rng.normal(size=(batch_size, features)).astype(np.float32)
        yield x, teacher(x)


def build(args) -> tuple[nn.MLP, kp.Optimizer]:
    model = nn.MLP(args.hidden, output_units=args.classes, activation="relu", input_dim=args.features,
                   seed=args.seed)
    lr = kp.ExponentialDecay(args.learning_rate, decay_steps=max(1, args.steps // 4), decay_rate=0.7)
    opt = kp.optimizer_from_config({"class_name": args.optimizer, "config": {"learning_rate": lr.get_config()}})
    return model, opt


def train_steps(model: nn.MLP, opt: kp.Optimizer, iterator, n: int) -> float:
    """``n`` training steps (``steps_per_execution``); returns their mean loss."""
    loss = nn.SoftmaxCrossEntropy()
    total = 0.0
    for _ in range(n):
        x, y = next(iterator)
        total += model.train_step(x, y, loss, opt)
    return total / n


def evaluate(model: nn.MLP, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    logits = model.forward(x)
    return {"loss": nn.SoftmaxCrossEntropy().forward(logits, y),
            "accuracy": float((np.argmax(logits, axis=1) == y).mean())}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description="kubeps MLP classifier on synthetic data (in-process)")
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 64])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--steps-per-execution", type=int, default=20)
    p.add_argument("--optimizer", default="Adam", choices=["SGD", "Momentum", "Adagrad", "Adam"])
    p.add_argument("--learning-rate", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=None, help="exit 1 if eval accuracy ends below this")
    args = p.parse_args(argv)
    if args.steps % args.steps_per_execution:
        p.error(f"--steps={args.steps} must be a multiple of --steps-per-execution={args.steps_per_execution}")

    if os.environ.get("TF_CONFIG"):
        return run_distributed(args)
    kernels.backend(TaskSettings.from_env())  # fail early and clearly if KUBEPS_DEVICE=gpu is set without a GPU
    teacher = make_teacher(args.features, args.classes, seed=1234)
    rng = np.random.default_rng(99)
    x_eval = rng.normal(size=(4096, args.features)).astype(np.float32)
    y_eval = teacher(x_eval)
    model, opt = build(args)
    it = batches(args.features, args.batch_size, teacher, seed=args.seed)

    t0 = time.perf_counter()
    for done in range(0, args.steps, args.steps_per_execution):
        mean_loss = train_steps(model, opt, it, args.steps_per_execution)
        step = done + args.steps_per_execution
        if step % max(args.steps // 6, args.steps_per_execution) == 0 or step == args.steps:
            print(f"step {step:5d}  train loss {mean_loss:.4f}  eval {json.dumps(evaluate(model, x_eval, y_eval))}")
    elapsed = time.perf_counter() - t0
    result = evaluate(model, x_eval, y_eval)
    result["examples_per_s"] = args.steps * args.batch_size / elapsed
    print(f"final: eval loss {result['loss']:.4f}  accuracy {result['accuracy']:.4f}  "
          f"({result['examples_per_s']:.0f} examples/s)")
    if args.min_accuracy is not None and result["accuracy"] < args.min_accuracy:
        print(f"accuracy {result['accuracy']:.4f} < --min-accuracy {args.min_accuracy}", file=sys.stderr)
        sys.exit(1)
    return result


class WorkerBatches:
    """The per-worker dataset: an endless batch stream seeded by the worker's input pipeline id."""

    def __init__(self, features: int, batch_size: int, classes: int, seed: int):
        self.features, self.batch_size, self.classes, self.seed = features, batch_size, classes, seed

    def __iter__(self):
        return batches(self.features, self.batch_size, make_teacher(self.features, self.classes, seed=1234), self.seed)


def run_distributed(args) -> dict[str, float]:
    task = kp.TFConfigClusterResolver().task_type
    if task in ("ps", "worker"):
        sys.exit(serve())
    if task != "chief":
        print(f"examples/mlp: nothing to do for task type {task!r}", file=sys.stderr)
        sys.exit(0)
    strategy = kp.ParameterServerStrategy.from_tf_config()
    with strategy.scope():
        model, opt = build(args)
    coordinator = kp.ClusterCoordinator(strategy)
    f, b, c, seed, n = args.features, args.batch_size, args.classes, args.seed, args.steps_per_execution

    def dataset_fn(ctx):
        return WorkerBatches(f, b, c, seed + 1000 * ctx.input_pipeline_id)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step_fn(it):
        return train_steps(model, opt, it, n)

    teacher = make_teacher(args.features, args.classes, seed=1234)
    rng = np.random.default_rng(99)
    x_eval = rng.normal(size=(4096, args.features)).astype(np.float32)
    y_eval = teacher(x_eval)
    t0 = time.perf_counter()
    losses = [coordinator.schedule(step_fn, args=(iterator,)) for _ in range(args.steps // n)]
    coordinator.join()
    elapsed = time.perf_counter() - t0
    mean_losses = [float(r.fetch()) for r in losses]
    result = evaluate(model, x_eval, y_eval)
    result["examples_per_s"] = args.steps * args.batch_size / elapsed
    print(f"train loss first {mean_losses[0]:.4f} last {mean_losses[-1]:.4f}")
    print(f"final: eval loss {result['loss']:.4f}  accuracy {result['accuracy']:.4f}  "
          f"({result['examples_per_s']:.0f} examples/s, {strategy.num_ps} ps, {strategy.num_workers} workers)")
    coordinator.shutdown()
    if args.min_accuracy is not None and result["accuracy"] < args.min_accuracy:
        print(f"accuracy {result['accuracy']:.4f} < --min-accuracy {args.min_accuracy}", file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
