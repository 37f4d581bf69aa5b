"""JAX gradients on a real cluster: a sharded table and sharded dense weights on 2 ps, one RPC per ps a step,
gradients equal to the numpy layers', and XLA's thread pool sized to the worker's CPU budget."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import kubeps.runtime as kp  # noqa: E402
from kubeps.runtime.ops import nn  # noqa: E402
from kubeps.runtime.variables.partitioners import FixedShardsPartitioner  # noqa: E402

pytestmark = pytest.mark.timeout(180)

VOCAB, DIM, FIELDS, DENSE, HIDDEN = 40, 4, 3, 2, 5


def initial_values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"emb": rng.uniform(-0.5, 0.5, (VOCAB, DIM)).astype(np.float32),
            "w0": rng.normal(0, 0.5, (FIELDS * DIM + DENSE, HIDDEN)).astype(np.float32),
            "b0": rng.normal(0, 0.1, (HIDDEN,)).astype(np.float32),
            "w1": rng.normal(0, 0.5, (HIDDEN, 1)).astype(np.float32),
            "b1": np.zeros(1, np.float32)}


def batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(8)
    return [{"ids": rng.integers(0, VOCAB, (8, FIELDS)), "dense": rng.normal(size=(8, DENSE)).astype(np.float32),
             "labels": (rng.random(8) < 0.5).astype(np.float32)} for _ in range(n)]


def numpy_gradients(values: dict[str, np.ndarray], batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same model's gradients from the numpy ``nn`` layers (local variables), as dense arrays."""
    emb = nn.Embedding(VOCAB, DIM, embeddings=kp.Variable(values["emb"]))
    d0, d1 = nn.Dense(HIDDEN, activation="relu"), nn.Dense(1)
    d0.kernel, d0.bias, d1.kernel, d1.bias = (kp.Variable(values[k]) for k in ("w0", "b0", "w1", "b1"))
    loss = nn.SigmoidCrossEntropy()
    rows = emb.forward(batch["ids"])
    x = nn.Concatenate().forward([rows.reshape(len(rows), -1), batch["dense"]])
    loss.forward(d1.forward(d0.forward(x))[:, 0], batch["labels"])
    dx = d0.backward(d1.backward(loss.backward()[:, None]))
    emb.backward(dx[:, :-DENSE].reshape(rows.shape))
    out = {}
    for name, layer in (("emb", emb), ("w0", d0), ("w1", d1)):
        for g, v in layer.grads_and_vars():
            key = name if v is layer.trainable_variables[0] else "b" + name[1]
            if isinstance(g, kp.IndexedSlices):
                dense = np.zeros(values["emb"].shape)
                np.add.at(dense, g.indices, g.values)
                g = dense
            out[key] = g
    return out


def test_a_jax_step_on_sharded_variables_makes_one_rpc_per_ps_and_matches_numpy(make_cluster):
    cluster = make_cluster(num_ps=2, num_workers=1, extra_env={"KUBEPS_CPUS": "1"})
    strategy = cluster.strategy(variable_partitioner=FixedShardsPartitioner(2))
    coordinator = kp.ClusterCoordinator(strategy)
    try:
        values = initial_values()
        with strategy.scope():
            variables = {name: kp.Variable(value, name=f"jax_{name}") for name, value in values.items()}
        assert isinstance(variables["emb"], kp.ShardedVariable) and isinstance(variables["w0"], kp.ShardedVariable)
        jnp = jax.numpy

        def loss_fn(params, batch):
            rows = params["emb"]
            x = jnp.concatenate([rows.reshape(rows.shape[0], -1), batch["dense"]], axis=1)
            logits = (jax.nn.relu(x @ params["w0"] + params["b0"]) @ params["w1"] + params["b1"])[:, 0]
            z = batch["labels"]
            return (jnp.maximum(logits, 0) - logits * z + jnp.log1p(jnp.exp(-jnp.abs(logits)))).mean()

        step = kp.value_and_grad(loss_fn, dense={k: variables[k] for k in ("w0", "b0", "w1", "b1")},
                                 tables={"emb": (variables["emb"], lambda batch: batch["ids"])})
        opt = kp.SGD(learning_rate=0.5)
        data = batches(3)

        def train(data):  # runs on the worker
            from kubeps.runtime.models.xla import xla_pool_threads
            from kubeps.runtime.variables.context import current_closure_context

            ctx = current_closure_context()
            calls, first = [], None
            for batch in data:
                before = dict(ctx.transport.calls)
                loss, grads = step(batch)
                if first is None:
                    first = {k: (g.indices, g.values) if isinstance(g, kp.IndexedSlices) else g
                             for k, g in grads.items()}
                opt.apply_gradients(step.grads_and_vars(grads))
                calls.append({ps: ctx.transport.calls[ps] - before.get(ps, 0) for ps in (0, 1)})
            return calls, first, xla_pool_threads()

        calls, first, pool = coordinator.schedule(train, args=(data,)).fetch()
        assert calls == [{0: 1, 1: 1}] * 3  # lookup + dense pull + the previous push: one call per ps a step
        assert pool == 1  # KUBEPS_CPUS=1 on a machine with more CPUs: XLA's pool has one thread

        want = numpy_gradients(values, data[0])
        indices, rows = first["emb"]
        np.testing.assert_array_equal(np.sort(indices), np.unique(data[0]["ids"]))
        got_emb = np.zeros(values["emb"].shape)
        got_emb[indices] = rows
        np.testing.assert_allclose(got_emb, want["emb"], rtol=1e-4, atol=1e-6)
        for name in ("w0", "b0", "w1", "b1"):
            np.testing.assert_allclose(first[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)

        # the three pushes reached the ps: the first one moved every touched row by -lr * gradient
        untouched = np.setdiff1d(np.arange(VOCAB), np.concatenate([b["ids"].ravel() for b in data]))
        np.testing.assert_array_equal(variables["emb"].numpy()[untouched], values["emb"][untouched])
        assert not np.allclose(variables["w0"].numpy(), values["w0"])
    finally:
        coordinator.shutdown()
        strategy.close()
