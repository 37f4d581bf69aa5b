"""keras_fit without a cluster: one training step of the worker's replica (local variables) against Keras's own
gradients, the optimizer mapping, and the errors (each names the field, the value and what is allowed)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")  # as kubeps sets it: keras picks its backend on import
pytest.importorskip("jax")
pytest.importorskip("keras")

from kubeps.runtime.errors import RuntimeConfigError  # noqa: E402
from kubeps.runtime.models import keras_fit  # noqa: E402
from kubeps.runtime.models.keras_callbacks import ModelCheckpoint  # noqa: E402
from kubeps.runtime.models.keras_layers import KubepsEmbedding, keras  # noqa: E402
from kubeps.runtime.ops.optimizers import SGD, Adagrad, Adam, Ftrl, Momentum  # noqa: E402
from kubeps.runtime.variables.variable import Variable  # noqa: E402

VOCAB, DIM, FIELDS = 50, 4, 3


def functional_model(embedding: keras.layers.Layer) -> keras.Model:
    ids, dense = keras.Input((FIELDS,), dtype="int32"), keras.Input((2,))
    x = keras.layers.Concatenate()([keras.layers.Flatten()(embedding(ids)), dense])
    x = keras.layers.Dense(5, activation="relu")(x)
    return keras.Model([ids, dense], keras.layers.Dense(1)(x)[:, 0])


def batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(8, FIELDS))
    ids[0, :] = 7  # a repeated id: its row gradient is summed
    return (ids, rng.normal(size=(8, 2)).astype(np.float32)), rng.integers(0, 2, size=8).astype(np.float32)


def test_a_replica_step_applies_keras_gradients_with_the_table_row_sparse():
    """The worker's step (ids pass, unique rows, value_and_grad of stateless_call) gives the same update as
    Keras's own Embedding differentiated whole; only the batch's rows of the table change."""
    import jax

    model = functional_model(KubepsEmbedding(VOCAB, DIM))  # outside a scope: the table is a local Variable
    table = model.layers[1].table if isinstance(model.layers[1], KubepsEmbedding) else \
        keras_fit.table_layers(model)[0].table
    reference = functional_model(keras.layers.Embedding(VOCAB, DIM))
    reference.set_weights([table.numpy()] + [v.numpy() for v in model.trainable_variables])
    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    x, y = batch()

    def ref_loss(weights):
        y_pred, _ = reference.stateless_call(weights, [], x, training=True)
        return loss(y, y_pred)

    ref_grads = jax.grad(ref_loss)([v.value for v in reference.trainable_variables])
    expected = [np.asarray(v.value) - np.asarray(g) for v, g in zip(reference.trainable_variables, ref_grads)]

    weights = [Variable(np.asarray(v.value), name=v.path) for v in model.trainable_variables]  # local
    replica = keras_fit._Replica(type(model), keras_fit._plain(model.get_config()), {}, loss,
                                 [tuple(v.shape) for v in model.trainable_variables], 1)
    before = table.numpy()
    total, examples, _, _ = replica.run(iter([(x, y)]), weights, [table], SGD(1.0), 1)
    assert examples == 8 and total == pytest.approx(float(ref_loss([v.value for v in reference.trainable_variables])),
                                                      rel=1e-5)
    np.testing.assert_allclose(table.numpy(), expected[0], rtol=1e-5, atol=1e-6)
    untouched = np.setdiff1d(np.arange(VOCAB), x[0])
    np.testing.assert_array_equal(table.numpy()[untouched], before[untouched])
    for weight, want in zip(weights, expected[1:]):
        np.testing.assert_allclose(weight.numpy(), want, rtol=1e-5, atol=1e-6)



def test_a_built_replica_is_left_out_of_the_collector_s_passes():
    """Keras, jax and the compiled step live as long as the worker: once the replica is built they are frozen out
    of the cyclic collector's passes (gc.freeze), which otherwise walk all of them every few hundred steps; the
    garbage of that moment is collected first, not frozen with them."""
    import gc
    import weakref

    model = functional_model(KubepsEmbedding(VOCAB, DIM))
    table = keras_fit.table_layers(model)[0].table
    weights = [Variable(np.asarray(v.value), name=v.path) for v in model.trainable_variables]
    replica = _replica(model, keras.losses.BinaryCrossentropy(from_logits=True))

    class Cycle:
        pass

    gc.disable()  # only the build's own collection runs
    try:
        assert any(o is replica.model for o in gc.get_objects())  # built at the first step
        garbage = Cycle()
        garbage.itself = garbage
        dead = weakref.ref(garbage)
        del garbage
        replica.run(iter([batch()]), weights, [table], SGD(0.1), 1)
        assert not any(o is replica.model or o is replica.model.layers[-1] for o in gc.get_objects())
        assert gc.get_freeze_count() > 0
        assert dead() is None  # collected before the freeze, not frozen with the live objects
    finally:
        gc.enable()
        gc.unfreeze()


def _replica(model, loss):
    return keras_fit._Replica(type(model), keras_fit._plain(model.get_config()), {}, loss,
                              [tuple(v.shape) for v in model.trainable_variables], len(keras_fit.table_layers(model)))


def test_ids_a_functional_model_takes_as_an_input_come_from_the_batch_and_computed_ids_from_the_ids_pass():
    """A step skips the ids pass when the table is called on a model input as it is (checked against the ids pass
    on the first batch); ids the model computes (here ``ids % VOCAB``) still come from the ids pass, and both train
    the same rows by the same gradients."""
    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    direct = functional_model(KubepsEmbedding(VOCAB, DIM))
    ids, dense = keras.Input((FIELDS,), dtype="int32"), keras.Input((2,))
    layer = KubepsEmbedding(VOCAB, DIM)
    rows = layer(ids % VOCAB)  # an op of the graph: the ids are computed, not an input
    x = keras.layers.Concatenate()([keras.layers.Flatten()(rows), dense])
    x = keras.layers.Dense(5, activation="relu")(x)
    computed = keras.Model([ids, dense], keras.layers.Dense(1)(x)[:, 0])
    computed.set_weights(direct.get_weights())
    tables = [keras_fit.table_layers(m)[0].table for m in (direct, computed)]
    tables[1].assign(tables[0].numpy())
    results = []
    for model, table in zip((direct, computed), tables):
        weights = [Variable(np.asarray(v.value), name=v.path) for v in model.trainable_variables]
        replica = _replica(model, loss)
        (xb, yb) = batch(3)
        replica.run(iter([(xb, yb), batch(4)]), weights, [table], SGD(0.5), 2)
        results.append((replica.direct, table.numpy(), [w.numpy() for w in weights]))
    assert results[0][0] == [0] and results[1][0] is None
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-6, atol=1e-7)
    for a, b in zip(results[0][2], results[1][2]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

def test_a_loss_given_by_name_is_averaged_over_the_batch_as_compile_does():
    """keras.losses.get("mse") is a per-example function: the step averages it (it used to fail in
    jax.value_and_grad, whose loss must be a scalar)."""
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    weights = [Variable(np.asarray(v.value), name=v.path) for v in model.trainable_variables]
    x = np.random.default_rng(0).normal(size=(8, 2)).astype(np.float32)
    y = np.ones((8, 1), np.float32)
    expected = float(np.mean((np.asarray(model(x)) - y) ** 2))
    replica = keras_fit._Replica(type(model), keras_fit._plain(model.get_config()), {}, "mse",
                                 [tuple(v.shape) for v in model.trainable_variables], 0)
    total, examples, _, _ = replica.run(iter([(x, y)]), weights, [], SGD(0.1), 1)
    assert examples == 8 and total == pytest.approx(expected, rel=1e-5)


def test_kubeps_embedding_looks_up_eagerly_and_restore_weights_loads_a_checkpoint_mapping():
    model = functional_model(KubepsEmbedding(VOCAB, DIM))
    layer = keras_fit.table_layers(model)[0]
    x, _ = batch()
    np.testing.assert_allclose(np.asarray(layer(x[0])), layer.table.numpy()[x[0]])
    values = {"model/" + v.path: np.full(v.shape, 0.5, np.float32) for v in model.trainable_variables}
    values["model/" + layer.table.name] = np.ones((VOCAB, DIM), np.float32)
    keras_fit.restore_weights(model, values)
    assert layer.table.numpy().sum() == VOCAB * DIM
    assert all(np.all(np.asarray(v.value) == 0.5) for v in model.trainable_variables)
    del values["model/" + layer.table.name]
    with pytest.raises(RuntimeConfigError, match="embeddings' has invalid value|is not in the checkpoint"):
        keras_fit.restore_weights(model, values)


@pytest.mark.parametrize("keras_optimizer, expected", [
    (lambda: keras.optimizers.SGD(0.5), SGD(0.5)),
    (lambda: keras.optimizers.SGD(0.5, momentum=0.8, nesterov=True), Momentum(0.5, 0.8, True)),
    (lambda: keras.optimizers.Adagrad(0.1), Adagrad(0.1, 0.1, 1e-7)),
    (lambda: keras.optimizers.Adam(0.01, beta_1=0.8), Adam(0.01, 0.8, 0.999, 1e-7)),
    (lambda: keras.optimizers.Ftrl(0.2, l1_regularization_strength=0.01), Ftrl(0.2, l1_regularization_strength=0.01)),
    (lambda: "adagrad", Adagrad(0.001, 0.1, 1e-7)),
])
def test_keras_optimizers_map_to_the_kubeps_optimizer_with_the_same_update(keras_optimizer, expected):
    assert keras_fit.kubeps_optimizer(keras_optimizer()).get_config() == expected.get_config()


def test_optimizer_settings_kubeps_cannot_apply_are_refused_by_name():
    with pytest.raises(RuntimeConfigError, match="clipnorm"):
        keras_fit.kubeps_optimizer(keras.optimizers.SGD(0.1, clipnorm=1.0))
    with pytest.raises(RuntimeConfigError, match="Lamb.*norm of the whole variable.*allowed: SGD, Adagrad"):
        keras_fit.kubeps_optimizer(keras.optimizers.Lamb(0.1))
    excluded = keras.optimizers.AdamW(0.1)
    excluded.exclude_from_weight_decay(var_names=["bias"])
    with pytest.raises(RuntimeConfigError, match="exclude_from_weight_decay.*every variable"):
        keras_fit.kubeps_optimizer(excluded)


class FakeCoordinator(SimpleNamespace):
    """Has the attributes the trainer checks for; the errors under test come before any of them is used."""

    def __init__(self):
        super().__init__(schedule=None, join=None, create_per_worker_dataset=None, create_per_worker_resource=None,
                         strategy=None)


def test_fit_refuses_batch_norm_statistics_an_unbuilt_model_and_a_local_table():
    bn = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    with pytest.raises(RuntimeConfigError, match="moving_mean.*BatchNormalization statistics"):
        keras_fit.KerasTrainer(bn, FakeCoordinator(), optimizer=SGD(0.1), loss="mse")
    with pytest.raises(RuntimeConfigError, match="build the model before fit"):
        keras_fit.KerasTrainer(keras.Sequential([keras.layers.Dense(1)]), FakeCoordinator(), optimizer=SGD(0.1),
                               loss="mse")
    local = functional_model(KubepsEmbedding(VOCAB, DIM))
    with pytest.raises(RuntimeConfigError, match="table.*local to this process.*strategy.scope"):
        keras_fit.KerasTrainer(local, FakeCoordinator(), optimizer=SGD(0.1), loss="mse")
    with pytest.raises(RuntimeConfigError, match="steps_per_execution"):
        keras_fit.KerasTrainer(local, FakeCoordinator(), optimizer=SGD(0.1), loss="mse", steps_per_execution=0)
    with pytest.raises(RuntimeConfigError, match="coordinator.*ClusterCoordinator"):
        keras_fit.KerasTrainer(local, object(), optimizer=SGD(0.1), loss="mse")
    with pytest.raises(RuntimeConfigError, match="save_freq"):
        ModelCheckpoint("/tmp/x", save_freq=0)


def test_another_keras_backend_is_refused_with_the_variable_named():
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    result = subprocess.run([sys.executable, "-c", "import kubeps.runtime.models.keras_fit"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "'KERAS_BACKEND' has invalid value 'torch'" in result.stderr
    assert "JAX backend only" in result.stderr


def test_import_kubeps_runtime_loads_neither_keras_nor_jax():
    code = "import sys, kubeps.runtime as kp, kubeps.runtime.models; kp.Variable; print(sorted(" \
           "m for m in sys.modules if m.split('.')[0] in ('keras', 'jax')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stderr


def test_dropout_seed_state_stays_on_the_worker_and_advances():
    """Keras's random-seed state is the one non-trainable variable fit supports: each worker keeps its own."""
    ids, dense = keras.Input((FIELDS,), dtype="int32"), keras.Input((2,))
    x = keras.layers.Concatenate()([keras.layers.Flatten()(KubepsEmbedding(VOCAB, DIM)(ids)), dense])
    model = keras.Model([ids, dense], keras.layers.Dense(1)(keras.layers.Dropout(0.5)(x))[:, 0])
    table = keras_fit.table_layers(model)[0].table
    weights = [Variable(np.asarray(v.value), name=v.path) for v in model.trainable_variables]
    replica = keras_fit._Replica(type(model), keras_fit._plain(model.get_config()), {}, "binary_crossentropy",
                                 [tuple(v.shape) for v in model.trainable_variables], 1)
    replica.run(iter([batch(0)]), weights, [table], SGD(0.1), 1)
    first = np.asarray(replica.non_trainable[0]).copy()
    replica.run(iter([batch(1)]), weights, [table], SGD(0.1), 1)
    assert not np.array_equal(first, np.asarray(replica.non_trainable[0]))


def test_the_hashing_layer_gives_hash_bucket_s_buckets_eagerly_jitted_and_in_a_training_step():
    """``Hashing`` before a ``KubepsEmbedding``: the buckets of the input pipeline's ``hash_bucket``, in an eager
    call, in ``predict`` (jitted) and in the worker's step (ids pass, then value_and_grad), where the table's rows
    that change are those of the hashed ids."""
    from kubeps.runtime.data.hashing import hash_bucket
    from kubeps.runtime.models.keras_layers import Hashing

    raw = keras.Input((FIELDS,), dtype="int32")
    rows = keras.layers.Flatten()(KubepsEmbedding(VOCAB, DIM)(Hashing(VOCAB, mask_value=-1)(raw)))
    model = keras.Model(raw, keras.layers.Dense(1)(rows)[:, 0])
    ids = np.array([[12345, -1, 7], [99, 2**31 - 1, 12345]], dtype=np.int32)
    want = hash_bucket(ids, VOCAB, mask_value=-1)
    hashing = next(layer for layer in model.layers if isinstance(layer, Hashing))
    assert np.asarray(hashing(ids)).tolist() == want.tolist() and want[0, 1] == 0
    table = keras_fit.table_layers(model)[0].table
    np.testing.assert_allclose(model.predict(ids, verbose=0), np.asarray(model(ids)), rtol=1e-5, atol=1e-6)
    replica = keras_fit._Replica(type(model), keras_fit._plain(model.get_config()), {},
                                 keras.losses.BinaryCrossentropy(from_logits=True),
                                 [tuple(v.shape) for v in model.trainable_variables], 1)
    weights = [Variable(np.asarray(v.value), name=v.path) for v in model.trainable_variables]
    before = table.numpy()
    replica.run(iter([(ids, np.array([1.0, 0.0], np.float32))]), weights, [table], SGD(1.0), 1)
    changed = np.flatnonzero(np.any(table.numpy() != before, axis=1))
    assert set(changed) <= set(want.reshape(-1).tolist()) and len(changed) > 0
    config = Hashing.from_config(hashing.get_config()).get_config()
    assert (config["num_bins"], config["mask_value"], config["salt"]) == (VOCAB, -1, 0)
    with pytest.raises(RuntimeConfigError, match="num_bins"):
        Hashing(0)
