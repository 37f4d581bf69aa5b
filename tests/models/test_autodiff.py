"""Gradients from JAX (``kubeps.runtime.models.autodiff``) against the numpy ``nn`` layers' hand-written backward on
the same model, the pulls and pushes they make, and the errors that name what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import kubeps.runtime as kp  # noqa: E402
from kubeps.runtime.ops import nn  # noqa: E402
from kubeps.runtime.errors import RuntimeConfigError  # noqa: E402

FIELDS, DIM, DENSE, VOCAB = 3, 4, 2, 50


def ctr_numpy_model(seed: int = 0) -> tuple[nn.Embedding, nn.MLP]:
    """The CTR example's model (embedding rows of every field, flattened, next to dense features, into an MLP)."""
    emb = nn.Embedding(VOCAB, DIM, seed=seed, name="emb")
    head = nn.MLP([5], 1, input_dim=FIELDS * DIM + DENSE, seed=seed + 1, name="head")
    return emb, head


def ctr_loss(params: dict, batch: dict):
    """The same model with jax.numpy: what a user writes."""
    ids_rows = params["emb"]  # [B, FIELDS, DIM]: only the batch's rows
    x = jnp.concatenate([ids_rows.reshape(ids_rows.shape[0], -1), batch["dense"]], axis=1)
    h = jax.nn.relu(x @ params["w0"] + params["b0"])
    logits = (h @ params["w1"] + params["b1"])[:, 0]
    labels = batch["labels"]
    per = jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits)))
    return per.mean()


def batch_of(rng: np.random.Generator, n: int = 16) -> dict:
    ids = rng.integers(0, 10, size=(n, FIELDS))  # few distinct ids: many duplicates
    return {"ids": ids, "dense": rng.normal(size=(n, DENSE)).astype(np.float32),
            "labels": (ids[:, 0] % 3 == 0).astype(np.float32)}  # learnable from the first field's rows


def step_for(emb: nn.Embedding, head: nn.MLP) -> kp.ValueAndGrad:
    d0, d1 = head.layers
    return kp.value_and_grad(ctr_loss, dense={"w0": d0.kernel, "b0": d0.bias, "w1": d1.kernel, "b1": d1.bias},
                             tables={"emb": (emb.embeddings, lambda batch: batch["ids"])})


def numpy_grads(emb: nn.Embedding, head: nn.MLP, batch: dict) -> tuple[float, list]:
    loss = nn.SigmoidCrossEntropy()
    rows = emb.forward(batch["ids"])
    value = loss.forward(head.forward(np.concatenate([rows.reshape(len(rows), -1), batch["dense"]], 1))[:, 0],
                         batch["labels"])
    dx = head.backward(loss.backward()[:, None])
    emb.backward(dx[:, :-DENSE].reshape(len(rows), FIELDS, DIM))
    return value, nn.all_grads_and_vars([emb, head])


def assert_same_gradients(jax_pairs: list, numpy_pairs: list) -> None:
    by_var = {id(v): g for g, v in numpy_pairs}
    assert len(jax_pairs) == len(numpy_pairs)
    for g, v in jax_pairs:
        want = by_var[id(v)]
        if isinstance(want, kp.IndexedSlices):
            assert isinstance(g, kp.IndexedSlices)
            order_g, order_w = np.argsort(g.indices), np.argsort(want.indices)
            np.testing.assert_array_equal(g.indices[order_g], want.indices[order_w])
            np.testing.assert_allclose(g.values[order_g], want.values[order_w], rtol=1e-4, atol=1e-6, err_msg=v.name)
        else:
            np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6, err_msg=v.name)


def test_jax_gradients_equal_the_numpy_layers_on_the_ctr_model():
    rng = np.random.default_rng(0)
    emb, head = ctr_numpy_model()
    step = step_for(emb, head)
    for _ in range(3):  # the compiled function is reused across batches of one shape
        batch = batch_of(rng)
        loss, grads = step(batch)
        want_loss, want_pairs = numpy_grads(emb, head, batch)
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert set(grads) == {"w0", "b0", "w1", "b1", "emb"}
        assert grads["emb"].dense_shape == (VOCAB, DIM)
        assert len(grads["emb"].indices) == len(np.unique(batch["ids"]))  # only the batch's unique rows
        assert_same_gradients(step.grads_and_vars(grads), want_pairs)


def test_training_with_local_variables_follows_the_numpy_layers():
    """30 Adagrad steps from the same initial weights: the JAX path and the numpy layers end at the same loss."""
    rng = np.random.default_rng(1)
    batches = [batch_of(rng, 64) for _ in range(5)]
    emb, head = ctr_numpy_model()
    step, opt = step_for(emb, head), kp.Adagrad(learning_rate=0.1)
    np_emb, np_head = ctr_numpy_model()
    np_opt = kp.Adagrad(learning_rate=0.1)
    first, _ = step(batches[0])
    for i in range(30):
        _, grads = step(batches[i % 5])
        opt.apply_gradients(step.grads_and_vars(grads))
        np_opt.apply_gradients(numpy_grads(np_emb, np_head, batches[i % 5])[1])
    last = step(batches[0])[0]
    assert last < first - 0.02
    assert last == pytest.approx(numpy_grads(np_emb, np_head, batches[0])[0], rel=1e-4)


def test_errors_name_the_field_the_value_and_what_is_allowed():
    emb, head = ctr_numpy_model()
    d0, d1 = head.layers
    with pytest.raises(RuntimeConfigError, match=r"dense\['n'\].*int64.*floating dtype"):
        kp.value_and_grad(ctr_loss, dense={"n": kp.Variable(np.zeros(2, np.int64), name="n")})
    with pytest.raises(RuntimeConfigError, match=r"dense\['w'\].*ndarray.*Variable or ShardedVariable"):
        kp.value_and_grad(ctr_loss, dense={"w": np.zeros(2)})
    with pytest.raises(RuntimeConfigError, match=r"tables\['emb'\].*pair \(table, ids_fn\)"):
        kp.value_and_grad(ctr_loss, tables={"emb": emb.embeddings})
    with pytest.raises(RuntimeConfigError, match=r"tables\['w0'\].*must not repeat a name of dense"):
        kp.value_and_grad(ctr_loss, dense={"w0": d0.kernel}, tables={"w0": (emb.embeddings, lambda b: b["ids"])})
    with pytest.raises(RuntimeConfigError, match="at least one variable"):
        kp.value_and_grad(ctr_loss)
    step = step_for(emb, head)
    batch = batch_of(np.random.default_rng(2))
    batch["ids"][0, 0] = VOCAB
    with pytest.raises(RuntimeConfigError, match=rf"tables\['emb'\] ids' has invalid value {VOCAB}.*\[0, {VOCAB}\)"):
        step(batch)
    batch["ids"] = batch["ids"].astype(np.float32)
    with pytest.raises(RuntimeConfigError, match=r"tables\['emb'\] ids.*float32.*must be integers"):
        step(batch)
    unused = kp.Variable(np.zeros(3, np.float32), name="unused")
    step = kp.value_and_grad(ctr_loss, dense={"w0": d0.kernel, "b0": d0.bias, "w1": d1.kernel, "b1": d1.bias,
                                              "extra": unused},
                             tables={"emb": (emb.embeddings, lambda batch: batch["ids"])})
    with pytest.raises(RuntimeConfigError, match=r"dense\['extra'\].*does not read.*remove it"):
        step(batch_of(np.random.default_rng(2)))
    vector = kp.value_and_grad(lambda p, b: p["w"] * 2, dense={"w": kp.Variable(np.ones(3, np.float32))})
    with pytest.raises(RuntimeConfigError, match=r"loss_fn.*shape \[3\].*floating scalar"):
        vector({})
    with pytest.raises(RuntimeConfigError, match=r"'grads' has invalid value \['v', 'w'\]: must have the keys of the parameters"):
        vector.grads_and_vars({"w": 1, "v": 2})


def test_importing_the_runtime_and_the_models_package_loads_no_jax():
    import subprocess
    import sys

    code = ("import sys, kubeps.runtime as kp, kubeps.runtime.models.autodiff; kp.value_and_grad; "
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
