"""A 3-class classifier written from docs/keras.md alone, as a Keras user would (not one of the project's examples):
compile with metrics, fit with validation_data and Keras's own callbacks, then save, predict and evaluate on the
chief; the evaluator evaluates every checkpoint with Keras's evaluate. Run by tests/models/test_keras_new_user.py,
which reads what it writes to $NEW_USER_OUT."""
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
import keras
import numpy as np

import kubeps.runtime as kp
from kubeps.runtime.models.keras_callbacks import ModelCheckpoint
from kubeps.runtime.models.keras_fit import fit, restore_weights
from kubeps.runtime.models.keras_layers import KubepsEmbedding

OUT = os.environ["NEW_USER_OUT"]
CHECKPOINTS = os.path.join(OUT, "ckpt")
VOCAB, CLASSES = 5000, 3


def build_model():
    ids, dense = keras.Input((3,), dtype="int32", name="ids"), keras.Input((4,), name="numeric")
    rows = keras.layers.Flatten()(KubepsEmbedding(VOCAB, 8, name="ids_embedding")(ids))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([rows, dense]))
    return keras.Model([ids, dense], keras.layers.Dense(CLASSES, activation="softmax")(hidden))


def examples(n, seed):
    rng = np.random.default_rng(seed)
    ids, dense = rng.integers(0, VOCAB, size=(n, 3)), rng.normal(size=(n, 4)).astype(np.float32)
    score = np.stack([dense[:, 0] + (ids[:, 0] % 3 == 0), dense[:, 1] + (ids[:, 1] % 3 == 1),
                      dense[:, 2] + (ids[:, 2] % 3 == 2)], axis=1)
    labels = np.argmax(score + rng.normal(scale=0.5, size=score.shape), axis=1).astype(np.int32)
    return (ids, dense), labels


def dataset_fn(input_context):
    (ids, dense), labels = examples(20_000, seed=input_context.input_pipeline_id)
    return (kp.Dataset.from_tensor_slices((ids, dense, labels)).shuffle(5000).repeat()
            .batch(128, drop_remainder=True).map(lambda i, d, y: ((i, d), y)))


def compiled(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


VALIDATION = examples(2000, seed=99)


def main():
    strategy = kp.ParameterServerStrategy(resolver, variable_partitioner=kp.FixedShardsPartitioner(2))
    coordinator = kp.ClusterCoordinator(strategy)
    with strategy.scope():
        model = compiled(build_model())
    # min_delta=1.0: no epoch improves on the first by that much, so training stops after the third epoch and the
    # rate is halved after the second and the third
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=1.0)
    reduce = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=1.0)
    seen = []  # the loss of the model as a callback sees it, on the validation data

    def loss_seen(epoch, logs):
        predicted = model(VALIDATION[0])
        seen.append(float(np.mean(keras.losses.sparse_categorical_crossentropy(VALIDATION[1], predicted))))

    history = fit(model, coordinator, dataset_fn, epochs=6, steps_per_epoch=20, steps_per_execution=5,
                  validation_data=VALIDATION,
                  callbacks=[ModelCheckpoint(CHECKPOINTS), stop, reduce,
                             keras.callbacks.CSVLogger(os.path.join(OUT, "log.csv")),
                             keras.callbacks.LambdaCallback(on_epoch_end=loss_seen)])
    model.summary()
    model.save(os.path.join(OUT, "model.keras"))
    predictions = model.predict(VALIDATION[0], verbose=0)
    np.save(os.path.join(OUT, "predictions.npy"), predictions)
    evaluated = model.evaluate(*VALIDATION, verbose=0, return_dict=True)
    with open(os.path.join(OUT, "chief.json"), "w") as f:
        json.dump({"history": history.history, "evaluate": evaluated, "stopped_epoch": stop.stopped_epoch,
                   "seen_by_callback": seen}, f)
    coordinator.shutdown()
    return 0


def evaluate():
    model = compiled(build_model())

    def eval_fn(values, batches):
        restore_weights(model, values)
        return model.evaluate(*VALIDATION, verbose=0, return_dict=True)

    records = kp.SidecarEvaluator(eval_fn, [VALIDATION], CHECKPOINTS, poll_interval=0.5, timeout=120).start()
    with open(os.path.join(OUT, "evaluator.json"), "w") as f:
        json.dump([{"step": r["step"], "final": r.get("final"), **r["metrics"]} for r in records], f)
    return 0


resolver = kp.TFConfigClusterResolver()
if resolver.task_type in ("ps", "worker"):
    kp.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
elif resolver.task_type == "evaluator":
    sys.exit(evaluate())
else:
    sys.exit(kp.run_coordinator(main))
