"""A small TensorFlow ParameterServerStrategy program (TensorFlow's own pattern), run by the kubeps operator as is.

Every task runs this file with the TF_CONFIG the operator injects. ps and worker tasks start a
``tf.distribute.Server`` and block in ``join()``; the chief builds a ``ParameterServerStrategy`` and a
``ClusterCoordinator``, creates a linear model's variables on the parameter servers, schedules training steps on
the workers and checks that the model found the weights the data came from. Exit status 0 when it did.

    kubectl apply -f examples/tf/job.yaml      # image: examples/tf/Dockerfile (tensorflow-cpu)
"""

from __future__ import annotations

import os
import sys

import tensorflow as tf

TRUE_W = [2.0, -3.0, 0.5, 1.0]
TRUE_B = 0.7


def dataset_fn(_ctx=None) -> tf.data.Dataset:
    x = tf.random.stateless_normal([4096, len(TRUE_W)], seed=[1, 2])
    y = tf.linalg.matvec(x, TRUE_W) + TRUE_B
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096, seed=3).repeat().batch(64)


def main() -> int:
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                      task_index=resolver.task_id, protocol=resolver.rpc_layer or "grpc",
                                      start=True)
        print(f"{resolver.task_type} {resolver.task_id}: serving", flush=True)
        server.join()
        return 0
    if resolver.task_type not in ("chief", None):
        print(f"task type {resolver.task_type!r} has nothing to do in this example", file=sys.stderr)
        return 0

    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        w = tf.Variable(tf.zeros([len(TRUE_W)]), name="w")
        b = tf.Variable(0.0, name="b")
    print(f"variables on {w.device} and {b.device}", flush=True)

    @tf.function
    def step_fn(iterator):
        def replica_fn(batch):
            x, y = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.linalg.matvec(x, w) + b - y))
            gw, gb = tape.gradient(loss, [w, b])
            w.assign_sub(0.1 * gw)
            b.assign_sub(0.1 * gb)
            return loss

        losses = strategy.run(replica_fn, args=(next(iterator),))
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    steps = int(os.environ.get("STEPS", "300"))
    result = None
    for _ in range(steps):
        result = coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    loss = float(result.fetch())
    print(f"trained {steps} steps: loss {loss:.6f}  w {w.numpy().round(3).tolist()}  b {float(b.numpy()):.3f}",
          flush=True)
    return 0 if loss < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
