"""A Keras model never compiled: ``fit`` is given its optimizer, loss and metrics, as the docs allow; then, on the
chief, ``model.evaluate`` (no ``compile`` in between), Keras's own ``model.fit`` (refused) and ``model.save``. Run by
tests/models/test_keras_fit_arguments.py, which reads what it writes to $FIT_ARGUMENTS_OUT."""
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
import keras
import numpy as np

import kubeps.runtime as kp
from kubeps.runtime.models.keras_fit import fit
from kubeps.runtime.models.keras_layers import KubepsEmbedding

OUT = os.environ["FIT_ARGUMENTS_OUT"]
VOCAB = 1000


def examples(n, seed):
    rng = np.random.default_rng(seed)
    ids, dense = rng.integers(0, VOCAB, size=(n, 2)), rng.normal(size=(n, 3)).astype(np.float32)
    logit = dense @ np.array([1.0, -1.0, 0.5]) + np.where(ids[:, 0] % 2 == 0, 1.5, -1.5)
    return (ids, dense), (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)[:, None]


HELD_OUT = examples(1000, seed=99)


def dataset_fn(input_context):
    (ids, dense), labels = examples(8192, seed=input_context.input_pipeline_id)
    return (kp.Dataset.from_tensor_slices((ids, dense, labels)).repeat().batch(128, drop_remainder=True)
            .map(lambda i, d, y: ((i, d), y)))


def main():
    strategy = kp.ParameterServerStrategy(resolver)
    coordinator = kp.ClusterCoordinator(strategy)
    with strategy.scope():
        ids, dense = keras.Input((2,), dtype="int32", name="ids"), keras.Input((3,), name="numeric")
        rows = keras.layers.Flatten()(KubepsEmbedding(VOCAB, 4, name="table")(ids))
        model = keras.Model([ids, dense], keras.layers.Dense(1)(keras.layers.Concatenate()([rows, dense])))
    history = fit(model, coordinator, dataset_fn, epochs=2, steps_per_epoch=10, optimizer=keras.optimizers.Adagrad(0.1),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy")],
                  validation_data=HELD_OUT)
    record = {"history": history.history, "evaluate": model.evaluate(*HELD_OUT, verbose=0, return_dict=True)}
    predicted = model.predict(HELD_OUT[0], verbose=0)
    try:
        model.fit(*HELD_OUT, verbose=0)
    except kp.RuntimeConfigError as err:
        record["refused"] = str(err)
    model.save(os.path.join(OUT, "model.keras"))
    np.save(os.path.join(OUT, "predicted.npy"), predicted)
    np.save(os.path.join(OUT, "predicted_after.npy"), model.predict(HELD_OUT[0], verbose=0))
    with open(os.path.join(OUT, "chief.json"), "w") as f:
        json.dump(record, f)
    coordinator.shutdown()
    return 0


resolver = kp.TFConfigClusterResolver()
if resolver.task_type in ("ps", "worker"):
    kp.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
else:
    sys.exit(kp.run_coordinator(main))
