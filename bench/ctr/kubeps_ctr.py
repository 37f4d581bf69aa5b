"""The kubeps side of ``bench/ctr_vs_tf.py``: the workload of ``workload.py`` on ParameterServerStrategy +
ClusterCoordinator, written as a kubeps user would (``kubeps.runtime`` facade, ``nn`` layers, Adagrad on the ps).

    kubeps local --ps 2 --workers 2 bench/ctr/kubeps_ctr.py -- --data DIR --steps 3000

The chief builds the model in ``strategy.scope()`` from the initial weights in ``DIR`` (the table sharded over the
ps by ``FixedShardsPartitioner``), creates the per-worker dataset, schedules ``--warmup-executions`` executions of
``--steps-per-execution`` steps (not timed), then times the rest up to the last ``join()``. It reads the final
weights back and scores them with ``workload.evaluate``, and prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as wl  # noqa: E402 - next to this file, only numpy

import kubeps.runtime as kp  # noqa: E402
from kubeps.runtime.ops import nn  # noqa: E402


class FromArray:
    """An initializer that hands out one given array once (so the array never travels with the model)."""

    def __init__(self, array: np.ndarray):
        self.array = np.asarray(array)

    def __call__(self, shape, dtype):
        array, self.array = self.array, None
        assert array is not None and tuple(array.shape) == tuple(shape), (shape, None if array is None else array.shape)
        return array.astype(dtype)


class Model:
    side = "kubeps"

    def __init__(self, init: dict[str, np.ndarray], hot_rows: int = 0, hot_refresh_steps: int = 20):
        self.embedding = nn.Embedding(wl.VOCAB, wl.DIM, embeddings=kp.Variable(np.asarray(init["embedding"]),
                                                                                name="embedding"),
                                      hot_rows=hot_rows, hot_refresh_steps=hot_refresh_steps)
        kernels = [np.asarray(init[f"w{i}"]) for i in range(sum(1 for n in init if n.startswith("w")))]
        layers = []
        for i, kernel in enumerate(kernels):
            fan_in, units = kernel.shape
            layers.append(nn.Dense(units, activation="relu" if i < len(kernels) - 1 else None, input_dim=fan_in,
                                   kernel_initializer=FromArray(init[f"w{i}"]),
                                   bias_initializer=FromArray(init[f"b{i}"]), name=f"dense_{i}"))
        self.head = nn.Sequential(layers)
        self.loss = nn.SigmoidCrossEntropy()

    def train_step(self, ids, dense, labels, optimizer, next_ids=None) -> float:
        """One step; with ``next_ids`` (``--overlap``) the next batch's rows and the dense weights are pulled, with
        this worker's previous push, while this step computes: the next step's values are one step stale."""
        rows = self.embedding.forward(ids)  # on a GPU worker: moved there in one transfer
        if next_ids is not None:
            self.embedding.prefetch(next_ids)
        dense, labels = kp.kernels.to_device(dense, labels)  # the batch: one transfer (none on a CPU worker)
        x = kp.kernels.array_module(rows).concatenate([rows.reshape(len(ids), -1), dense], axis=1)
        loss = self.loss.forward(self.head.forward(x)[:, 0], labels)
        dx = self.head.backward(self.loss.backward()[:, None])
        self.embedding.backward(dx[:, : wl.FIELDS * wl.DIM].reshape(len(ids), wl.FIELDS, wl.DIM))
        optimizer.apply_gradients(nn.all_grads_and_vars([self.embedding, self.head]))
        return loss

    def weights(self) -> dict[str, np.ndarray]:
        out = {"embedding": self.embedding.embeddings.numpy()}
        for i, layer in enumerate(self.head.layers):
            out[f"w{i}"], out[f"b{i}"] = layer.kernel.numpy(), layer.bias.numpy()
        return out


def make_dataset(folder: str, batch: int, ctx: kp.InputContext) -> kp.Dataset:
    train = wl.load(folder, "train")
    return (kp.Dataset.from_tensor_slices((train["ids"], train["dense"], train["labels"]))
            .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            .shuffle(wl.SHUFFLE_BUFFER, seed=ctx.input_pipeline_id)
            .repeat()
            .batch(batch, drop_remainder=True)
            .prefetch(2))


@contextlib.contextmanager
def chief_cluster(dense_staleness: int = 0):
    """The chief's strategy (the table sharded over the ps by ``FixedShardsPartitioner``; ``dense_staleness`` as
    ``--dense-staleness``) and coordinator, shut down at the end of the block."""
    resolver = kp.TFConfigClusterResolver()
    num_ps = resolver.cluster_spec().num_tasks("ps")
    strategy = kp.ParameterServerStrategy(resolver, variable_partitioner=kp.FixedShardsPartitioner(num_ps),
                                          dense_staleness=dense_staleness)
    coordinator = kp.ClusterCoordinator(strategy)
    try:
        yield strategy, coordinator
    finally:
        coordinator.shutdown()
        strategy.close()


def run_chief(args: argparse.Namespace, build=Model) -> int:
    """The chief with the model ``build(init)`` (``jax_ctr.py`` passes the JAX one)."""
    with chief_cluster(args.dense_staleness) as (strategy, coordinator):
        init = wl.init_weights(args.data, args.head)
        with strategy.scope():
            hot = {"hot_rows": args.hot_rows, "hot_refresh_steps": args.hot_refresh_steps} if args.hot_rows else {}
            model = build(init, **hot)
        optimizer = kp.Adagrad(learning_rate=wl.LEARNING_RATE, initial_accumulator_value=wl.INITIAL_ACCUMULATOR,
                               epsilon=wl.EPSILON)
        folder, batch = args.data, args.batch_size

        def dataset_fn(ctx):
            return make_dataset(folder, batch, ctx)

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        spe = args.steps_per_execution

        overlap = args.overlap

        def train_fn(it):
            """The mean loss of ``spe`` steps, with the embedding rows they pulled when the model counts them."""
            total = 0.0
            layer = getattr(model, "embedding", None)
            pulled = getattr(layer, "rows_pulled", None)
            batch = next(it)
            for step in range(spe):
                following = next(it) if step + 1 < spe else None
                next_ids = following[0] if overlap and following is not None else None
                total += model.train_step(*batch, optimizer, next_ids=next_ids)
                batch = following
            return total / spe if pulled is None else (total / spe, layer.rows_pulled - pulled)

        wl.timed_training(coordinator, train_fn, iterator, args, model.weights, model.side)
        return 0


def main(build=Model, chief=run_chief) -> int:
    """ps and worker tasks serve; the chief runs ``chief(args, build)`` (``keras_ctr.py`` passes its own)."""
    args = wl.parse_args(__doc__.splitlines()[0])
    resolver = kp.TFConfigClusterResolver()
    if resolver.task_type in ("ps", "worker"):
        kp.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
        return 0
    return chief(args, build)


if __name__ == "__main__":
    sys.exit(main())
