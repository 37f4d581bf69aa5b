"""The CTR model of ``examples/ctr/train.py`` written as a Keras 3 model and trained with kubeps's ``fit``.

    kubeps local --ps 2 --workers 2 examples/keras/train.py

The same program runs as every task (as the numpy example): ps and worker tasks serve; the chief builds the Keras
model inside ``strategy.scope()`` -- its ``KubepsEmbedding`` table is created on the parameter servers, sharded by
``MinSizePartitioner``; the dense weights are copied there by ``fit`` -- and calls
``kubeps.runtime.models.keras_fit.fit`` with a dataset function, ``epochs``/``steps_per_epoch`` and
``steps_per_execution``, as ``model.fit`` with TensorFlow's ``ParameterServerStrategy``. The workers compute each
step's gradients with Keras's own ``stateless_call`` under ``jax.value_and_grad``; Adagrad runs on the parameter
servers. Data, metrics and the evaluation are the numpy example's (imported from it), so the two print comparable
log-losses.

With ``--checkpoint-dir`` a ``BackupAndRestore`` callback saves a kubeps checkpoint every ``--checkpoint-every``
steps (default: every epoch) and, on start, restores the latest one and continues from its step; the chief runs
under ``run_coordinator``, so a lost ps ends it with status 133 and ``kubeps local --restart`` restarts it. The
``evaluator`` task rebuilds the Keras model, loads every checkpoint with ``restore_weights`` and evaluates it::

    kubeps local --ps 2 --workers 2 --evaluator --restart examples/keras/train.py -- --checkpoint-dir /tmp/keras-ckpt
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
# XLA's CPU thread pool: single-threaded Eigen per task, so five tasks on a small machine do not oversubscribe it
# (until kubeps.runtime.util.threads sizes XLA's pools per task as it does the BLAS pools)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import argparse  # noqa: E402 - the environment above must be set before keras or jax are imported
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kubeps.runtime as kp  # noqa: E402
from kubeps.runtime.models.keras_callbacks import BackupAndRestore, TensorBoard  # noqa: E402
from kubeps.runtime.models.keras_fit import fit, restore_weights  # noqa: E402
from kubeps.runtime.models.keras_layers import KubepsEmbedding  # noqa: E402


def _load_numpy_example():
    """The numpy CTR example as a module: its data (``Teacher``, ``make_dataset``) and metrics (``evaluate``)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "ctr", "train.py")
    spec = importlib.util.spec_from_file_location("kubeps_example_ctr", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # every task runs this file, so a worker unpickles references to it
    spec.loader.exec_module(module)
    return module


ctr = _load_numpy_example()


def build_model(args: argparse.Namespace) -> keras.Model:
    """``logit = MLP(concat(flatten(embedding(ids)), dense))``: the numpy example's model as a functional Keras
    model (built: its weights exist); inside ``strategy.scope()`` the table is on the parameter servers. Functional,
    so ``kubeps export`` can save it as a ``.keras`` file with a plain ``Embedding`` in place of the
    ``KubepsEmbedding`` (a subclassed model is its Python class, which a ``.keras`` file cannot carry)."""
    ids = keras.Input((ctr.FIELDS,), dtype="int32", name="ids")
    dense = keras.Input((ctr.DENSE,), dtype="float32", name="dense")
    rows = KubepsEmbedding(args.vocab_size, args.embedding_dim, name="embedding",
                           embeddings_initializer=keras.initializers.RandomUniform(-0.05, 0.05, args.seed))(ids)
    x = keras.layers.Concatenate(name="concat")([keras.layers.Flatten(name="flatten")(rows), dense])
    for i, units in enumerate(args.hidden):
        x = keras.layers.Dense(units, activation="relu", name=f"dense_{i}",
                               kernel_initializer=keras.initializers.GlorotUniform(args.seed + 1 + i))(x)
    logit = keras.layers.Dense(1, name="logit", kernel_initializer=keras.initializers.GlorotUniform(args.seed + 100))(x)
    return keras.Model([ids, dense], logit, name="ctr")


def serving_model(argv: list[str] | None = None) -> keras.Model:
    """For ``kubeps export``: the model built with the training flags ``argv`` (outside any scope)."""
    return build_model(parse_args(argv))


class Predictor:
    """What the numpy example's ``evaluate`` needs: click probabilities in batches (eager Keras calls; the
    table's rows are looked up from the parameter servers on the chief, from the local table on the evaluator)."""

    def __init__(self, model: keras.Model):
        self.model = model

    def predict(self, ids: np.ndarray, dense: np.ndarray, batch_size: int = 8192) -> np.ndarray:
        logits = [np.asarray(self.model([ids[i: i + batch_size], dense[i: i + batch_size]], training=False))[:, 0]
                  for i in range(0, len(ids), batch_size)]
        return 1.0 / (1.0 + np.exp(-np.concatenate(logits).astype(np.float64)))


def make_dataset(args: argparse.Namespace, input_context: kp.InputContext) -> kp.Dataset:
    """The numpy example's dataset, with Keras's ``(x, y)`` elements. Resumed from a checkpoint at step S
    (``input_context.initial_step``), each worker skips its share of the S batches the lost run consumed, so the
    resumed run does not train on the same examples again."""
    consumed = input_context.initial_step // input_context.num_input_pipelines
    return (ctr.make_dataset(args, input_context).skip(consumed)
            .map(lambda ids, dense, labels: ((ids, dense), labels[:, None])))


def run_chief(args: argparse.Namespace, resolver: kp.TFConfigClusterResolver) -> int:
    num_ps = resolver.cluster_spec().num_tasks("ps")
    partitioner = kp.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=num_ps)
    strategy = kp.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = kp.ClusterCoordinator(strategy)
    try:
        with strategy.scope():
            model = build_model(args)
        table = model.get_layer("embedding").table
        shards = getattr(table, "variables", [table])  # on the parameter servers
        print(f"KubepsEmbedding table in {len(shards)} shard(s) on " + ", ".join(v.device for v in shards))
        callbacks = []
        if args.checkpoint_dir:
            callbacks.append(BackupAndRestore(args.checkpoint_dir, save_freq=args.checkpoint_every or "epoch",
                                              max_to_keep=3))
        if args.logdir:
            callbacks.append(TensorBoard(args.logdir, update_freq=args.steps_per_execution * 4))
        started = time.perf_counter()
        history = fit(model, coordinator, lambda ctx: make_dataset(args, ctx),
                      optimizer=keras.optimizers.Adagrad(learning_rate=args.learning_rate),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
                      steps_per_execution=args.steps_per_execution, callbacks=callbacks)
        elapsed = time.perf_counter() - started
        trained = sum(history.history.get("examples", []))
        result = ctr.evaluate(Predictor(model), args)  # the numpy example's metrics, computed the same way
        result.update(examples_per_s=trained / elapsed if trained else 0.0, train_seconds=elapsed,
                      embedding_shards=len(shards), epochs_run=len(history.epoch),
                      train_loss=history.history.get("loss", []),
                      epoch_examples_per_s=history.history.get("examples_per_s", []))
        print(f"trained {trained} examples in {elapsed:.1f} s: {result['examples_per_s']:.0f} examples/s")
        print(f"eval log-loss {result['logloss']:.4f}  AUC {result['auc']:.4f}")
        print(f"  teacher (best achievable) log-loss {result['teacher_logloss']:.4f}  gap {result['gap_pct']:.2f}%")
        print("RESULT " + json.dumps(result))
        return 0 if result["logloss"] < result["base_logloss"] else 1
    finally:
        coordinator.shutdown()
        strategy.close()


def run_evaluator(args: argparse.Namespace, resolver: kp.TFConfigClusterResolver) -> int:
    """The sidecar evaluator: the Keras model rebuilt here (its table local), each checkpoint's weights loaded
    into it with ``restore_weights`` and evaluated; one JSON line per checkpoint; stops after the final one."""
    if not args.checkpoint_dir:
        print("without --checkpoint-dir the evaluator has nothing to do")
        return 0
    model = build_model(args)  # outside a strategy scope: a local table
    predictor = Predictor(model)

    def eval_fn(values, batches):
        restore_weights(model, values)
        result = ctr.evaluate(predictor, args, held_out=next(iter(batches)))
        print(f"{os.path.basename(values.path)} (step {values.step}): eval log-loss {result['logloss']:.4f}  "
              f"AUC {result['auc']:.4f}", flush=True)
        return {"logloss": result["logloss"], "auc": result["auc"]}

    evaluator = kp.SidecarEvaluator(eval_fn, [ctr.held_out_set(args)], args.checkpoint_dir, poll_interval=0.5,
                                    timeout=args.evaluator_timeout, settings=resolver.settings)  # $KUBEPS_LOGDIR
    records = evaluator.start()
    print(f"evaluated {len(records)} checkpoint(s); metrics in {evaluator.metrics_path}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="kubeps Keras example: the CTR model trained with fit")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--logdir", default=os.environ.get("KUBEPS_LOGDIR") or None,
                   help="TensorBoard log dir: train scalars go to <logdir>/train (default: $KUBEPS_LOGDIR)")
    p.add_argument("--steps-per-epoch", type=int, default=480, help="steps per epoch, over all workers")
    p.add_argument("--steps-per-execution", type=int, default=20, help="steps per scheduled function")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=1 << 16)
    p.add_argument("--embedding-dim", type=int, default=8)
    p.add_argument("--hidden", type=int, nargs="+", default=[16])
    p.add_argument("--learning-rate", type=float, default=0.1, help="Adagrad learning rate")
    p.add_argument("--train-examples", type=int, default=300_000)
    p.add_argument("--eval-examples", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=os.environ.get("KUBEPS_CHECKPOINT_DIR") or None,
                   help="BackupAndRestore's directory (default: $KUBEPS_CHECKPOINT_DIR; unset: no checkpoints)")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="steps between checkpoints, a multiple of --steps-per-execution (default: every epoch)")
    p.add_argument("--evaluator-timeout", type=float, default=600.0)
    # the numpy example's data functions read these of its flags: hashed ids, made in memory
    p.set_defaults(ids="hashed", data=None)
    args = p.parse_args(argv)
    for name in ("epochs", "steps_per_epoch", "steps_per_execution", "batch_size", "vocab_size", "embedding_dim",
                 "train_examples", "eval_examples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    resolver = kp.TFConfigClusterResolver()
    task_type = resolver.task_type
    if task_type in ("ps", "worker"):
        kp.Server(resolver.cluster_spec(), job_name=task_type, task_index=resolver.task_id).join()
        return 0
    if task_type == "evaluator":
        return run_evaluator(args, resolver)
    if task_type != "chief":
        print("TF_CONFIG is not set: run this with  kubeps local --ps 2 --workers 2 examples/keras/train.py",
              file=sys.stderr)
        return 2
    return kp.run_coordinator(lambda: run_chief(args, resolver))


if __name__ == "__main__":
    sys.exit(main())
