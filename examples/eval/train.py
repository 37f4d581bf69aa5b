"""Checkpointed training with a sidecar evaluator: the pattern TensorFlow supports for evaluation in PS training.

The model is a logistic regression over a sharded embedding of categorical ids (the core of a CTR model). The chief
trains it in chunks, saves a checkpoint after each chunk (the last one ``final``) and restores the latest one when it
starts, so a restarted chief resumes. The evaluator task reads each checkpoint straight from its files (no parameter
servers needed), computes the log-loss on a held-out set and appends a JSON line to ``--metrics``; it stops after the
final checkpoint.

    kubeps local --ps 2 --workers 2 --evaluator examples/eval/train.py -- --checkpoint-dir /tmp/kubeps-eval
    cat /tmp/kubeps-eval/eval/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import kubeps.runtime as kp
from kubeps.runtime.server import main as serve  # a ps or worker task: `python -m kubeps.runtime.server`'s main

VOCAB, FIELDS = 300, 5


def batch(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids and click labels from a fixed teacher: every id has a hidden effect on the click probability."""
    effect = np.random.default_rng(42).normal(size=VOCAB)
    ids = rng.integers(0, VOCAB, size=(size, FIELDS))
    p = 1.0 / (1.0 + np.exp(-(effect[ids].sum(axis=1) / np.sqrt(FIELDS) - 0.5)))
    return ids, (rng.random(size) < p).astype(np.float32)


class Batches:
    """A worker's endless stream of training batches."""

    def __init__(self, seed: int, size: int):
        self.seed, self.size = seed, size

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        while True:
            yield batch(rng, self.size)


def log_loss(emb: np.ndarray, bias: np.ndarray, ids: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(1.0 / (1.0 + np.exp(-(emb[ids, 0].sum(axis=1) + bias[0]))), 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def chief(args) -> None:
    strategy = kp.ParameterServerStrategy.from_tf_config(variable_partitioner=kp.FixedShardsPartitioner(2))
    with strategy.scope():
        emb = kp.Variable(np.zeros((VOCAB, 1), np.float32), name="emb")
        bias = kp.Variable(np.zeros(1, np.float32), name="bias")
    opt = kp.Adagrad(0.2)
    step = kp.StepCounter()
    manager = kp.CheckpointManager(kp.Checkpoint(model=[emb, bias], step=step), args.checkpoint_dir, max_to_keep=3)
    start = manager.restore_or_initialize()
    print(f"starting at step {start} (latest checkpoint: {manager.latest_checkpoint})", flush=True)
    coordinator = kp.ClusterCoordinator(strategy)
    size = args.batch_size
    iterator = iter(coordinator.create_per_worker_dataset(lambda ctx: Batches(ctx.input_pipeline_id, size)))

    def train_step(it):
        ids, y = next(it)
        p = 1.0 / (1.0 + np.exp(-(kp.embedding_lookup(emb, ids)[..., 0].sum(axis=1) + bias.numpy()[0])))
        g = ((p - y) / len(y)).astype(np.float32)
        opt.apply_gradients([
            (kp.IndexedSlices(np.repeat(g, ids.shape[1])[:, None], ids.reshape(-1)), emb),
            (np.array([g.sum()], np.float32), bias),
        ])

    for chunk in range(start, args.steps, args.checkpoint_every):
        end = min(chunk + args.checkpoint_every, args.steps)
        for _ in range(chunk, end):
            coordinator.schedule(train_step, args=(iterator,))
        coordinator.join()
        step.assign(end)
        print(f"step {end}: saved {manager.save(final=end == args.steps)}", flush=True)
    coordinator.shutdown()


def evaluator(args) -> None:
    held_out = [batch(np.random.default_rng(10_000 + i), 1000) for i in range(5)]

    def eval_fn(values, batches):
        return {"log_loss": float(np.mean([log_loss(values["model/emb"], values["model/bias"], ids, y)
                                           for ids, y in batches]))}

    records = kp.SidecarEvaluator(eval_fn, held_out, args.checkpoint_dir, metrics_path=args.metrics,
                                  poll_interval=0.5, timeout=args.evaluator_timeout,
                                  settings=kp.TFConfigClusterResolver().settings).start()  # its $KUBEPS_LOGDIR
    for r in records:
        print(f"checkpoint {r['checkpoint_number']} (step {r['step']}): {json.dumps(r['metrics'])}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint-dir", required=True, help="a path or an fsspec URL every task can reach")
    p.add_argument("--metrics", default=None, help="evaluator output (default: CHECKPOINT_DIR/eval/metrics.jsonl)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--evaluator-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("type")
    if task in ("ps", "worker"):
        sys.exit(serve())  # also serves the checkpoint RPCs, which a bare kp.Server does not register
    if task == "evaluator":
        evaluator(args)
    elif task == "chief":
        kp.run_coordinator(lambda: chief(args))
    else:
        p.error("run it as a cluster: kubeps local --ps 2 --workers 2 --evaluator examples/eval/train.py -- ...")


if __name__ == "__main__":
    main()
