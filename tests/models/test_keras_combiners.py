"""``KubepsEmbedding(..., combiner=...)`` and a layer called on two features (a shared table) in Keras: a worker's
training step against Keras's own ``Embedding`` pooled by hand from the formulas, and the eager and jitted
(``predict``) lookups with padding."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")  # as kubeps sets it: keras picks its backend on import
pytest.importorskip("jax")
pytest.importorskip("keras")

from kubeps.runtime.errors import RuntimeConfigError  # noqa: E402
from kubeps.runtime.models import keras_fit  # noqa: E402
from kubeps.runtime.models.keras_layers import KubepsEmbedding, keras  # noqa: E402
from kubeps.runtime.ops.optimizers import SGD  # noqa: E402
from kubeps.runtime.variables.variable import Variable  # noqa: E402

VOCAB, DIM, L = 30, 4, 5


class HandPooled(keras.layers.Layer):
    """The reference: Keras's own Embedding, pooled with keras.ops from the formulas (mean, weights, -1 padding)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(VOCAB, DIM)

    def call(self, ids, weights=None):
        real = keras.ops.cast(ids >= 0, "float32")
        w = real if weights is None else weights * real
        rows = self.embedding(keras.ops.maximum(ids, 0)) * w[..., None]
        total = keras.ops.sum(w, axis=-1, keepdims=True)
        return keras.ops.sum(rows, axis=1) / keras.ops.where(total == 0, 1.0, total)


def two_feature_model(emb) -> keras.Model:
    """Item id and clicked-item history (weighted) from one table: one layer called twice."""
    item, hist, w = keras.Input((1,), dtype="int32"), keras.Input((L,), dtype="int32"), keras.Input((L,))
    x = keras.layers.Concatenate()([emb(item), emb(hist, weights=w)])
    return keras.Model([item, hist, w], keras.layers.Dense(1)(x)[:, 0])


def batch():
    rng = np.random.default_rng(0)
    item = rng.integers(0, VOCAB, size=(6, 1))
    hist = rng.integers(0, VOCAB, size=(6, L))
    hist[0, 2:] = -1
    hist[1, :] = -1  # all padding
    hist[2, :3] = item[2, 0]  # the item again in its own history: one row, two features' gradients
    w = rng.uniform(0.5, 2.0, size=(6, L)).astype(np.float32)
    return (item, hist, w), rng.integers(0, 2, size=6).astype(np.float32)


def test_a_shared_pooled_table_trains_as_keras_own_embedding_pooled_by_hand(monkeypatch):
    import jax

    model = two_feature_model(KubepsEmbedding(VOCAB, DIM, combiner="mean"))
    table = keras_fit.table_layers(model)[0].table
    reference = two_feature_model(HandPooled())
    reference.set_weights([table.numpy()] + [v.numpy() for v in model.trainable_variables])
    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    x, y = batch()

    def ref_loss(weights):
        y_pred, _ = reference.stateless_call(weights, [], x, training=True)
        return loss(y, y_pred)

    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(reference(x)), rtol=1e-5, atol=1e-6)  # eager
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    ref_weights = [np.asarray(v.value) for v in reference.trainable_variables]
    grads = jax.grad(ref_loss)(ref_weights)
    expected = [np.asarray(v) - np.asarray(g) for v, g in zip(ref_weights, grads)]

    weights = [Variable(np.asarray(v.value), name=v.path) for v in model.trainable_variables]
    replica = keras_fit._Replica(type(model), keras_fit._plain(model.get_config()), {}, loss,
                                 [tuple(v.shape) for v in model.trainable_variables], 1)
    before = table.numpy()
    pulled = []
    real_gather = keras_fit.gather_padded_rows

    def counting(table, ids, padding=False):
        pulled.append(np.asarray(ids))
        return real_gather(table, ids, padding=padding)

    monkeypatch.setattr(keras_fit, "gather_padded_rows", counting)  # the real gather, counted
    total, examples, _, _ = replica.run(iter([(x, y)]), weights, [table], SGD(1.0), 1)
    assert len(pulled) == 1  # both features' ids in one pull
    assert total == pytest.approx(float(ref_loss(ref_weights)), rel=1e-5)
    np.testing.assert_allclose(table.numpy(), expected[0], rtol=1e-5, atol=1e-6)
    untouched = np.setdiff1d(np.arange(VOCAB), np.concatenate([x[0].ravel(), x[1].ravel()]))
    np.testing.assert_array_equal(table.numpy()[untouched], before[untouched])
    for weight, want in zip(weights, expected[1:]):
        np.testing.assert_allclose(weight.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "sqrtn"])
def test_the_other_combiners_pool_the_looked_up_rows(combiner):
    layer = KubepsEmbedding(VOCAB, DIM, combiner=combiner)
    ids = np.array([[1, 2, 2, -1], [-1, -1, -1, -1]])
    out = np.asarray(layer(ids))
    rows = layer.table.numpy()
    denom = 1.0 if combiner == "sum" else np.sqrt(3.0)
    np.testing.assert_allclose(out[0], (rows[1] + 2 * rows[2]) / denom, rtol=1e-5)
    np.testing.assert_array_equal(out[1], 0)
    assert keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer)).combiner == combiner


def test_bad_combiner_inputs_are_refused():
    with pytest.raises(RuntimeConfigError, match=r"KubepsEmbedding\.combiner.*'avg'.*\['sum', 'mean', 'sqrtn'\]"):
        KubepsEmbedding(VOCAB, DIM, combiner="avg")
    layer = KubepsEmbedding(VOCAB, DIM, combiner="sum")
    refused = (RuntimeConfigError, RuntimeError)  # Keras re-raises an error of its layer's call as a RuntimeError
    with pytest.raises(refused, match=r"weights.*shape \[2, 3\].*shape of the ids \[2, 4\]"):
        layer(np.zeros((2, 4), np.int32), weights=np.ones((2, 3), np.float32))
    with pytest.raises(refused, match="weights only with a combiner"):
        KubepsEmbedding(VOCAB, DIM)(np.zeros((2, 4), np.int32), weights=np.ones((2, 4), np.float32))
    with pytest.raises(refused, match=r"ids.*-1.*\[0, 30\)"):
        KubepsEmbedding(VOCAB, DIM)(np.array([[-1, 2]]))  # without a combiner -1 is no padding
