"""Layers and losses: finite-difference gradient checks in float64, plus the PS-facing behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from kubeps.runtime.ops import nn
from kubeps.runtime.ops.optimizers import SGD, Adagrad

EPS = 1e-6


def numeric_grad(f, arr):
    """Central differences of scalar f() w.r.t. every entry of ``arr`` (modified in place, then restored)."""
    g = np.zeros_like(arr, dtype=np.float64)
    it = np.nditer(arr, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = arr[i]
        arr[i] = old + EPS
        hi = f()
        arr[i] = old - EPS
        lo = f()
        arr[i] = old
        g[i] = (hi - lo) / (2 * EPS)
    return g


def var_array(v):
    """The live numpy array behind a local kubeps Variable (perturbing it changes what forward reads)."""
    return v._local if hasattr(v, "_local") else v


def dense_of(grad, shape):
    """A dense array from a dense or IndexedSlices gradient."""
    if hasattr(grad, "indices"):
        out = np.zeros(shape)
        np.add.at(out, grad.indices, grad.values)
        return out
    return grad


def check_layer(layer, x, rng):
    r = rng.normal(size=layer.forward(x).shape)

    def objective():
        return float((layer.forward(x) * r).sum())

    objective()
    dx = layer.backward(r)
    grads = {id(v): g for g, v in layer.grads_and_vars()}
    for v in layer.trainable_variables:
        arr = var_array(v)
        np.testing.assert_allclose(dense_of(grads[id(v)], arr.shape), numeric_grad(objective, arr),
                                   rtol=1e-6, atol=1e-7, err_msg=f"d/d{getattr(v, 'name', 'var')}")
    if x.dtype.kind == "f":
        np.testing.assert_allclose(dx, numeric_grad(objective, x), rtol=1e-6, atol=1e-7, err_msg="d/dx")
    return dx


@pytest.mark.parametrize("activation", [None, "relu", "sigmoid", "tanh"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_dense_gradients(activation, use_bias):
    rng = np.random.default_rng(0)
    layer = nn.Dense(3, activation=activation, use_bias=use_bias, seed=1, dtype="float64", input_dim=4)
    if use_bias:  # non-zero bias so its gradient path is exercised through the activation
        layer.bias.assign(rng.normal(size=3))
    check_layer(layer, rng.normal(size=(5, 4)), rng)


def test_embedding_gradients_with_duplicate_ids():
    rng = np.random.default_rng(1)
    layer = nn.Embedding(7, 3, seed=2, dtype="float64")
    ids = np.array([[1, 4, 1], [6, 1, 0]])
    check_layer(layer, ids, rng)
    (g, v), = layer.grads_and_vars()
    assert v is layer.embeddings
    assert g.indices.tolist() == [0, 1, 4, 6]  # unique, duplicates summed on the worker
    assert g.values.shape == (4, 3)


def test_flatten_and_sequential_gradients():
    rng = np.random.default_rng(2)
    model = nn.Sequential([
        nn.Embedding(10, 2, seed=3, dtype="float64", name="emb"),
        nn.Flatten(),
        nn.Dense(4, activation="tanh", seed=4, dtype="float64", name="d0"),
        nn.Dense(1, seed=5, dtype="float64", name="d1"),
    ])
    ids = rng.integers(0, 10, size=(6, 3))
    model.forward(ids)  # Dense layers build lazily from the flattened width (3 * 2)
    assert len(model.trainable_variables) == 5
    check_layer(model, ids, rng)


def test_mlp_with_loss_gradients():
    rng = np.random.default_rng(3)
    model = nn.MLP([5, 4], output_units=1, activation="relu", input_dim=3, seed=7, dtype="float64")
    loss = nn.SigmoidCrossEntropy()
    x, y = rng.normal(size=(8, 3)), rng.integers(0, 2, size=(8, 1))

    def objective():
        return loss.forward(model.forward(x), y)

    objective()
    model.backward(loss.backward())
    for g, v in model.grads_and_vars():
        np.testing.assert_allclose(g, numeric_grad(objective, var_array(v)), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss, labels", [
    (nn.SigmoidCrossEntropy(), np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])),
    (nn.SigmoidCrossEntropy(), np.array([[0.3, 0.9, 0.5], [0.1, 0.0, 1.0]])),
    (nn.SoftmaxCrossEntropy(), np.array([2, 0])),
    (nn.SoftmaxCrossEntropy(), np.array([[0.2, 0.5, 0.3], [1.0, 0.0, 0.0]])),
], ids=["sigmoid-hard", "sigmoid-soft", "softmax-ids", "softmax-probs"])
def test_loss_gradients(loss, labels):
    logits = np.random.default_rng(4).normal(size=(2, 3)) * 3
    value = loss.forward(logits, labels)
    grad = loss.backward()
    np.testing.assert_allclose(grad, numeric_grad(lambda: loss.forward(logits, labels), logits), rtol=1e-6, atol=1e-8)
    assert value > 0


def test_softmax_loss_value():
    loss = nn.SoftmaxCrossEntropy()
    assert loss.forward(np.log(np.array([[0.25, 0.75]])), np.array([1])) == pytest.approx(-np.log(0.75))


# ------------------------------------------------------------------------------------------------------------
# Tables: plain arrays gather locally, kubeps variables go through embedding_lookup
# ------------------------------------------------------------------------------------------------------------


def test_embedding_on_plain_numpy_table_gathers_locally(monkeypatch):
    from kubeps.runtime.variables import variable as variables

    monkeypatch.setattr(variables, "embedding_lookup", lambda *a: pytest.fail("must not call embedding_lookup"))
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    layer = nn.Embedding(4, 3, embeddings=table)
    np.testing.assert_array_equal(layer.forward(np.array([3, 0])), table[[3, 0]])


def test_embedding_on_sharded_variable_pulls_only_needed_rows(monkeypatch):
    from kubeps.runtime.variables import variable as variables

    table = np.arange(26, dtype=np.float32).reshape(13, 2)
    shards = [variables.Variable(table[a:b], name=f"t/part_{i}") for i, (a, b) in
              enumerate([(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)])]
    sharded = variables.ShardedVariable(shards, name="t")
    seen = []
    real = variables.gather_unique_rows
    monkeypatch.setattr(variables, "gather_unique_rows", lambda var, ids: seen.append(ids.copy()) or real(var, ids))
    layer = nn.Embedding(13, 2, embeddings=sharded)
    ids = np.array([[12, 0], [5, 12]])
    np.testing.assert_array_equal(layer.forward(ids), table[ids])
    assert len(seen) == 1 and seen[0].tolist() == ids.tolist() and layer.rows_pulled == 3
    layer.backward(np.ones((2, 2, 2)))
    (g, v), = layer.grads_and_vars()
    assert v is sharded and g.indices.tolist() == [0, 5, 12] and g.values[2].tolist() == [2.0, 2.0]


def test_embedding_rejects_bad_input():
    with pytest.raises(ValueError, match=r"embeddings has shape \(4, 3\); expected \(input_dim, output_dim\) = \(5, 3\)"):
        nn.Embedding(5, 3, embeddings=np.zeros((4, 3)))
    layer = nn.Embedding(5, 3)
    with pytest.raises(IndexError, match=r"id 5 is out of range; allowed: 0 <= id < 5"):
        layer.forward(np.array([0, 5]))
    with pytest.raises(TypeError, match=r"ids must be integers"):
        layer.forward(np.array([0.5]))
    with pytest.raises(RuntimeError, match=r"backward called before forward"):
        nn.Embedding(5, 3).backward(np.zeros((1, 3)))


def test_layer_argument_errors():
    with pytest.raises(ValueError, match=r"'Dense.units' has invalid value 0: an integer >= 1"):
        nn.Dense(0)
    with pytest.raises(ValueError, match=r"'Dense.activation' has invalid value 'gelu': one of \['linear', 'relu', 'sigmoid', 'tanh'\] or None"):
        nn.Dense(2, activation="gelu")
    with pytest.raises(ValueError, match=r"'kernel_initializer' has invalid value 'he': one of \[.*\] or a callable"):
        nn.Dense(2, kernel_initializer="he")
    with pytest.raises(ValueError, match=r"'MLP.hidden_units' has invalid value 3: a list of integers >= 1"):
        nn.MLP(3, output_units=1)
    with pytest.raises(ValueError, match=r"layer names \['x'\] repeat"):
        nn.Sequential([nn.Dense(2, name="x"), nn.Dense(2, name="x")])
    d = nn.Dense(2, input_dim=3)
    with pytest.raises(ValueError, match=r"input has 4 features; the layer was built for 3"):
        d.forward(np.zeros((1, 4), np.float32))
    with pytest.raises(RuntimeError, match=r"no gradients yet"):
        d.grads_and_vars()
    with pytest.raises(ValueError, match=r"class-id labels must be integers in \[0, 2\)"):
        nn.SoftmaxCrossEntropy().forward(np.zeros((1, 2)), np.array([2]))


def test_glorot_uniform_is_seeded_and_bounded():
    a = nn.glorot_uniform(seed=3)((30, 20), np.float32)
    b = nn.glorot_uniform(seed=3)((30, 20), np.float32)
    np.testing.assert_array_equal(a, b)
    limit = np.sqrt(6 / 50)
    assert np.abs(a).max() <= limit and np.abs(a).max() > 0.9 * limit and a.dtype == np.float32


def test_layers_pickle_without_caches():
    import pickle

    model = nn.MLP([4], output_units=1, input_dim=3, seed=0)
    model.forward(np.ones((2, 3), np.float32))
    model.backward(np.ones((2, 1), np.float32))
    clone = pickle.loads(pickle.dumps(model))
    assert all(layer._cache_x is None and layer._grads == [] for layer in clone.layers)
    np.testing.assert_array_equal(clone.forward(np.ones((2, 3), np.float32)), model.forward(np.ones((2, 3), np.float32)))


# ------------------------------------------------------------------------------------------------------------
# Training end to end on local variables (apply_gradients through kubeps.runtime.variables.push)
# ------------------------------------------------------------------------------------------------------------


def test_train_step_learns_with_local_variables():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(512, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 0.0]) > 0).astype(np.float32)[:, None]
    model = nn.MLP([8], output_units=1, input_dim=4, seed=1)
    loss, opt = nn.SigmoidCrossEntropy(), Adagrad(0.5)
    first = loss.forward(model.forward(x), y)
    for _ in range(60):
        last = model.train_step(x, y, loss, opt)
    assert last < 0.5 * first


def test_embedding_trains_sparse_rows_only():
    emb = nn.Embedding(6, 2, seed=0)
    before = emb.embeddings.numpy().copy()
    emb.forward(np.array([1, 1, 4]))
    emb.backward(np.ones((3, 2), np.float32))
    SGD(0.1).apply_gradients(emb.grads_and_vars())
    after = emb.embeddings.numpy()
    np.testing.assert_allclose(after[1], before[1] - 0.2, rtol=1e-6)
    np.testing.assert_allclose(after[4], before[4] - 0.1, rtol=1e-6)
    np.testing.assert_array_equal(after[[0, 2, 3, 5]], before[[0, 2, 3, 5]])


# -- merging layers ------------------------------------------------------------------------------------------------
def check_merge(layer, inputs, rng):
    """Finite differences of ``sum(forward(inputs) * r)`` w.r.t. every entry of every input."""
    r = rng.normal(size=layer.forward(inputs).shape)

    def objective():
        return float((layer.forward(inputs) * r).sum())

    objective()
    grads = layer.backward(r)
    assert len(grads) == len(inputs)
    for i, (x, dx) in enumerate(zip(inputs, grads)):
        assert dx.shape == x.shape
        np.testing.assert_allclose(dx, numeric_grad(objective, x), rtol=1e-6, atol=1e-7, err_msg=f"d/dinputs[{i}]")


@pytest.mark.parametrize("axis", [-1, 1, 0])
def test_concatenate_gradients(axis):
    rng = np.random.default_rng(3)
    shapes = {-1: [(4, 2), (4, 3), (4, 1)], 1: [(4, 2), (4, 3), (4, 1)], 0: [(2, 3), (5, 3)]}[axis]
    inputs = [rng.normal(size=s) for s in shapes]
    layer = nn.Concatenate(axis=axis)
    np.testing.assert_array_equal(layer.forward(inputs), np.concatenate(inputs, axis=axis))
    check_merge(layer, inputs, rng)


def test_add_gradients():
    rng = np.random.default_rng(4)
    inputs = [rng.normal(size=(5, 3)) for _ in range(3)]
    layer = nn.Add()
    np.testing.assert_allclose(layer.forward(inputs), inputs[0] + inputs[1] + inputs[2])
    check_merge(layer, inputs, rng)


def test_wide_and_deep_with_concatenate_and_add_gradients():
    """A wide (linear) and a deep (MLP over concat(embedding rows, dense)) logit added: every gradient checks."""
    rng = np.random.default_rng(5)
    ids = np.array([[1, 3], [0, 3], [2, 2]])
    dense = rng.normal(size=(3, 2))
    labels = np.array([1.0, 0.0, 1.0])
    emb = nn.Embedding(4, 3, seed=1, dtype="float64")
    deep = nn.MLP([4], 1, input_dim=2 * 3 + 2, seed=2, dtype="float64")
    wide = nn.Dense(1, input_dim=2, seed=3, dtype="float64")
    concat, add, loss = nn.Concatenate(), nn.Add(), nn.SigmoidCrossEntropy()

    def forward():
        rows = emb.forward(ids)
        x = concat.forward([rows.reshape(3, -1), dense])
        return loss.forward(add.forward([deep.forward(x), wide.forward(dense)])[:, 0], labels)

    forward()
    d_deep, d_wide = add.backward(loss.backward()[:, None])
    wide.backward(d_wide)
    d_rows, _ = concat.backward(deep.backward(d_deep))
    emb.backward(d_rows.reshape(3, 2, 3))
    grads = {id(v): g for g, v in nn.all_grads_and_vars([emb, deep, wide])}
    for layer in (emb, deep, wide):
        for v in layer.trainable_variables:
            arr = var_array(v)
            np.testing.assert_allclose(dense_of(grads[id(v)], arr.shape), numeric_grad(forward, arr),
                                       rtol=1e-6, atol=1e-8, err_msg=v.name)


def test_merge_layers_reject_bad_inputs():
    with pytest.raises(ValueError, match=r"Concatenate 'concatenate': inputs\[1\] has shape \(3, 2\); allowed"):
        nn.Concatenate().forward([np.zeros((4, 2)), np.zeros((3, 2))])
    with pytest.raises(ValueError, match=r"axis=2 is out of range for inputs of rank 2; allowed: -2 <= axis < 2"):
        nn.Concatenate(axis=2).forward([np.zeros((4, 2)), np.zeros((4, 2))])
    with pytest.raises(ValueError, match=r"'Concatenate.axis' has invalid value 'x': an integer"):
        nn.Concatenate(axis="x")
    with pytest.raises(ValueError, match=r"Add 'add': inputs\[1\] has shape \(4, 1\); allowed: .*no broadcasting"):
        nn.Add().forward([np.zeros((4, 2)), np.zeros((4, 1))])
    with pytest.raises(ValueError, match=r"inputs is 1 input\(s\); allowed: a list of at least 2 arrays"):
        nn.Add().forward([np.zeros(2)])
    with pytest.raises(ValueError, match=r"inputs is a ndarray"):
        nn.Concatenate().forward(np.zeros((2, 2)))
    with pytest.raises(RuntimeError, match="backward called before forward"):
        nn.Add().backward(np.zeros(2))
