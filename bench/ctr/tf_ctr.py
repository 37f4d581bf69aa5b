"""The TensorFlow side of ``bench/ctr_vs_tf.py``: the workload of ``workload.py`` on TensorFlow's own
``ParameterServerStrategy`` + ``ClusterCoordinator``, written as a TensorFlow user would (a custom training loop).

    kubeps local --ps 2 --workers 2 --python /path/tfenv/bin/python bench/ctr/tf_ctr.py -- --data DIR --steps 3000

Runs under TensorFlow 2.21 (``pip install tensorflow-cpu==2.21.0`` in a separate environment; TensorFlow is not a
dependency of kubeps). Every task runs this file with its ``TF_CONFIG``: the ps and workers start a
``tf.distribute.Server`` and join it; the chief (the coordinator) builds the model in ``strategy.scope()`` from the
initial weights in ``DIR`` with ``FixedShardsPartitioner(num_ps)`` (the 2^20 x 16 table is split over the ps and
looked up with ``tf.nn.embedding_lookup`` on the ``ShardedVariable``), creates the per-worker ``tf.data`` pipeline,
and schedules a ``tf.function`` running ``--steps-per-execution`` steps per call.

Keras 3 (what ``tf.keras`` is in 2.21) does not support parameter-server training (keras-team/keras#18624), so the
model is raw ``tf.Variable``s and the optimizer is TensorFlow's own Adagrad kernels, applied as TF2's Keras Adagrad
applied them: ``ResourceApplyAdagradV2`` for dense weights, and for the table ``ResourceSparseApplyAdagradV2`` on each
shard with the gradient's duplicate rows summed first, the accumulator created next to its shard
(``colocate_vars_with``) and the update placed on that shard's ps. Same formula as the kubeps side:
``accum += g*g; var -= lr * g / (sqrt(accum) + eps)``, ``accum`` starting at 0.1.

Input: under ``ParameterServerStrategy`` the ``InputContext`` that ``distribute_datasets_from_function`` hands the
dataset function says one input pipeline (``num_input_pipelines == 1``): the same dataset function runs on every
worker and TF has no per-worker sharding, so each worker reads the whole training set and, as TF's documentation
recommends, shuffles it with its own (unset) seed. TensorFlow's default threading is kept.

The chief schedules ``--warmup-executions`` executions (untimed, counted in ``--steps``), joins, times the rest up to
the last ``join()``, reads the final weights back as numpy (the table's shards concatenated in order), scores them with
``workload.evaluate`` and prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as wl  # noqa: E402 - next to this file, only numpy

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")  # as TF's parameter server guide sets it

import tensorflow as tf  # noqa: E402


def components(var) -> list:
    """The variables that hold ``var``: its shards if the partitioner split it, else itself."""
    return [var] if isinstance(var, tf.Variable) else list(var.variables)


def to_numpy(var) -> np.ndarray:
    return np.concatenate([v.numpy() for v in components(var)], axis=0)


class Model(tf.Module):
    def __init__(self, init: dict[str, np.ndarray]):
        super().__init__(name="ctr")
        self.embedding = tf.Variable(np.asarray(init["embedding"]), name="embedding")
        self.dense = [tf.Variable(np.asarray(init[n]), name=n) for n in wl.weight_names()[1:]]

    def logits(self, ids, dense):
        rows = tf.nn.embedding_lookup(self.embedding, ids)  # parallel lookups on the table's shards
        x = tf.concat([tf.reshape(rows, [-1, wl.FIELDS * wl.DIM]), dense], axis=1)
        for i in range(len(wl.HIDDEN) + 1):
            x = tf.matmul(x, self.dense[2 * i]) + self.dense[2 * i + 1]
            if i < len(wl.HIDDEN):
                x = tf.nn.relu(x)
        return x[:, 0]

    def weights(self) -> dict[str, np.ndarray]:
        return {name: to_numpy(v) for name, v in zip(wl.weight_names(), [self.embedding, *self.dense])}


class Adagrad:
    """TF2's Adagrad on raw variables: one accumulator per variable (per shard), colocated with it."""

    def __init__(self, strategy, variables, learning_rate, initial_accumulator_value, epsilon):
        self.lr = tf.constant(learning_rate, tf.float32)
        self.epsilon = tf.constant(epsilon, tf.float32)
        self.accumulators = []
        for var in variables:
            with strategy.extended.colocate_vars_with(var):
                self.accumulators.append(tf.Variable(
                    lambda shape=var.shape: tf.fill(shape, tf.constant(initial_accumulator_value, tf.float32)),
                    trainable=False, name=var.name.split(":")[0] + "/accumulator"))

    def apply(self, grads, variables):
        for grad, var, accum in zip(grads, variables, self.accumulators):
            with tf.device(var.device):  # the update runs on the variable's ps, as tf.distribute places it
                if isinstance(grad, tf.IndexedSlices):
                    rows, position = tf.unique(grad.indices)
                    summed = tf.math.unsorted_segment_sum(grad.values, position, tf.shape(rows)[0])
                    tf.raw_ops.ResourceSparseApplyAdagradV2(var=var.handle, accum=accum.handle, lr=self.lr,
                                                            epsilon=self.epsilon, grad=summed, indices=rows)
                else:
                    tf.raw_ops.ResourceApplyAdagradV2(var=var.handle, accum=accum.handle, lr=self.lr,
                                                      epsilon=self.epsilon, grad=grad)


def make_dataset(folder: str, batch: int, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
    train = wl.load(folder, "train")
    arrays = tuple(np.asarray(train[n]) for n in ("ids", "dense", "labels"))
    return (tf.data.Dataset.from_tensor_slices(arrays)
            .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            .shuffle(wl.SHUFFLE_BUFFER)  # no seed: each worker shuffles differently (TF's recommendation)
            .repeat()
            .batch(batch, drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE))


def run_chief(args: argparse.Namespace, resolver) -> int:
    num_ps = resolver.cluster_spec().num_tasks("ps")
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps))
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

    init = wl.load(args.data, "init")
    with strategy.scope():
        model = Model(init)
        variables = [v for var in (model.embedding, *model.dense) for v in components(var)]
        optimizer = Adagrad(strategy, variables, wl.LEARNING_RATE, wl.INITIAL_ACCUMULATOR, wl.EPSILON)
    print("table shards: " + ", ".join(f"{v.shape} on {v.device}" for v in components(model.embedding))
          + "; accumulators on " + ", ".join(a.device for a in optimizer.accumulators[:num_ps]), flush=True)

    folder, batch, spe = args.data, args.batch_size, args.steps_per_execution

    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(lambda ctx: make_dataset(folder, batch, ctx))

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    def step(ids, dense, labels):
        with tf.GradientTape() as tape:
            logits = model.logits(ids, dense)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
        optimizer.apply(tape.gradient(loss, variables), variables)
        return loss

    @tf.function
    def train_fn(iterator):
        total = tf.constant(0.0)
        for _ in tf.range(spe):
            ids, dense, labels = next(iterator)
            total += strategy.run(step, args=(ids, dense, labels))
        return total / spe

    wl.timed_training(coordinator, train_fn, iterator, args, model.weights, f"tensorflow {tf.__version__}")
    return 0


def main() -> int:
    args = wl.parse_args(__doc__.splitlines()[0])
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("ps", "worker"):
        server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                      task_index=resolver.task_id, protocol=resolver.rpc_layer or "grpc", start=True)
        server.join()
        return 0
    return run_chief(args, resolver)


if __name__ == "__main__":
    sys.exit(main())
