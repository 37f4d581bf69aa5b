"""Multi-hot features in ``nn``: ``Embedding(..., combiner=...)`` pools ids of shape (batch, L) padded with -1 as
TensorFlow's ``embedding_lookup_sparse`` does, forward and backward against a numpy reference written from the
formulas; shared tables (one layer called twice, or ``share()``) give one gradient, pushed as one update."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kubeps.runtime as kp
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.ops import nn
from kubeps.runtime.variables.push import apply_gradients

VOCAB, DIM = 12, 3


def reference(table: np.ndarray, ids: np.ndarray, weights: np.ndarray | None, combiner: str,
              dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pooled rows and the dense gradient of the table, one example and one id at a time (float64)."""
    out = np.zeros((len(ids), table.shape[1]))
    grad = np.zeros(table.shape)
    for b, row in enumerate(ids):
        real = [j for j, i in enumerate(row) if i != -1]
        w = [1.0 if weights is None else float(weights[b, j]) for j in real]
        denom = {"sum": 1.0, "mean": sum(w), "sqrtn": float(np.sqrt(sum(x * x for x in w)))}[combiner]
        for j, wj in zip(real, w):
            c = wj / denom if denom != 0 else 0.0
            out[b] += c * table[row[j]]
            grad[row[j]] += c * dy[b]
    return out, grad


def dense_of(grad: kp.IndexedSlices, shape: tuple[int, ...]) -> np.ndarray:
    dense = np.zeros(shape)
    np.add.at(dense, np.asarray(grad.indices), np.asarray(grad.values))
    return dense


def table() -> np.ndarray:
    return np.random.default_rng(0).uniform(-1, 1, (VOCAB, DIM)).astype(np.float32)


IDS = np.array([[3, 5, -1, -1],   # two ids and padding
                [-1, -1, -1, -1],  # all padding: zeros, no gradient
                [7, 7, 2, -1],     # a duplicate within the row
                [0, 11, 4, 9]])    # no padding


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_each_combiner_matches_the_reference_forward_and_backward(combiner: str, weighted: bool) -> None:
    t = table()
    rng = np.random.default_rng(1)
    weights = rng.uniform(0.1, 2.0, IDS.shape).astype(np.float32) if weighted else None
    dy = rng.normal(size=(len(IDS), DIM)).astype(np.float32)
    layer = nn.Embedding(VOCAB, DIM, embeddings=t.copy(), combiner=combiner)
    out = layer.forward(IDS, weights)
    want_out, want_grad = reference(t.astype(np.float64), IDS, weights, combiner, dy)
    assert out.shape == (len(IDS), DIM)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[1], 0)  # the all-padding row
    layer.backward(dy)
    (grad, var), = layer.grads_and_vars()
    assert var is layer.embeddings
    np.testing.assert_array_equal(grad.indices, np.unique(IDS[IDS >= 0]))  # real ids, each once: padding has none
    np.testing.assert_allclose(dense_of(grad, t.shape), want_grad, rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_batches_agree_with_the_reference(data: st.DataObject) -> None:
    batch, length = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 6))
    ids = np.array(data.draw(st.lists(st.lists(st.integers(-1, VOCAB - 1), min_size=length, max_size=length),
                                      min_size=batch, max_size=batch)), dtype=np.int64)
    combiner = data.draw(st.sampled_from(["sum", "mean", "sqrtn"]))
    weights = None
    if data.draw(st.booleans()):
        weights = np.array(data.draw(st.lists(st.lists(st.floats(0.0, 3.0, width=32), min_size=length,
                                                        max_size=length), min_size=batch, max_size=batch)),
                           dtype=np.float32)
    t = table()
    dy = np.random.default_rng(batch * 10 + length).normal(size=(batch, DIM)).astype(np.float32)
    layer = nn.Embedding(VOCAB, DIM, embeddings=t.copy(), combiner=combiner)
    want_out, want_grad = reference(t.astype(np.float64), ids, weights, combiner, dy)
    np.testing.assert_allclose(layer.forward(ids, weights), want_out, rtol=1e-4, atol=1e-5)
    layer.backward(dy)
    (grad, _), = layer.grads_and_vars()
    assert set(np.asarray(grad.indices).tolist()) == set(ids[ids >= 0].tolist())
    np.testing.assert_allclose(dense_of(grad, t.shape), want_grad, rtol=1e-4, atol=1e-5)


def test_without_a_combiner_nothing_changes() -> None:
    t = table()
    layer = nn.Embedding(VOCAB, DIM, embeddings=t)
    ids = np.array([[[1, 2]], [[2, 3]]])
    np.testing.assert_array_equal(layer.forward(ids), t[ids])
    layer.backward(np.ones(ids.shape + (DIM,), np.float32))
    (grad, _), = layer.grads_and_vars()
    np.testing.assert_array_equal(grad.indices, [1, 2, 3])
    np.testing.assert_array_equal(grad.values[1], 2 * np.ones(DIM))
    with pytest.raises(IndexError, match="id -1 is out of range; allowed: 0 <= id < 12"):
        layer.forward(np.array([[-1, 2]]))


def test_a_pooled_lookup_pulls_only_the_distinct_real_ids_of_the_batch() -> None:
    pulled: list[np.ndarray] = []

    class Counting(nn.Embedding):
        def _lookup(self, ids):
            pulled.append(np.asarray(ids))
            return super()._lookup(ids)

    layer = Counting(VOCAB, DIM, embeddings=kp.Variable(table()), combiner="mean")
    layer.forward(IDS)
    assert len(pulled) == 1
    np.testing.assert_array_equal(pulled[0], np.unique(IDS[IDS >= 0]))


def test_bad_arguments_are_refused_with_the_field_the_value_and_what_is_allowed() -> None:
    with pytest.raises(RuntimeConfigError, match=r"Embedding\.combiner.*'max'.*\['sum', 'mean', 'sqrtn'\]"):
        nn.Embedding(VOCAB, DIM, combiner="max")
    layer = nn.Embedding(VOCAB, DIM, embeddings=table(), combiner="sum")
    with pytest.raises(RuntimeConfigError, match=r"weights.*shape \[4, 3\].*shape of the ids \[4, 4\]"):
        layer.forward(IDS, np.ones((4, 3), np.float32))
    with pytest.raises(RuntimeConfigError, match=r"weights.*dtype int64.*floating"):
        layer.forward(IDS, np.ones((4, 4), np.int64))
    with pytest.raises(RuntimeConfigError, match=r"ids.*shape \[4\].*\(batch, L\)"):
        layer.forward(np.arange(4))
    with pytest.raises(IndexError, match=r"id -2 is out of range; allowed: 0 <= id < 12 or -1 \(padding\)"):
        layer.forward(np.array([[-2, 1]]))
    with pytest.raises(RuntimeConfigError, match="weights only with a combiner"):
        nn.Embedding(VOCAB, DIM, embeddings=table()).forward(np.array([1]), np.ones(1, np.float32))


def test_a_layer_called_on_two_features_adds_both_gradients() -> None:
    """Item id (one per example) and clicked-item history (pooled) from one table: one layer called twice per
    step; its backward passes, in reverse order, add up."""
    t = table()
    rng = np.random.default_rng(2)
    hist = IDS
    dy_a, dy_b = rng.normal(size=(4, DIM)).astype(np.float32), rng.normal(size=(4, DIM)).astype(np.float32)
    pooled = nn.Embedding(VOCAB, DIM, embeddings=t.copy(), combiner="sum")
    other_hist = np.array([[1, 3, 3, -1], [2, -1, -1, -1], [5, 6, 7, 8], [-1, -1, -1, -1]])
    for _ in range(2):  # a second step starts afresh
        pooled.forward(hist)
        pooled.forward(other_hist)
        pooled.backward(dy_b)  # reverse mode: the last call first
        pooled.backward(dy_a)
        (grad, _), = pooled.grads_and_vars()
        want = reference(t, hist, None, "sum", dy_a)[1] + reference(t, other_hist, None, "sum", dy_b)[1]
        np.testing.assert_allclose(dense_of(grad, t.shape), want, rtol=1e-5, atol=1e-6)
        assert len(np.unique(grad.indices)) == len(grad.indices)  # each row once
    with pytest.raises(RuntimeError, match="backward called before forward"):
        pooled.backward(dy_a)


def test_a_shared_table_takes_both_features_gradients_in_one_update() -> None:
    t = table()
    item = nn.Embedding(VOCAB, DIM, embeddings=kp.Variable(t.copy()))
    history = item.share(combiner="mean")
    assert history.embeddings is item.embeddings and history.combiner == "mean" and item.combiner is None
    ids = np.array([3, 0, 7, 9])
    rng = np.random.default_rng(3)
    dy_item, dy_hist = rng.normal(size=(4, DIM)).astype(np.float32), rng.normal(size=(4, DIM)).astype(np.float32)
    np.testing.assert_array_equal(item.forward(ids), t[ids])
    history.forward(IDS)
    item.backward(dy_item)
    history.backward(dy_hist)
    want = reference(t, IDS, None, "mean", dy_hist)[1]
    np.add.at(want, ids, dy_item)
    pairs = nn.all_grads_and_vars([item, history])
    assert len(pairs) == 2 and pairs[0][1] is pairs[1][1]
    # Adagrad tells one update from two: its accumulator adds the square of the summed gradient, not two squares
    summed = kp.Variable(t.copy())
    apply_gradients(kp.Adagrad(learning_rate=0.5), pairs)
    kp.Adagrad(learning_rate=0.5).apply_gradients([(want.astype(np.float32), summed)])
    np.testing.assert_allclose(item.embeddings.numpy(), summed.numpy(), rtol=1e-5, atol=1e-6)
    twice, opt = kp.Variable(t.copy()), kp.Adagrad(learning_rate=0.5)
    for grad, _ in pairs:
        opt.apply_gradients([(grad, twice)])
    assert not np.allclose(twice.numpy(), summed.numpy(), rtol=1e-5, atol=1e-6)


def test_the_jax_path_pools_and_pushes_a_shared_table_once() -> None:
    """``value_and_grad`` with a pooled entry (``lookup``) and a plain one on one table: forward and gradient as the
    reference, padding never in the gradient, and both entries' gradients applied as one update."""
    pytest.importorskip("jax")
    from kubeps.runtime.models.autodiff import lookup, value_and_grad

    t = table()
    var = kp.Variable(t.copy())
    rng = np.random.default_rng(4)
    weights = rng.uniform(0.2, 1.5, IDS.shape).astype(np.float32)
    a, b = rng.normal(size=(4, DIM)).astype(np.float32), rng.normal(size=(4, DIM)).astype(np.float32)
    item = np.array([1, 3, 3, 8])
    batch = {"item": item, "hist": IDS, "w": weights}

    def loss_fn(params, batch):  # linear: d loss / d pooled is a, d loss / d item rows is b
        return (params["hist"] * a).sum() + (params["item"] * b).sum()

    step = value_and_grad(loss_fn, tables={"hist": (var, lookup(lambda x: x["hist"], "sqrtn", lambda x: x["w"])),
                                           "item": (var, lambda x: x["item"])})
    loss, grads = step(batch)
    pooled, want_hist = reference(t.astype(np.float64), IDS, weights, "sqrtn", a)
    assert loss == pytest.approx(float((pooled * a).sum() + (t[item] * b).sum()), rel=1e-5)
    np.testing.assert_array_equal(grads["hist"].indices, np.unique(IDS[IDS >= 0]))
    np.testing.assert_allclose(dense_of(grads["hist"], t.shape), want_hist, rtol=1e-5, atol=1e-6)
    want = want_hist.copy()
    np.add.at(want, item, b)
    kp.SGD(learning_rate=1.0).apply_gradients(step.grads_and_vars(grads))
    np.testing.assert_allclose(var.numpy(), t - want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeConfigError, match=r"lookup\.combiner.*'max'"):
        lookup(lambda x: x["hist"], "max")


def test_a_pooled_embedding_trains_on_two_parameter_servers(make_cluster) -> None:
    """A sharded table on 2 real ps: a scheduled step of a pooled layer and a shared one pushes once per ps, and the
    table moves by exactly the reference gradient; padding's row is never touched."""
    from kubeps.runtime.variables.partitioners import FixedShardsPartitioner

    cluster = make_cluster(num_ps=2, num_workers=1)
    strategy = cluster.strategy(variable_partitioner=FixedShardsPartitioner(2))
    coordinator = kp.ClusterCoordinator(strategy)
    try:
        t = table()
        with strategy.scope():
            var = kp.Variable(t.copy(), name="multi_hot_table")
        assert isinstance(var, kp.ShardedVariable)
        item = nn.Embedding(VOCAB, DIM, embeddings=var, name="item")
        hist = item.share(combiner="mean", name="hist")
        rng = np.random.default_rng(5)
        ids = np.array([2, 3, 2, 10])
        dy_item, dy_hist = rng.normal(size=(4, DIM)).astype(np.float32), rng.normal(size=(4, DIM)).astype(np.float32)

        def step():  # runs on the worker
            from kubeps.runtime.variables.context import current_closure_context

            item.forward(ids)
            hist.forward(IDS)
            item.backward(dy_item)
            hist.backward(dy_hist)
            kp.SGD(learning_rate=1.0).apply_gradients(nn.all_grads_and_vars([item, hist]))
            held = current_closure_context()._deferred  # the push each ps gets with the next call
            return {ps: [u["name"] for u in (req if isinstance(req, dict) else req.model_dump())["updates"]]
                    for ps, (req, _) in held.items()}

        updates = coordinator.schedule(step).fetch()
        coordinator.join()
        assert sorted(updates) == [0, 1]  # one push per ps, carrying one update of its shard (not one per feature)
        assert all(len(names) == 1 for names in updates.values()), updates
        want = reference(t, IDS, None, "mean", dy_hist)[1]
        np.add.at(want, ids, dy_item)
        np.testing.assert_allclose(var.numpy(), t - want, rtol=1e-5, atol=1e-6)
        untouched = np.setdiff1d(np.arange(VOCAB), np.concatenate([ids, IDS[IDS >= 0]]))
        np.testing.assert_array_equal(var.numpy()[untouched], t[untouched])
    finally:
        coordinator.shutdown()
        strategy.close()
