"""Click-through-rate prediction with asynchronous parameter-server training.

    kubeps local --ps 2 --workers 2 examples/ctr/train.py            # or: make example

The same program runs as every task and branches on its task type, as in TensorFlow's parameter-server guide:
ps and worker tasks start a ``Server`` and block in ``join()``; the chief is the coordinator. It creates the
variables inside ``strategy.scope()`` -- ONE embedding table for every categorical field, sharded across the
parameter servers by ``MinSizePartitioner`` -- builds a dataset on every worker, and ``schedule``s training
steps, which the workers run asynchronously: each step looks up only the rows its batch needs, computes gradients
with numpy and pushes them (row-sparse for the table) to the parameter servers, where Adagrad applies them.

The data is synthetic, with a known answer. Each example has ``FIELDS`` categorical features (site, ad, ...; a
skewed, Zipf-like choice of ``VALUES_PER_FIELD`` values each) hashed into one shared id space, plus a few dense
features. Its label is drawn from a logistic "teacher" model with a weight per (field, value), so the teacher's own
log-loss is the best any model can do, and the log-loss of always predicting the click rate (the base rate) is
what a model that learned nothing gets. The program prints both next to the trained model's log-loss and AUC,
and exits 1 if the model does not beat the base rate.

The model: ``logit = b + x_dense . w_dense + sum_f emb[id_f] . w_field[f]`` (logistic regression on learned
embeddings), with its forward and backward passes written out in numpy below.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from kubeps.runtime.cluster import TFConfigClusterResolver
from kubeps.runtime.coordinator import ClusterCoordinator
from kubeps.runtime.data import Dataset, InputContext
from kubeps.runtime.errors import RemoteError
from kubeps.runtime.optimizers import Adagrad
from kubeps.runtime.partitioners import MinSizePartitioner
from kubeps.runtime.server import Server
from kubeps.runtime.strategy import ParameterServerStrategy
from kubeps.runtime.training import IndexedSlices
from kubeps.runtime.variables import Variable, embedding_lookup

FIELDS = 6
VALUES_PER_FIELD = 1000
DENSE = 4
TEACHER_SEED = 1234


# -- synthetic data with a known best log-loss ------------------------------------------------------------------
def hash_ids(values: np.ndarray, vocab_size: int) -> np.ndarray:
    """Hash ``(field, value)`` pairs into one id space of ``vocab_size`` rows (like a hashed feature column)."""
    field = np.arange(values.shape[1], dtype=np.uint64)[None, :]
    key = field * np.uint64(1_000_003) + values.astype(np.uint64)
    mixed = (key * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(29)  # multiplicative hashing, wraps mod 2**64
    return (mixed % np.uint64(vocab_size)).astype(np.int64)


class Teacher:
    """The logistic model the labels come from: a weight per (field, value), dense weights and a bias."""

    def __init__(self, seed: int = TEACHER_SEED):
        rng = np.random.default_rng(seed)
        self.value_weights = rng.normal(0.0, 0.8, size=(FIELDS, VALUES_PER_FIELD))
        self.dense_weights = rng.normal(0.0, 0.5, size=DENSE)
        self.bias = -1.5
        popularity = 1.0 / (np.arange(VALUES_PER_FIELD) + 10.0) ** 1.1  # a few values are frequent, most rare
        self.value_probs = popularity / popularity.sum()

    def probability(self, values: np.ndarray, dense: np.ndarray) -> np.ndarray:
        logit = self.bias + dense @ self.dense_weights
        logit = logit + self.value_weights[np.arange(FIELDS)[None, :], values].sum(axis=1)
        return 1.0 / (1.0 + np.exp(-logit))

    def sample(self, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``n`` examples: raw categorical values, dense features, the teacher's click probability, the label."""
        rng = np.random.default_rng(seed)
        values = rng.choice(VALUES_PER_FIELD, size=(n, FIELDS), p=self.value_probs)
        dense = rng.normal(size=(n, DENSE)).astype(np.float32)
        p = self.probability(values, dense)
        labels = (rng.random(n) < p).astype(np.float32)
        return values, dense, p, labels


def make_dataset(args: argparse.Namespace, input_context: InputContext) -> Dataset:
    """Runs on each worker: the training set (the same on every worker), this worker's shard of it, shuffled,
    repeated and batched. Elements are ``(ids [B, FIELDS], dense [B, DENSE], labels [B])``."""
    values, dense, _, labels = Teacher().sample(args.train_examples, seed=args.seed)
    ids = hash_ids(values, args.vocab_size)
    return (
        Dataset.from_tensor_slices((ids, dense, labels))
        .shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        .shuffle(10_000, seed=args.seed + input_context.input_pipeline_id)
        .repeat()
        .batch(args.batch_size, drop_remainder=True)
        .prefetch(2)
    )


# -- metrics ----------------------------------------------------------------------------------------------------
def log_loss(labels: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve: the probability that a random click scores above a random non-click (ties
    count half), from the rank sum (Mann-Whitney U)."""
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    # average ranks over runs of equal scores
    starts = np.r_[0, np.nonzero(np.diff(sorted_scores))[0] + 1]
    ends = np.r_[starts[1:], len(scores)]
    for a, b in zip(starts, ends):
        ranks[order[a:b]] = (a + b + 1) / 2.0
    positives = labels > 0.5
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


# -- the model --------------------------------------------------------------------------------------------------
def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))


def forward(rows: np.ndarray, dense: np.ndarray, w_field: np.ndarray, w_dense: np.ndarray, bias: np.ndarray):
    """``rows`` [B, FIELDS, D] embedding rows of the batch's ids; returns the logits [B]."""
    return np.einsum("bfd,fd->b", rows, w_field) + dense @ w_dense + bias


def make_train_steps(model: dict, optimizer: Adagrad, steps_per_execution: int):
    """The function the coordinator schedules: ``steps_per_execution`` steps on whichever worker runs it."""
    table, w_field, w_dense, bias = model["embedding"], model["w_field"], model["w_dense"], model["bias"]

    def train_steps(iterator) -> float:
        total = 0.0
        for _ in range(steps_per_execution):
            ids, dense, labels = next(iterator)
            batch, dim = ids.shape[0], table.shape[1]
            rows = embedding_lookup(table, ids)  # only these rows travel, from the shards that own them
            wf, wd, b = w_field.read_value(), w_dense.read_value(), bias.read_value()
            p = sigmoid(forward(rows, dense, wf, wd, b))
            total += log_loss(labels, p)
            # backward: d(mean log-loss)/d(logit) = (p - y) / B
            g = ((p - labels) / batch).astype(np.float32)
            grad_rows = g[:, None, None] * wf[None, :, :]  # [B, FIELDS, D], one per looked-up id
            optimizer.apply_gradients([
                (IndexedSlices(grad_rows.reshape(-1, dim), ids.reshape(-1), table.shape), table),
                (np.einsum("b,bfd->fd", g, rows), w_field),
                (dense.T @ g, w_dense),
                (np.asarray(g.sum(), dtype=np.float32), bias),
            ])
        return total / steps_per_execution

    return train_steps


# -- tasks ------------------------------------------------------------------------------------------------------
def wait_for_parameter_servers(strategy: ParameterServerStrategy, timeout: float = 60.0) -> None:
    """Tasks start together; the chief waits until every ps answers before creating variables on it."""
    deadline = time.monotonic() + timeout
    for ps in range(strategy.num_ps):
        while True:
            try:
                strategy.transport.call(ps, "Ping", timeout=1.0)
                break
            except RemoteError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def run_chief(args: argparse.Namespace, resolver: TFConfigClusterResolver) -> int:
    num_ps = resolver.cluster_spec().num_tasks("ps")
    partitioner = MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=num_ps)
    strategy = ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    wait_for_parameter_servers(strategy)
    coordinator = ClusterCoordinator(strategy)
    try:
        rng = np.random.default_rng(args.seed)
        with strategy.scope():
            model = {
                "embedding": Variable(
                    rng.uniform(-0.05, 0.05, size=(args.vocab_size, args.embedding_dim)).astype(np.float32),
                    name="embedding",
                ),
                "w_field": Variable(
                    rng.normal(0.0, 0.3, size=(FIELDS, args.embedding_dim)).astype(np.float32), name="w_field"
                ),
                "w_dense": Variable(np.zeros(DENSE, np.float32), name="w_dense"),
                "bias": Variable(np.float32(0.0), name="bias"),
            }
        table = model["embedding"]
        shards = getattr(table, "variables", [table])
        print(f"embedding table {table.shape[0]}x{table.shape[1]} float32 in {len(shards)} shard(s): "
              + ", ".join(f"{v.name} {v.shape[0]} rows on {v.device}" for v in shards))

        optimizer = Adagrad(learning_rate=args.learning_rate)
        train_steps = make_train_steps(model, optimizer, args.steps_per_execution)
        per_worker_dataset = coordinator.create_per_worker_dataset(lambda ctx: make_dataset(args, ctx))
        iterator = iter(per_worker_dataset)

        started = time.perf_counter()
        executions = args.steps // args.steps_per_execution
        report_every = max(1, executions // 5)
        done = 0
        while done < executions:
            n = min(report_every, executions - done)
            losses = [coordinator.schedule(train_steps, args=(iterator,)) for _ in range(n)]
            coordinator.join()
            done += n
            mean = float(np.mean([rv.fetch() for rv in losses]))
            print(f"step {done * args.steps_per_execution:5d}/{args.steps}  train log-loss {mean:.4f}")
        elapsed = time.perf_counter() - started
        examples_per_s = args.steps * args.batch_size / elapsed

        # evaluation on the chief: read the trained variables (the table's shards are concatenated)
        teacher = Teacher()
        values, dense, p_teacher, labels = teacher.sample(args.eval_examples, seed=args.seed + 10_000)
        ids = hash_ids(values, args.vocab_size)
        table_value = np.asarray(table)
        p_model = sigmoid(forward(table_value[ids], dense, np.asarray(model["w_field"]),
                                  np.asarray(model["w_dense"]), np.asarray(model["bias"])))
        click_rate = float(labels.mean())
        result = {
            "logloss": log_loss(labels, p_model),
            "auc": auc(labels, p_model),
            "base_logloss": log_loss(labels, np.full_like(labels, click_rate)),
            "teacher_logloss": log_loss(labels, p_teacher),
            "teacher_auc": auc(labels, p_teacher),
            "click_rate": click_rate,
            "examples_per_s": examples_per_s,
            "embedding_shards": len(shards),
        }
        print(f"eval: log-loss {result['logloss']:.4f}  AUC {result['auc']:.4f}  |  base rate ({click_rate:.3f}) "
              f"log-loss {result['base_logloss']:.4f}  |  teacher (best achievable) log-loss "
              f"{result['teacher_logloss']:.4f} AUC {result['teacher_auc']:.4f}  |  {examples_per_s:.0f} examples/s")
        print("RESULT " + json.dumps(result))
        if not result["logloss"] < result["base_logloss"]:
            print("the model did not beat the base rate", file=sys.stderr)
            return 1
        return 0
    finally:
        coordinator.shutdown()
        strategy.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="kubeps CTR example: asynchronous PS training on synthetic clicks")
    p.add_argument("--steps", type=int, default=2400, help="training steps in total, over all workers")
    p.add_argument("--steps-per-execution", type=int, default=20, help="steps per scheduled function")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=1 << 16, help="rows of the hashed embedding table")
    p.add_argument("--embedding-dim", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=0.3, help="Adagrad learning rate")
    p.add_argument("--train-examples", type=int, default=200_000)
    p.add_argument("--eval-examples", type=int, default=50_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "steps_per_execution", "batch_size", "vocab_size", "embedding_dim", "train_examples",
                 "eval_examples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps % args.steps_per_execution:
        p.error(f"--steps={args.steps} must be a multiple of --steps-per-execution={args.steps_per_execution}")
    if not args.learning_rate > 0:
        p.error(f"--learning-rate must be > 0, got {args.learning_rate}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    resolver = TFConfigClusterResolver()
    task_type = resolver.task_type
    if task_type in ("ps", "worker"):
        server = Server(resolver.cluster_spec(), job_name=task_type, task_index=resolver.task_id)
        server.join()  # serves until the launcher (or Kubernetes) stops this task
        return 0
    if task_type == "evaluator":
        print("this example evaluates on the chief at the end of training; the evaluator has nothing to do")
        return 0
    if task_type not in (None, "chief"):
        print(f"unknown task type {task_type!r}", file=sys.stderr)
        return 2
    if task_type is None:
        print("TF_CONFIG is not set: run this with  kubeps local --ps 2 --workers 2 examples/ctr/train.py",
              file=sys.stderr)
        return 2
    return run_chief(args, resolver)


if __name__ == "__main__":
    sys.exit(main())
