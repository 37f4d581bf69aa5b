"""The standard click-through models on Criteo files: Wide & Deep, DLRM and DeepFM in Keras 3, trained with kubeps.

    kubeps local --ps 2 --workers 2 examples/criteo/train.py -- --model wdl      # or dlrm, deepfm

Every task runs this file. The data are Criteo-format files written by ``examples/criteo/generate.py`` (labels from
a known logistic teacher): ``--data DIR`` holds the training lines (``--lines``, data seed 0) and ``DIR/eval`` the
held-out lines (``--eval-lines``, data seed 1, the same teacher). A task that needs them and finds them missing
writes them itself, the same bytes in every task (so pods without a shared volume each make their own copy).

The workers read the files with ``Dataset.from_files(paths, reader="criteo")``, each its share of the lines, and
prepare each batch in the input pipeline (:func:`features`): the 26 categorical ids are hashed with
``kp.hash_bucket`` into ONE shared table of ``--buckets`` rows (the field is part of the key, so equal hex values of
two fields are two ids, and each field's "empty" is an id of its own), and the 13 integer features become
``log1p(max(x, 0))``. Ids seen fewer than ``--min-count`` (50) times in the training lines share their field's
"rare" id, as the usual Criteo preprocessing does (DLRM's and DeepCTR's scripts): the chief counts them in one pass
before training and ships the kept ids to the workers with the dataset function. The models (:func:`build_model`),
on ``E = 26`` embeddings of ``--embedding-dim`` (16) and the 13 dense features ``d``:

- ``wdl``   Wide & Deep: ``MLP(concat(flatten(E), d)) + sum_f w[id_f] + d . v`` (a 1-wide table for the wide part);
- ``dlrm``  DLRM: ``z = bottom-MLP(d)`` (to the embedding width), the 351 dot products of the 27 vectors
  ``[z, E_1..E_26]`` pairwise, then ``top-MLP(concat(z, dots))``;
- ``deepfm`` DeepFM: ``sum_f w[id_f] + d . v`` (first order) + ``1/2 sum_k ((sum_f E_fk)^2 - sum_f E_fk^2)`` (the FM
  second-order term) + ``MLP(concat(flatten(E), d))`` (deep part, on the same embeddings).

Adagrad (``--learning-rate``, by model: :data:`LEARNING_RATES`) on the parameter servers, batch 512, one epoch
of ``--lines`` (1M). Defaults are sized for a 2-core machine (``--hidden 64 32``, ``--bottom 32``, ``--buckets
2**18``); the published sizes are flags: ``--hidden 1024 512 256 --buckets 4194304`` (and for DLRM ``--bottom 512
256``). The chief prints the eval log-loss, AUC, examples/s and the gap to the teacher's log-loss on the eval lines
(``teacher.json``), and exits 1 when the model does not beat the base rate.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
# XLA's CPU thread pool: single-threaded Eigen per task, so five tasks on a small machine do not oversubscribe it
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import argparse  # noqa: E402 - the environment above must be set before keras or jax are imported
import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Iterable  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kubeps.runtime as kp  # noqa: E402
from kubeps.runtime.models.keras_fit import fit  # noqa: E402
from kubeps.runtime.models.keras_layers import KubepsEmbedding  # noqa: E402
from kubeps.runtime.ops import kernels  # noqa: E402


def _load_generator():
    """``examples/criteo/generate.py`` as a module (its ``generate`` and ``log_loss``)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate.py")
    spec = importlib.util.spec_from_file_location("kubeps_example_criteo_generate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # every task runs this file, so a worker unpickles references to it
    spec.loader.exec_module(module)
    return module


generator = _load_generator()
NUM_DENSE, NUM_CATEGORICAL = generator.NUM_DENSE, generator.NUM_CATEGORICAL
#: each model's default Adagrad learning rate (found on the generated files, 1M lines: docs/features.md)
LEARNING_RATES = {"wdl": 1.0, "dlrm": 0.3, "deepfm": 0.3}


# -- data -------------------------------------------------------------------------------------------------------
def ensure_data(folder: str, lines: int, files: int, seed: int) -> tuple[list[str], dict]:
    """The files and ``teacher.json`` record of ``folder``, written first when missing or made with other
    settings; written into a temporary folder and renamed, so tasks racing to make them see whole files."""
    record_path = os.path.join(folder, "teacher.json")
    if os.path.exists(record_path):
        with open(record_path) as f:
            record = json.load(f)
        if (record["lines"], len(record["files"]), record["seed"]) == (lines, files, seed):
            return [os.path.join(folder, name) for name in record["files"]], record
        shutil.rmtree(folder, ignore_errors=True)  # other settings: made again
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".criteo-", dir=parent)
    generator.generate(scratch, lines, files, seed=seed)
    try:
        os.rename(scratch, folder)
    except OSError:  # another task renamed its copy first: the same bytes
        shutil.rmtree(scratch, ignore_errors=True)
    return ensure_data(folder, lines, files, seed)


def train_files(args: argparse.Namespace) -> tuple[list[str], dict]:
    return ensure_data(os.path.join(args.data, "train"), args.lines, args.files, seed=0)


def eval_files(args: argparse.Namespace) -> tuple[list[str], dict]:
    return ensure_data(os.path.join(args.data, "eval"), args.eval_lines, 1, seed=1)


EMPTY, RARE = 1 << 32, (1 << 32) + 1  # the ids of "empty" and of "too rare to learn", next to the 32-bit ids


def field_keys(categorical: np.ndarray) -> np.ndarray:
    """``[N, 26]`` categoricals (-1: empty) as int64 keys unique across fields: ``field << 33 | id``."""
    fields = np.arange(NUM_CATEGORICAL, dtype=np.int64) << 33
    return fields + np.where(categorical < 0, EMPTY, categorical)


def vocabulary(categoricals: Iterable[np.ndarray], min_count: int) -> np.ndarray:
    """The sorted keys (:func:`field_keys`) seen at least ``min_count`` times in the ``[N, 26]`` blocks."""
    uniques, counts = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for categorical in categoricals:
        u, c = np.unique(field_keys(categorical), return_counts=True)
        uniques.append(u)
        counts.append(c)
    keys, where = np.unique(np.concatenate(uniques), return_inverse=True)
    return keys[np.bincount(where, weights=np.concatenate(counts), minlength=len(keys)) >= min_count]


def features(block: dict, buckets: int, known: np.ndarray) -> dict:
    """A batch as the models take it: each categorical id of the vocabulary ``known`` (empty included) hashed with
    its field into ``buckets`` rows of one shared table, every other id as its field's "rare" id; the 13 counts as
    ``log1p(max(x, 0))``."""
    keys = field_keys(block["categorical"])
    at = np.minimum(np.searchsorted(known, keys), len(known) - 1)
    rare = (np.arange(NUM_CATEGORICAL, dtype=np.int64) << 33) + RARE
    keys = np.where(known[at] == keys, keys, rare) if len(known) else np.broadcast_to(rare, keys.shape)
    return {"categorical": kp.hash_bucket(keys, buckets).astype(np.int32),
            "dense": np.log1p(np.maximum(block["dense"], 0.0)).astype(np.float32)}


def make_dataset(args: argparse.Namespace, known: np.ndarray, input_context: kp.InputContext) -> kp.Dataset:
    """Runs on each worker: its share of the training lines (every ``num_input_pipelines``-th), shuffled,
    repeated, batched, then hashed a batch at a time; elements ``(x, y)`` as Keras takes them."""
    paths, _ = train_files(args)
    buckets = args.buckets
    return (kp.Dataset.from_files(paths, reader="criteo")
            .shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
            .shuffle(args.shuffle_buffer, seed=args.seed + input_context.input_pipeline_id)
            .repeat()
            .batch(args.batch_size, drop_remainder=True)
            .map(lambda b: (features(b, buckets, known), b["label"].astype(np.float32)[:, None]))
            .prefetch(2))


# -- the models -------------------------------------------------------------------------------------------------
class FieldSum(keras.layers.Layer):
    """``[B, F, K] -> [B, K]``: the sum over the fields (the wide part's weights, the first-order term)."""

    def call(self, x):
        return keras.ops.sum(x, axis=1)


class FMInteraction(keras.layers.Layer):
    """DeepFM's second-order term, ``[B, F, K] -> [B, 1]``: ``1/2 sum_k ((sum_f e_fk)^2 - sum_f e_fk^2)``, the sum of
    the dot products of every pair of fields' embeddings."""

    def call(self, e):
        square_of_sum = keras.ops.square(keras.ops.sum(e, axis=1))
        sum_of_squares = keras.ops.sum(keras.ops.square(e), axis=1)
        return 0.5 * keras.ops.sum(square_of_sum - sum_of_squares, axis=1, keepdims=True)


class DotInteraction(keras.layers.Layer):
    """DLRM's interaction, ``[B, F, K] -> [B, F (F - 1) / 2]``: the dot products of every pair of the F vectors."""

    def call(self, e):
        gram = keras.ops.matmul(e, keras.ops.transpose(e, (0, 2, 1)))
        rows, cols = np.triu_indices(e.shape[1], k=1)
        return keras.ops.reshape(gram, (-1, e.shape[1] ** 2))[:, rows * e.shape[1] + cols]


def _mlp(x, units: list[int], name: str, seed: int):
    for i, n in enumerate(units):
        x = keras.layers.Dense(n, activation="relu", name=f"{name}_{i}",
                               kernel_initializer=keras.initializers.GlorotUniform(seed + i))(x)
    return x


def _logit(x, name: str, seed: int):
    return keras.layers.Dense(1, name=name, kernel_initializer=keras.initializers.GlorotUniform(seed))(x)


def build_model(args: argparse.Namespace) -> keras.Model:
    """``args.model`` as a functional Keras model on ``{"categorical": int32[B, 26], "dense": float32[B, 13]}``,
    returning the click logit ``[B, 1]``; inside ``strategy.scope()`` its tables are on the parameter servers."""
    ids = keras.Input((NUM_CATEGORICAL,), dtype="int32", name="categorical")
    dense = keras.Input((NUM_DENSE,), dtype="float32", name="dense")
    uniform = keras.initializers.RandomUniform(-0.05, 0.05, args.seed)
    e = KubepsEmbedding(args.buckets, args.embedding_dim, name="embedding", embeddings_initializer=uniform)(ids)
    deep_in = keras.layers.Concatenate(name="deep_in")([keras.layers.Flatten(name="flatten")(e), dense])
    if args.model == "dlrm":
        z = _mlp(dense, [*args.bottom, args.embedding_dim], "bottom", args.seed + 10)
        vectors = keras.layers.Concatenate(axis=1, name="vectors")(
            [keras.layers.Reshape((1, args.embedding_dim), name="z")(z), e])
        top_in = keras.layers.Concatenate(name="top_in")([z, DotInteraction(name="dot")(vectors)])
        logit = _logit(_mlp(top_in, args.hidden, "top", args.seed + 20), "logit", args.seed + 100)
        return keras.Model([ids, dense], logit, name="dlrm")
    # the linear part of Wide & Deep and DeepFM's first-order term: a weight per id and per dense feature
    w = KubepsEmbedding(args.buckets, 1, name="linear", embeddings_initializer="zeros")(ids)
    linear = keras.layers.Add(name="linear_sum")([FieldSum(name="field_sum")(w),
                                                  _logit(dense, "dense_linear", args.seed + 30)])
    deep = _logit(_mlp(deep_in, args.hidden, "deep", args.seed + 20), "deep_logit", args.seed + 100)
    parts = [linear, deep] + ([FMInteraction(name="fm")(e)] if args.model == "deepfm" else [])
    return keras.Model([ids, dense], keras.layers.Add(name="logit")(parts), name=args.model)


# -- evaluation -------------------------------------------------------------------------------------------------
def evaluate(model: keras.Model, args: argparse.Namespace, known: np.ndarray) -> dict:
    """Eval log-loss and AUC of ``model`` on the held-out lines, next to the teacher's log-loss on them (the best
    a model can do) and the base rate's (always predicting the click rate)."""
    paths, record = eval_files(args)
    logits, labels = [], []
    for block in kp.Dataset.from_files(paths, reader="criteo").batch(8192):
        x = features(block, args.buckets, known)
        logits.append(np.asarray(model([x["categorical"], x["dense"]], training=False))[:, 0])
        labels.append(block["label"])
    y = np.concatenate(labels).astype(np.float64)
    p = 1.0 / (1.0 + np.exp(-np.concatenate(logits).astype(np.float64)))
    logloss, teacher = generator.log_loss(y, p), record["teacher_logloss"]
    rate = float(y.mean())
    return {"model": args.model, "logloss": logloss, "auc": kernels.auc(y, p), "teacher_logloss": teacher,
            "base_logloss": generator.log_loss(y, np.full_like(y, rate)), "click_rate": rate,
            "gap_pct": 100.0 * (logloss / teacher - 1.0), "eval_lines": len(y)}


def run_chief(args: argparse.Namespace, resolver: kp.TFConfigClusterResolver) -> int:
    num_ps = resolver.cluster_spec().num_tasks("ps")
    partitioner = kp.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=num_ps)
    strategy = kp.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = kp.ClusterCoordinator(strategy)
    try:
        eval_files(args)  # made before training (when missing), so the timed part is training only
        blocks = kp.Dataset.from_files(train_files(args)[0], reader="criteo").batch(1 << 16)
        known = vocabulary((block["categorical"] for block in blocks), args.min_count)  # one counting pass
        print(f"{len(known)} categorical ids seen at least {args.min_count} times in the training lines")
        with strategy.scope():
            model = build_model(args)
        print(f"{args.model}: a {args.buckets}x{args.embedding_dim} table on the parameter servers")
        steps_per_epoch = args.lines // args.batch_size // args.steps_per_execution * args.steps_per_execution
        started = time.perf_counter()
        history = fit(model, coordinator, lambda ctx: make_dataset(args, known, ctx),
                      optimizer=keras.optimizers.Adagrad(learning_rate=args.learning_rate),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      epochs=args.epochs, steps_per_epoch=steps_per_epoch,
                      steps_per_execution=args.steps_per_execution)
        elapsed = time.perf_counter() - started
        trained = sum(history.history.get("examples", []))
        result = evaluate(model, args, known)
        result.update(examples_per_s=trained / elapsed if trained else 0.0, train_seconds=elapsed,
                      train_examples=trained, train_loss=history.history.get("loss", []))
        print(f"trained {trained} examples in {elapsed:.1f} s: {result['examples_per_s']:.0f} examples/s")
        print(f"eval log-loss {result['logloss']:.4f}  AUC {result['auc']:.4f}  "
              f"(base rate {result['base_logloss']:.4f})")
        print(f"  teacher (best achievable) log-loss {result['teacher_logloss']:.4f}  gap {result['gap_pct']:.2f}%")
        print("RESULT " + json.dumps(result))
        return 0 if result["logloss"] < result["base_logloss"] else 1
    finally:
        coordinator.shutdown()
        strategy.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="kubeps Criteo example: Wide & Deep, DLRM or DeepFM trained with fit")
    p.add_argument("--model", choices=sorted(LEARNING_RATES), default="wdl")
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "kubeps-criteo"),
                   help="folder of the generated files (DATA/train, DATA/eval); made when missing")
    p.add_argument("--lines", type=int, default=1_000_000, help="training lines (one epoch)")
    p.add_argument("--files", type=int, default=4, help="training files")
    p.add_argument("--eval-lines", type=int, default=100_000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps-per-execution", type=int, default=20, help="steps per scheduled function")
    p.add_argument("--buckets", type=int, default=1 << 18, help="rows of the shared hashed table")
    p.add_argument("--min-count", type=int, default=50,
                   help="ids seen fewer times in the training lines share their field's 'rare' id (1: none do)")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 32],
                   help="the deep MLP (DLRM: the top MLP); published size: 1024 512 256")
    p.add_argument("--bottom", type=int, nargs="+", default=[32], help="DLRM's bottom MLP; published: 512 256")
    p.add_argument("--learning-rate", type=float, default=None,
                   help=f"Adagrad learning rate (default: by model, {LEARNING_RATES})")
    p.add_argument("--shuffle-buffer", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("lines", "files", "eval_lines", "epochs", "batch_size", "steps_per_execution", "buckets",
                 "embedding_dim", "shuffle_buffer", "min_count"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.hidden + args.bottom):
        p.error(f"--hidden and --bottom units must be >= 1, got {args.hidden} and {args.bottom}")
    if args.files > args.lines or args.lines < args.batch_size * args.steps_per_execution:
        p.error(f"--lines={args.lines} must be at least --files={args.files} and --batch-size x "
                f"--steps-per-execution={args.batch_size * args.steps_per_execution}")
    if args.learning_rate is None:
        args.learning_rate = LEARNING_RATES[args.model]
    if not args.learning_rate > 0:
        p.error(f"--learning-rate must be > 0, got {args.learning_rate}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    resolver = kp.TFConfigClusterResolver()
    task_type = resolver.task_type
    if task_type in ("ps", "worker"):
        kp.Server(resolver.cluster_spec(), job_name=task_type, task_index=resolver.task_id).join()
        return 0
    if task_type != "chief":
        print("TF_CONFIG is not set: run this with  kubeps local --ps 2 --workers 2 examples/criteo/train.py",
              file=sys.stderr)
        return 2
    return kp.run_coordinator(lambda: run_chief(args, resolver))


if __name__ == "__main__":
    sys.exit(main())
