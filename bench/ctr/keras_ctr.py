"""The Keras side of ``bench/ctr_vs_tf.py --keras``: the workload of ``workload.py`` as a Keras 3 model (JAX
backend) trained with kubeps's ``fit`` entry point (``KerasTrainer.fit``), as a Keras user would write it: a
functional model whose table is a ``KubepsEmbedding`` (on the ps, sharded by ``FixedShardsPartitioner``; only the
batch's rows travel), ``keras.optimizers.Adagrad`` (applied on the ps), ``BinaryCrossentropy(from_logits=True)``.

    kubeps local --ps 2 --workers 2 bench/ctr/keras_ctr.py -- --data DIR --steps 3000

The model starts from the same initial weights as the other sides (``DIR``'s ``init_*.npy``: the table assigned on
the ps, the head's weights set before ``fit`` copies them there). One ``fit`` of ``--warmup-executions`` x
``--steps-per-execution`` steps is not timed (it includes the workers' one-off XLA compilation); a second ``fit``
on the same trainer continues from that step to ``--steps`` and is timed from its call to its return (the last
``join()`` and the weights pulled back), between ``TIMED START``/``TIMED END`` lines as the other sides. The final
weights are scored with ``workload.evaluate``; one line ``RESULT {json}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import json  # noqa: E402 - the backend must be chosen before keras is imported
import sys  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kubeps_ctr  # noqa: E402 - next to this file: the dataset
import workload as wl  # noqa: E402

from kubeps.runtime.models.keras_fit import KerasTrainer  # noqa: E402
from kubeps.runtime.models.keras_layers import KubepsEmbedding  # noqa: E402


def build_model() -> keras.Model:
    """``logit = MLP(concat(flatten(table[ids]), dense))`` with ``workload``'s sizes."""
    ids = keras.Input((wl.FIELDS,), dtype="int32", name="ids")
    dense = keras.Input((wl.DENSE,), dtype="float32", name="dense")
    rows = KubepsEmbedding(wl.VOCAB, wl.DIM, embeddings_initializer="zeros", name="embedding")(ids)
    x = keras.layers.Concatenate()([keras.layers.Flatten()(rows), dense])
    for i, units in enumerate(wl.HIDDEN):
        x = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(x)
    logit = keras.layers.Dense(1, name=f"dense_{len(wl.HIDDEN)}")(x)
    return keras.Model([ids, dense], logit, name="ctr")


def keras_batches(ids, dense, labels):
    """A batch of the workload's dataset as Keras's ``(x, y)``; the ids as int32 (JAX's default integer)."""
    return (ids.astype(np.int32), dense), labels[:, None]


def run_chief(args, build=build_model) -> int:
    """The chief: the Keras model ``build()`` trained by ``KerasTrainer.fit``, timed as the other sides."""
    with kubeps_ctr.chief_cluster(args.dense_staleness) as (strategy, coordinator):
        init = wl.load(args.data, "init")
        with strategy.scope():
            model = build()
        table = model.get_layer("embedding").table
        table.assign(np.asarray(init["embedding"]))
        for i in range(len(wl.HIDDEN) + 1):
            model.get_layer(f"dense_{i}").set_weights([np.asarray(init[f"w{i}"]), np.asarray(init[f"b{i}"])])
        optimizer = keras.optimizers.Adagrad(learning_rate=wl.LEARNING_RATE,
                                             initial_accumulator_value=wl.INITIAL_ACCUMULATOR, epsilon=wl.EPSILON)
        trainer = KerasTrainer(model, coordinator, optimizer=optimizer,
                               loss=keras.losses.BinaryCrossentropy(from_logits=True),
                               steps_per_execution=args.steps_per_execution)
        folder, batch, spe = args.data, args.batch_size, args.steps_per_execution

        def dataset_fn(ctx):
            return kubeps_ctr.make_dataset(folder, batch, ctx).map(keras_batches)

        total = args.steps // spe * spe
        warmup = min(args.warmup_executions * spe, total)
        if warmup:
            trainer.fit(dataset_fn, epochs=1, steps_per_epoch=warmup, verbose=0)
        print(f"TIMED START {time.time():.6f}", flush=True)
        started = time.perf_counter()
        history = trainer.fit(dataset_fn, epochs=1, steps_per_epoch=total, verbose=0)  # from step `warmup`
        elapsed = time.perf_counter() - started
        print(f"TIMED END {time.time():.6f}", flush=True)
        timed = history.history["examples"][0] if history.history.get("examples") else 0
        weights = {"embedding": np.asarray(table.numpy())}
        for i in range(len(wl.HIDDEN) + 1):
            weights[f"w{i}"], weights[f"b{i}"] = (np.asarray(w) for w in model.get_layer(f"dense_{i}").get_weights())
        result = {"examples_per_s": timed / elapsed, "train_seconds": elapsed, "steps": total,
                  "train_logloss": float(history.history["loss"][0])}
        result.update(wl.evaluate(weights, args.data))
        print(f"keras: {timed // batch} timed steps of {batch} in {elapsed:.1f} s: {result['examples_per_s']:.0f} "
              f"examples/s; eval log-loss {result['eval_logloss']:.4f} (teacher {result['teacher_logloss']:.4f})",
              flush=True)
        print("RESULT " + json.dumps(result), flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(kubeps_ctr.main(build_model, run_chief))
