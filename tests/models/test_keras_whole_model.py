"""The Keras model is whole outside kubeps's fit, and fit's Keras-side parts work without a cluster: a model with a
``KubepsEmbedding`` predicts, evaluates, saves (the whole table), loads and counts its table in ``summary()``;
Keras's own ``model.fit`` is refused by name; metric states summed from several functions equal one metric's;
validation equals Keras's ``evaluate``; ``class_weight``; Keras's callbacks and the learning rate they set; a final
checkpoint when a callback stops early; a checkpoint directory outside the roots refused before anything is written."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")  # as kubeps sets it: keras picks its backend on import
pytest.importorskip("jax")
pytest.importorskip("keras")

from kubeps.runtime.checkpoint.reader import CheckpointReader  # noqa: E402
from kubeps.runtime.checkpoint.saveables import StepCounter  # noqa: E402
from kubeps.runtime.errors import RuntimeConfigError  # noqa: E402
from kubeps.runtime.models import keras_fit, keras_metrics  # noqa: E402
from kubeps.runtime.models.keras_callbacks import ModelCheckpoint, check_checkpoint_root  # noqa: E402
from kubeps.runtime.models.keras_layers import KubepsEmbedding, keras  # noqa: E402
from kubeps.runtime.ops.optimizers import Adam  # noqa: E402
from kubeps.runtime.ops.schedules import ExponentialDecay  # noqa: E402
from kubeps.runtime.settings import TaskSettings  # noqa: E402
from kubeps.runtime.variables.variable import Variable  # noqa: E402

VOCAB = 300


def classifier() -> keras.Model:
    ids, dense = keras.Input((2,), dtype="int32", name="ids"), keras.Input((3,), name="numeric")
    rows = keras.layers.Flatten()(KubepsEmbedding(VOCAB, 4, name="table")(ids))
    out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Concatenate()([rows, dense]))
    return keras.Model([ids, dense], out)


def data(n: int = 96, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = (rng.integers(0, VOCAB, size=(n, 2)).astype(np.int32), rng.normal(size=(n, 3)).astype(np.float32))
    return x, (rng.random((n, 1)) < 0.5).astype(np.float32)


def test_predict_evaluate_save_load_and_summary_with_the_table(tmp_path, capsys):
    model = classifier()  # outside a scope: the table is local (as in a plain process or the evaluator)
    table = keras_fit.table_layers(model)[0].table
    table.assign(np.random.default_rng(1).normal(size=(VOCAB, 4)).astype(np.float32))  # "trained" rows
    x, y = data()
    predicted = model.predict(x, verbose=0)  # jitted by Keras: the rows come through a host callback
    np.testing.assert_allclose(predicted, np.asarray(model(x)), rtol=1e-5, atol=1e-6)
    model.compile(loss="binary_crossentropy", metrics=["accuracy", keras.metrics.AUC()])
    evaluated = model.evaluate(x, y, verbose=0, return_dict=True)
    assert set(evaluated) == {"loss", "accuracy", "auc"}
    assert model.layers[1].count_params() == VOCAB * 4
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(keras_fit.table_layers(loaded)[0].table.numpy(), table.numpy())
    np.testing.assert_allclose(loaded.predict(x, verbose=0), predicted, rtol=1e-6)



def test_keras_s_own_fit_is_refused_by_name_and_changes_nothing(tmp_path):
    """A user compiles with an optimizer and calls Keras's ``model.fit``: refused before Keras takes the weights out
    of their variables, so the model still predicts the same and saves."""
    model = classifier()
    x, y = data()
    weights = [np.asarray(v.value).copy() for v in model.weights]
    predicted = model.predict(x, verbose=0)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    with pytest.raises(RuntimeConfigError, match=r"KubepsEmbedding \['table'\]'.*Keras's own fit cannot update a "
                                                 r"table.*keras_fit.fit"):
        model.fit(x, y, verbose=0)
    for variable, before in zip(model.weights, weights):
        np.testing.assert_array_equal(np.asarray(variable.value), before)
    np.testing.assert_array_equal(model.predict(x, verbose=0), predicted)
    model.save(tmp_path / "after-refusal.keras")
    loaded = keras.saving.load_model(tmp_path / "after-refusal.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), predicted, rtol=1e-6)
    assert set(model.evaluate(x, y, verbose=0, return_dict=True)) == {"loss", "accuracy"}


def test_a_model_without_a_table_still_fits_with_keras():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    history = model.fit(x, x.sum(axis=1, keepdims=True), epochs=5, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_metric_states_summed_over_functions_equal_one_metric_over_every_batch():
    x, y = data(64)
    y_pred = np.random.default_rng(2).random((64, 1)).astype(np.float32)
    specs = keras_metrics.metric_specs(["accuracy", keras.metrics.AUC(name="auc")])
    totals = keras_metrics.MetricTotals()
    for part in (slice(0, 20), slice(20, 64)):  # two workers' functions, each from the initial state
        metrics = keras_metrics.resolve_metrics(specs, y[part], y_pred[part])
        states = [m.stateless_update_state([v.value for v in m.variables], y[part], y_pred[part]) for m in metrics]
        totals.add([keras.metrics.serialize(m) for m in metrics], [[np.asarray(v) for v in s] for s in states])
    whole = [keras.metrics.BinaryAccuracy(), keras.metrics.AUC()]
    for m in whole:
        m.update_state(y, y_pred)
    assert totals.results() == pytest.approx({"accuracy": float(whole[0].result()), "auc": float(whole[1].result())})


def test_validation_is_what_keras_evaluate_measures_and_class_weight_weighs_by_label():
    model = classifier()
    x, y = data(100)
    validation = keras_metrics.Validation(model, "binary_crossentropy", keras_metrics.metric_specs(["accuracy"]),
                                          (x, y), batch_size=32)
    model.compile(loss="binary_crossentropy", metrics=["accuracy"])
    expected = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    got = validation.run()
    assert got["val_loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert got["val_accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
    assert keras_metrics.class_weights({0: 1.0, 1: 3.0}, np.array([[0.0], [1.0]]), None).tolist() == [1.0, 3.0]
    assert keras_metrics.class_weights({2: 0.5}, np.eye(3)[[2, 0]], np.array([2.0, 2.0])).tolist() == [1.0, 2.0]
    for bad, match in ((["nope"], "metrics\\[0\\]"), ({"a": "b"}, "metrics")):
        with pytest.raises(RuntimeConfigError, match=match):
            keras_metrics.metric_specs(bad)
    with pytest.raises(RuntimeConfigError, match="class_weight\\['a'\\]"):
        keras_metrics.check_class_weight({"a": 1.0})
    with pytest.raises(RuntimeConfigError, match="validation_freq"):
        keras_metrics.Validation(model, "mse", [], (x, y), freq=0)


def test_keras_callbacks_set_the_kubeps_rate_and_those_needing_kerass_trainer_are_refused():
    trainer = SimpleNamespace(optimizer=Adam(0.01), step=StepCounter(0))
    view = keras_fit._OptimizerView(trainer)
    view.learning_rate = np.float32(0.005)  # as ReduceLROnPlateau sets it
    assert trainer.optimizer.learning_rate == pytest.approx(0.005) and view.learning_rate == pytest.approx(0.005)
    trainer.optimizer = Adam(ExponentialDecay(0.1, 10, 0.5))
    assert view.learning_rate == pytest.approx(0.1)
    with pytest.raises(RuntimeConfigError, match="schedule"):
        view.learning_rate = 0.05
    for refused, match in ((keras.callbacks.ModelCheckpoint("/tmp/x.keras"), "keras_callbacks.ModelCheckpoint"),
                           (keras.callbacks.TensorBoard(), "keras_callbacks.TensorBoard"),
                           (keras.callbacks.EarlyStopping(restore_best_weights=True), "restore_best_weights")):
        with pytest.raises(RuntimeConfigError, match=match):
            keras_fit._KerasCallbacks([refused], 2, 10, 0)


def test_a_callback_stopping_early_leaves_a_final_checkpoint(tmp_path):
    step = StepCounter(0)
    trainer = SimpleNamespace(variables={"w": Variable(np.zeros(3, np.float32), name="w")}, step=step,
                              total_steps=100, stop_training=False, settings=TaskSettings())
    callback = ModelCheckpoint(str(tmp_path / "ckpt"), verbose=0)
    callback.set_trainer(trainer)
    callback.on_train_begin()
    step.assign(40)
    callback.on_epoch_end(1, {"loss": 1.0})
    trainer.stop_training = True  # EarlyStopping, after the checkpoint callback ran
    callback.on_train_end({"step": 40})
    readers = [CheckpointReader(p) for p in callback.saved]
    assert [(r.step, r.final) for r in readers] == [(40, False), (40, True)]
    trainer.stopping = True  # Keras's EarlyStopping ran before the checkpoint callback at this epoch's end
    step.assign(60)
    callback.on_epoch_end(2, {"loss": 1.0})
    callback.on_train_end({"step": 60})
    readers = [CheckpointReader(p) for p in callback.saved[2:]]
    assert [(r.step, r.final) for r in readers] == [(60, True)]


def test_a_checkpoint_directory_outside_the_roots_is_refused_before_anything_is_written(tmp_path):
    settings = TaskSettings(checkpoint_root=(str(tmp_path / "root"),))
    check_checkpoint_root(str(tmp_path / "root" / "ckpt"), "directory", settings)
    with pytest.raises(RuntimeConfigError, match="ModelCheckpoint directory.*checkpoint roots"):
        check_checkpoint_root(str(tmp_path / "elsewhere"), "ModelCheckpoint directory", settings)
    assert not (tmp_path / "elsewhere").exists()
