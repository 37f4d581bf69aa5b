"""Click-through-rate prediction with asynchronous parameter-server training.

    kubeps local --ps 2 --workers 2 examples/ctr/train.py            # or: make example

    # the same training set from Parquet files on object storage (any fsspec URL; AWS_* variables for S3)
    python examples/ctr/train.py --write-data s3://bucket/ctr
    kubeps local --ps 2 --workers 2 examples/ctr/train.py -- --data 's3://bucket/ctr/part-*.parquet'

The same program runs as every task and branches on its task type, as in TensorFlow's parameter-server guide:
ps and worker tasks start a ``Server`` and block in ``join()``; the chief is the coordinator. It builds the model
inside ``strategy.scope()`` -- ONE embedding table for every categorical field, sharded across the parameter
servers by ``MinSizePartitioner``, and a small MLP head -- builds a dataset on every worker, and ``schedule``s
``--steps-per-execution`` training steps at a time, which the workers run asynchronously: each step pulls only
the embedding rows its batch needs, runs the layers' forward and backward passes with numpy and pushes the
gradients (row-sparse for the table) to the parameter servers, where Adagrad applies them.

The model (``kubeps.runtime.ops.nn`` layers)::

    ids [B, FIELDS] --Embedding--> [B, FIELDS, DIM] --flatten--+
                                                               +--concat--> MLP(hidden, relu) --> logit --> p
    dense [B, DENSE] ------------------------------------------+

The data is synthetic, with a known answer. Each example has ``FIELDS`` categorical features (site, ad, ...; a
skewed, Zipf-like choice of ``VALUES_PER_FIELD`` values each) hashed into one shared id space, plus a few dense
features. Its label is drawn from a logistic "teacher": ``logit = bias + dense . w + sum_f weight[f, value_f]``.
The model can represent the teacher exactly (an embedding coordinate carries each weight, and a ReLU pair
``relu(z) - relu(-z) = z`` passes a sum through the MLP), so the teacher's own log-loss on held-out data is the
best any model can do, and the log-loss of always predicting the click rate (the base rate) is what a model that
learned nothing gets. The program trains several passes over a finite training set, evaluates on held-out
examples from the same teacher, prints the model's log-loss and AUC next to both references and the gap to the
teacher in %, and exits 1 if the model does not beat the base rate.

Fault tolerance (``docs/fault-tolerance.md``). With ``--checkpoint-dir`` (default: ``$KUBEPS_CHECKPOINT_DIR``; unset =
no checkpoints) the chief saves the variables -- with their Adagrad slots, which the parameter servers write with
their shards -- and the step every ``--checkpoint-every`` steps, the last checkpoint marked final, and on start
restores the latest one and continues from its step. Every task that saves or restores (chief, ps, evaluator)
must see that directory: a local path under ``kubeps local``, a shared PVC or an object store (``s3://...``) in a
cluster. The chief runs under ``run_coordinator``: a lost parameter server ends it with the retryable status 133,
and ``kubeps local --restart`` (or the operator) restarts it, losing at most one checkpoint interval. A lost
worker costs nothing: its executions are re-run elsewhere (at least once). The ``evaluator`` task, given a
checkpoint directory, evaluates every checkpoint with ``SidecarEvaluator`` and stops after the final one::

    kubeps local --ps 2 --workers 2 --evaluator --restart examples/ctr/train.py -- --checkpoint-dir /tmp/ctr-ckpt
    cat /tmp/ctr-ckpt/eval/metrics.jsonl

TensorBoard (``docs/tensorboard.md``). With ``--logdir`` (default: ``$KUBEPS_LOGDIR``; unset = no event files) the
chief writes the train log-loss, ``global_step/sec`` and ``examples/sec`` to ``LOGDIR/train`` every
``--checkpoint-every`` steps, and the evaluator writes each checkpoint's eval metrics to ``LOGDIR/eval`` at the
checkpoint's step (needs ``pip install 'kubeps[tensorboard]'``)::

    kubeps local --ps 2 --workers 2 --evaluator examples/ctr/train.py -- --checkpoint-dir /tmp/ctr-ckpt \
        --logdir /tmp/ctr-logs
    tensorboard --logdir /tmp/ctr-logs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from kubeps.runtime.ops import kernels
from kubeps.runtime.ops import nn
from kubeps.runtime.checkpoint import Checkpoint, CheckpointManager, StepCounter
from kubeps.runtime.cluster import TFConfigClusterResolver
from kubeps.runtime.variables.context import get_current_worker_index
from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator
from kubeps.runtime.data import Dataset, InputContext
from kubeps.runtime.checkpoint.evaluator import SidecarEvaluator
from kubeps.runtime.ops.optimizers import Adagrad
from kubeps.runtime import DynamicEmbedding
from kubeps.runtime.variables.partitioners import MinSizePartitioner
from kubeps.runtime.server import Server
from kubeps.runtime.coordinator.strategy import ParameterServerStrategy
from kubeps.runtime.coordinator.supervisor import run_coordinator
from kubeps.runtime import TrainMetricsLogger, summary

FIELDS = 6
VALUES_PER_FIELD = 200
DENSE = 4
TEACHER_SEED = 1234


# -- synthetic data with a known best log-loss ------------------------------------------------------------------
def raw_ids(values: np.ndarray) -> np.ndarray:
    """``(field, value)`` pairs as ids from a 2**40 space, as a product's raw feature ids look (sparse, unordered):
    what ``--ids raw40`` feeds a ``DynamicEmbedding`` as they are, with no hashing into a table size."""
    field = np.arange(values.shape[1], dtype=np.uint64)[None, :]
    key = (field << np.uint64(32)) | values.astype(np.uint64)
    mixed = (key * np.uint64(0xD6E8FEB86659FD93)) ^ (key >> np.uint64(7))  # wraps mod 2**64
    return (mixed & np.uint64((1 << 40) - 1)).astype(np.int64)


def feature_ids(values: np.ndarray, args: argparse.Namespace) -> np.ndarray:
    """The model's ids for raw ``(field, value)`` pairs, by ``--ids``: hashed into ``--vocab-size`` rows (``hashed``),
    one row per pair (``exact``: a collision-free fixed table), or raw 40-bit ids for a dynamic table (``raw40``)."""
    if args.ids == "raw40":
        return raw_ids(values)
    if args.ids == "exact":
        return (np.arange(values.shape[1])[None, :] * VALUES_PER_FIELD + values).astype(np.int64)
    return hash_ids(values, args.vocab_size)


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


def training_set(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids [N, FIELDS], dense [N, DENSE], labels [N])``: the finite training set (the same on every worker)."""
    values, dense, _, labels = Teacher().sample(args.train_examples, seed=args.seed)
    return feature_ids(values, args), dense, labels


PARQUET_COLUMNS = {"ids": np.int64, "dense": np.float32, "label": np.float32}


def write_parquet(args: argparse.Namespace, prefix: str, files: int = 4) -> list[str]:
    """The training set as ``files`` Parquet files ``PREFIX/part-K.parquet`` (a folder or an fsspec URL such as
    ``s3://bucket/ctr``), columns ``ids`` (``fixed_size_list<int64>[FIELDS]``), ``dense``, ``label``: what
    ``--data PREFIX/part-*.parquet`` reads back."""
    import fsspec  # noqa: PLC0415 - the Parquet path only
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    ids, dense, labels = training_set(args)
    per = -(-len(labels) // files)
    paths = []
    for f in range(files):
        sl = slice(f * per, min(len(labels), (f + 1) * per))
        table = pa.table({
            "ids": pa.FixedSizeListArray.from_arrays(pa.array(ids[sl].reshape(-1)), FIELDS),
            "dense": pa.FixedSizeListArray.from_arrays(pa.array(dense[sl].reshape(-1)), DENSE),
            "label": labels[sl],
        })
        path = f"{prefix.rstrip('/')}/part-{f}.parquet"
        with fsspec.open(path, "wb", auto_mkdir=True) as out:
            pq.write_table(table, out, row_group_size=16384)
        paths.append(path)
    return paths


def _as_tuple(batch: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return batch["ids"], batch["dense"], batch["label"]


def make_dataset(args: argparse.Namespace, input_context: InputContext) -> Dataset:
    """Runs on each worker: this worker's shard of the training set, shuffled, repeated (several passes) and
    batched. Elements are ``(ids [B, FIELDS], dense [B, DENSE], labels [B])``. With ``--data``, the training set
    is read from those Parquet files (local or on object storage) instead of made in memory."""
    data = getattr(args, "data", None)  # the Keras and JAX examples reuse this with flags of their own
    if data:
        from kubeps.runtime.data import ParquetDataset  # noqa: PLC0415 - needs pyarrow: the --data path only

        source = ParquetDataset(data, columns=PARQUET_COLUMNS)
    else:
        source = Dataset.from_tensor_slices(training_set(args))
    ds = (
        source.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        .shuffle(10_000, seed=args.seed + input_context.input_pipeline_id)
        .repeat()
        .batch(args.batch_size, drop_remainder=True)
    )
    return (ds.map(_as_tuple) if data else ds).prefetch(2)


# -- metrics ----------------------------------------------------------------------------------------------------
def log_loss(labels: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (ties count half), from ranks: ``kubeps.runtime.ops.kernels.auc``."""
    return kernels.auc(labels, scores)


# -- the model --------------------------------------------------------------------------------------------------
class CTRModel:
    """``logit = head(concat(flatten(embedding(ids)), dense))`` from ``kubeps.runtime.ops.nn`` layers.

    Built inside ``strategy.scope()`` its variables live on the parameter servers (the table sharded by the
    scope's partitioner); built outside they are local arrays -- the same code trains in-process or on
    workers. Pickled into a scheduled function, it travels as variable handles.
    """

    def __init__(self, vocab_size: int, embedding_dim: int, hidden: list[int], seed: int = 0, dynamic: bool = False):
        if dynamic:  # rows made on first use, for ids of any size, sharded over the ps by the hash of the id
            table = DynamicEmbedding("embedding", embedding_dim, initializer={"kind": "uniform", "seed": seed})
            self.embedding = nn.DynamicEmbeddingLayer(table, name="embedding")
        else:
            self.embedding = nn.Embedding(vocab_size, embedding_dim, seed=seed, name="embedding")
        self.head = nn.MLP(hidden, 1, activation="relu", input_dim=FIELDS * embedding_dim + DENSE, seed=seed + 1,
                           name="head")
        self.loss = nn.SigmoidCrossEntropy()

    @property
    def table(self):
        """The embedding table (a ``ShardedVariable`` under a partitioner, or a ``DynamicEmbedding``)."""
        return getattr(self.embedding, "table", None) or self.embedding.embeddings

    @property
    def variables(self) -> list:
        """Every weight, by its name (what ``Checkpoint(model=model)`` saves and restores)."""
        return self.embedding.trainable_variables + self.head.trainable_variables

    def forward(self, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
        """The logits ``[B]``; looks up only the rows of ``ids`` (from the parameter servers when remote)."""
        rows = self.embedding.forward(ids)  # [B, FIELDS, DIM]; on a GPU worker (KUBEPS_DEVICE) on the GPU
        (dense,) = kernels.to_device(dense)  # there too, in one transfer (on a CPU worker: as it is)
        x = kernels.array_module(rows).concatenate([rows.reshape(len(ids), -1), dense], axis=1)
        return self.head.forward(x)[:, 0]

    def backward(self, d_logits: np.ndarray) -> None:
        dx = self.head.backward(d_logits[:, None])
        d_rows = dx[:, : -DENSE]  # the dense features need no gradient
        self.embedding.backward(d_rows.reshape(len(d_rows), FIELDS, -1))

    def train_step(self, ids: np.ndarray, dense: np.ndarray, labels: np.ndarray, optimizer: Adagrad) -> float:
        """Forward, loss, backward, and one push of every gradient (the table's row-sparse); the batch's loss."""
        loss = self.loss.forward(self.forward(ids, dense), labels)
        self.backward(self.loss.backward())
        optimizer.apply_gradients(nn.all_grads_and_vars([self.embedding, self.head]))
        return loss

    def predict(self, ids: np.ndarray, dense: np.ndarray, batch_size: int = 8192) -> np.ndarray:
        """Click probabilities, in batches (on the chief: the rows come from the parameter servers)."""
        logits = [self.forward(ids[i: i + batch_size], dense[i: i + batch_size])
                  for i in range(0, len(ids), batch_size)]
        return kernels.sigmoid(np.concatenate(logits))


def build_model(args: argparse.Namespace) -> CTRModel:
    vocab = FIELDS * VALUES_PER_FIELD if args.ids == "exact" else args.vocab_size
    return CTRModel(vocab, args.embedding_dim, args.hidden, seed=args.seed, dynamic=args.ids == "raw40")


def make_optimizer(args: argparse.Namespace) -> Adagrad:
    return Adagrad(learning_rate=args.learning_rate)


def train_steps(model: CTRModel, optimizer: Adagrad, iterator, steps: int) -> float:
    """What the coordinator schedules: ``steps`` training steps on whichever worker runs it; their mean loss."""
    total = 0.0
    for _ in range(steps):
        ids, dense, labels = next(iterator)
        total += model.train_step(ids, dense, labels, optimizer)
    return total / steps


def held_out_set(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(values, dense, teacher p, labels)`` of the held-out examples (the same on the chief and the evaluator)."""
    return Teacher().sample(args.eval_examples, seed=args.seed + 10_000)


def evaluate(model: CTRModel, args: argparse.Namespace, held_out=None) -> dict[str, float]:
    """The model against the two references on held-out examples from the same teacher."""
    values, dense, p_teacher, labels = held_out if held_out is not None else held_out_set(args)
    p_model = model.predict(feature_ids(values, args), dense)
    click_rate = float(labels.mean())
    result = {
        "logloss": log_loss(labels, p_model),
        "auc": auc(labels, p_model),
        "base_logloss": log_loss(labels, np.full_like(labels, click_rate)),
        "teacher_logloss": log_loss(labels, p_teacher),
        "teacher_auc": auc(labels, p_teacher),
        "click_rate": click_rate,
    }
    result["gap_pct"] = 100.0 * (result["logloss"] / result["teacher_logloss"] - 1.0)
    return result


# -- tasks ------------------------------------------------------------------------------------------------------
def log_closure(path: str, event: str, index: int) -> None:
    """``--closure-log``: one line ``S|E execution worker pid time`` when a scheduled execution starts or ends.
    A diagnostic (the chaos tests count re-runs with it); one short append per write, so lines never interleave."""
    with open(path, "a") as f:
        f.write(f"{event} {index} {get_current_worker_index()} {os.getpid()} {time.time():.3f}\n")


def run_chief(args: argparse.Namespace, resolver: TFConfigClusterResolver, build=build_model) -> int:
    num_ps = resolver.cluster_spec().num_tasks("ps")
    partitioner = MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=num_ps)
    strategy = ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = ClusterCoordinator(strategy)
    writer = metrics = None  # TensorBoard: the train scalars, with --logdir
    try:
        with strategy.scope():
            model = build(args)
        table = model.table
        if isinstance(table, DynamicEmbedding):
            shards = list(range(table.num_shards))
            print(f"dynamic embedding table of dim {table.dim} float32 in {table.num_shards} shard(s) (by key hash)")
        else:
            shards = getattr(table, "variables", [table])
            print(f"embedding table {table.shape[0]}x{table.shape[1]} float32 in {len(shards)} shard(s): "
                  + ", ".join(f"{v.name} {v.shape[0]} rows on {v.device}" for v in shards))

        optimizer = make_optimizer(args)
        step = StepCounter()  # training steps done, saved with the variables
        manager = None
        if args.checkpoint_dir:
            # the variables' Adagrad slots and update counts are saved with them (each ps writes its own shards)
            manager = CheckpointManager(Checkpoint(model=model, step=step), args.checkpoint_dir, max_to_keep=3)
            t0 = time.perf_counter()
            start = manager.restore_or_initialize()
            if start:
                print(f"resumed from step {start} ({manager.latest_checkpoint}, restored in "
                      f"{time.perf_counter() - t0:.2f} s)")
            else:
                print(f"no checkpoint in {args.checkpoint_dir}: starting from step 0")
            if start > args.steps or (args.steps - start) % args.steps_per_execution:
                print(f"the checkpoint's step {start} does not fit --steps={args.steps} with "
                      f"--steps-per-execution={args.steps_per_execution}", file=sys.stderr)
                return 2
        start = step.value  # 0 unless restored
        per_worker_dataset = coordinator.create_per_worker_dataset(lambda ctx: make_dataset(args, ctx))
        iterator = iter(per_worker_dataset)
        steps_per_execution, closure_log = args.steps_per_execution, args.closure_log

        def train_fn(it, index):  # pickled with the model's variable handles; runs on a worker
            if closure_log:
                log_closure(closure_log, "S", index)
            loss = train_steps(model, optimizer, it, steps_per_execution)
            if closure_log:
                log_closure(closure_log, "E", index)
            return loss

        # join, report (and checkpoint) every --checkpoint-every steps
        executions = args.steps // steps_per_execution
        chunk = args.checkpoint_every // steps_per_execution
        done = start // steps_per_execution  # executions, numbered from the start of training
        started = time.perf_counter()
        train_logdir = summary.resolve_logdir(args.logdir, "train")
        if train_logdir:  # a resumed run hides the crashed run's events after its checkpoint (purge_step)
            writer = summary.create_file_writer(train_logdir, purge_step=start + 1 if start else None)
        # the train scalars (with a log dir) and the progress metrics (kubeps_train_step, ..._examples_total)
        metrics = TrainMetricsLogger(writer, batch_size=args.batch_size, start_step=start)
        while done < executions:
            n = min(chunk, executions - done)
            losses = [coordinator.schedule(train_fn, args=(iterator, done + i)) for i in range(n)]
            coordinator.join()
            done += n
            step.assign(done * steps_per_execution)
            mean = float(np.mean([rv.fetch() for rv in losses]))
            if metrics:
                metrics.log(step.value, loss=mean)
            saved = ""
            if manager:
                path = manager.save(final=done == executions)
                saved = f"  saved {os.path.basename(path)}" + (" (final)" if done == executions else "")
            print(f"step {step.value:5d}/{args.steps}  train log-loss {mean:.4f}{saved}")
        elapsed = time.perf_counter() - started
        trained = args.steps - start
        passes = trained * args.batch_size / args.train_examples

        result = evaluate(model, args)  # on the chief: rows and weights read from the parameter servers
        result.update(examples_per_s=trained * args.batch_size / elapsed if trained else 0.0,
                      train_seconds=elapsed, passes=passes, embedding_shards=len(shards), resumed_from_step=start)
        if isinstance(table, DynamicEmbedding):
            result.update(table_rows=table.size())  # rows the ps created for the ids training saw
        print(f"trained {trained} steps of {args.batch_size} ({passes:.1f} passes over {args.train_examples} "
              f"examples) in {elapsed:.1f} s: {result['examples_per_s']:.0f} examples/s")
        print(f"eval log-loss {result['logloss']:.4f}  AUC {result['auc']:.4f}")
        print(f"  base rate ({result['click_rate']:.3f})     log-loss {result['base_logloss']:.4f}")
        print(f"  teacher (best achievable) log-loss {result['teacher_logloss']:.4f}  AUC {result['teacher_auc']:.4f}")
        print(f"  gap to the teacher: {result['gap_pct']:.2f}%")
        print("RESULT " + json.dumps(result))
        if not result["logloss"] < result["base_logloss"]:
            print("the model did not beat the base rate", file=sys.stderr)
            return 1
        return 0
    finally:
        if writer:
            writer.close()
        coordinator.shutdown()
        strategy.close()


def run_evaluator(args: argparse.Namespace, build=build_model) -> int:
    """The sidecar evaluator: every checkpoint, restored into a local copy of the model and evaluated on the held-out
    set, gives one JSON line in the metrics file; it stops after the final checkpoint."""
    if not args.checkpoint_dir:
        print("this example evaluates on the chief at the end of training; without --checkpoint-dir the evaluator "
              "has nothing to do")
        return 0
    model = build(args)  # outside a strategy scope: local variables
    restore = Checkpoint(model=model)

    def eval_fn(values, batches):
        restore.restore(values.path)  # reads the files directly, whatever the shards they were saved from
        result = evaluate(model, args, held_out=next(iter(batches)))
        print(f"{os.path.basename(values.path)} (step {values.step}): eval log-loss {result['logloss']:.4f}  "
              f"AUC {result['auc']:.4f}  gap to the teacher {result['gap_pct']:.2f}%")
        return {"logloss": result["logloss"], "auc": result["auc"], "gap_pct": result["gap_pct"]}

    evaluator = SidecarEvaluator(eval_fn, [held_out_set(args)], args.checkpoint_dir, metrics_path=args.metrics,
                                 poll_interval=0.5, timeout=args.evaluator_timeout, logdir=args.logdir)
    records = evaluator.start()
    print(f"evaluated {len(records)} checkpoint(s); metrics in {evaluator.metrics_path}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="kubeps CTR example: asynchronous PS training on synthetic clicks")
    p.add_argument("--steps", type=int, default=2400, help="training steps in total, over all workers")
    p.add_argument("--steps-per-execution", type=int, default=20, help="steps per scheduled function")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=1 << 16, help="rows of the hashed embedding table")
    p.add_argument("--embedding-dim", type=int, default=8)
    p.add_argument("--hidden", type=int, nargs="+", default=[16], help="hidden units of the MLP head")
    p.add_argument("--learning-rate", type=float, default=0.1, help="Adagrad learning rate")
    p.add_argument("--train-examples", type=int, default=300_000)
    p.add_argument("--eval-examples", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, metavar="PATTERN",
                   help="train from these Parquet files (a glob, local or an fsspec URL: s3://bucket/ctr/*.parquet) "
                        "instead of the in-memory arrays; --write-data makes them")
    p.add_argument("--write-data", default=None, metavar="PREFIX",
                   help="write the training set as Parquet files PREFIX/part-K.parquet (local or s3://...) and exit")
    p.add_argument("--checkpoint-dir", default=os.environ.get("KUBEPS_CHECKPOINT_DIR") or None,
                   help="where the chief saves checkpoints and restores the latest one from; a path every task "
                        "sees or an fsspec URL (default: $KUBEPS_CHECKPOINT_DIR; unset: no checkpoints)")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="steps between checkpoints (and progress reports), a multiple of --steps-per-execution; "
                        "the last checkpoint is final (default: a fifth of --steps, 480)")
    p.add_argument("--metrics", default=None,
                   help="the evaluator's JSON-lines output (default: CHECKPOINT_DIR/eval/metrics.jsonl)")
    p.add_argument("--logdir", default=os.environ.get("KUBEPS_LOGDIR") or None,
                   help="TensorBoard log dir: the chief writes LOGDIR/train, the evaluator LOGDIR/eval; a path or an "
                        "s3:// or gs:// URL (default: $KUBEPS_LOGDIR; unset: no event files)")
    p.add_argument("--evaluator-timeout", type=float, default=600.0,
                   help="the evaluator stops after this many seconds without a new checkpoint")
    p.add_argument("--closure-log", default=None, metavar="PATH",
                   help="diagnostic: append a line to PATH when a scheduled execution starts (S) and ends (E), "
                        "with its index, worker and pid (re-runs after worker failures show up twice)")
    p.add_argument("--ids", choices=["hashed", "exact", "raw40"], default="hashed",
                   help="hashed: ids hashed into --vocab-size rows; exact: one row per (field, value), a collision-"
                        "free fixed table; raw40: raw ids from a 2**40 space into a DynamicEmbedding")
    args = p.parse_args(argv)
    for name in ("steps", "steps_per_execution", "batch_size", "vocab_size", "embedding_dim", "train_examples",
                 "eval_examples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(h < 1 for h in args.hidden):
        p.error(f"--hidden units must be >= 1, got {args.hidden}")
    if args.steps % args.steps_per_execution:
        p.error(f"--steps={args.steps} must be a multiple of --steps-per-execution={args.steps_per_execution}")
    if args.checkpoint_every is None:
        args.checkpoint_every = max(1, args.steps // args.steps_per_execution // 5) * args.steps_per_execution
    if args.checkpoint_every < 1 or args.checkpoint_every % args.steps_per_execution:
        p.error(f"--checkpoint-every={args.checkpoint_every} must be a positive multiple of "
                f"--steps-per-execution={args.steps_per_execution}")
    if not args.evaluator_timeout > 0:
        p.error(f"--evaluator-timeout must be > 0, got {args.evaluator_timeout}")
    if not args.learning_rate > 0:
        p.error(f"--learning-rate must be > 0, got {args.learning_rate}")
    return args


def main(argv: list[str] | None = None, build=build_model) -> int:
    """Every task's entry point; ``build(args)`` makes the model (``examples/ctr/train_jax.py`` passes its own)."""
    args = parse_args(argv)
    if args.write_data:
        for path in write_parquet(args, args.write_data):
            print(f"wrote {path}")
        return 0
    resolver = TFConfigClusterResolver()
    task_type = resolver.task_type
    if task_type in ("ps", "worker"):
        server = Server(resolver.cluster_spec(), job_name=task_type, task_index=resolver.task_id)
        server.join()  # serves until the launcher (or Kubernetes) stops this task
        return 0
    if task_type == "evaluator":
        return run_evaluator(args, build)
    if task_type not in (None, "chief"):
        print(f"unknown task type {task_type!r}", file=sys.stderr)
        return 2
    if task_type is None:
        print("TF_CONFIG is not set: run this with  kubeps local --ps 2 --workers 2 examples/ctr/train.py",
              file=sys.stderr)
        return 2
    # a lost parameter server ends the chief with status 133 (retryable): restarted, it resumes from a checkpoint
    return run_coordinator(lambda: run_chief(args, resolver, build))


if __name__ == "__main__":
    sys.exit(main())
