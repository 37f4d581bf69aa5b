"""The CTR example's model written with ``jax.numpy``: kubeps computes its gradients with JAX on the workers.

    kubeps local --ps 2 --workers 2 examples/ctr/train_jax.py

Everything but the model is ``examples/ctr/train.py`` (the data with its teacher, the chief's loop, checkpoints,
the evaluator, the printed eval log-loss): the two programs train the same model on the same data with the same
initial weights, one with the numpy layers' hand-written backward, this one with ``kp.value_and_grad``::

    step = kp.value_and_grad(loss_fn, dense={"w0": ..., "b0": ..., ...}, tables={"rows": (table, ids_of)})
    loss, grads = step(batch)                           # rows of the batch's ids only; jax.value_and_grad, jitted
    optimizer.apply_gradients(step.grads_and_vars(grads))   # dense and IndexedSlices, one Push per ps

The loss below is all the model code there is: no backward pass. Needs ``pip install 'kubeps[jax]'``.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import kubeps.runtime as kp
from kubeps.runtime import nn
from kubeps.runtime.models.export import ServingFunction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train as ctr  # noqa: E402 - the numpy example beside this file: data, metrics, the chief and the evaluator


def logits_of(params: dict, rows, dense):
    """``head(concat(flatten(rows), dense))``: ReLU layers ``w0, b0, ...``, the last one linear, one logit each."""
    x = jnp.concatenate([rows.reshape(rows.shape[0], -1), dense], axis=1)
    layers = len([k for k in params if k.startswith("w")])
    for i in range(layers):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            x = jax.nn.relu(x)
    return x[:, 0]


def loss_fn(params: dict, batch) -> jax.Array:
    """Mean sigmoid cross-entropy of a batch ``(ids, dense, labels)``; ``params["rows"]`` are its ids' rows."""
    _, dense, labels = batch
    logits = logits_of(params, params["rows"], dense)
    return jnp.mean(jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits))))


def ids_of(batch):
    return batch[0]


class JaxCTRModel:
    """The numpy example's model (same variable names and initial values), trained through ``kp.value_and_grad``."""

    def __init__(self, vocab_size: int, embedding_dim: int, hidden: list[int], seed: int = 0):
        # nn's seeded initializers, as nn.Embedding and nn.MLP use them: both examples start from the same weights
        init = nn.random_uniform(seed=seed)((vocab_size, embedding_dim), np.float32)
        self.table = kp.Variable(init, name="embedding/embeddings")
        sizes = [ctr.FIELDS * embedding_dim + ctr.DENSE, *hidden, 1]
        self.dense: dict[str, kp.Variable] = {}
        for i, (fan_in, units) in enumerate(zip(sizes[:-1], sizes[1:])):
            kernel = nn.glorot_uniform(seed=seed + 1 + 2 * i)((fan_in, units), np.float32)
            self.dense[f"w{i}"] = kp.Variable(kernel, name=f"head/dense_{i}/kernel")
            self.dense[f"b{i}"] = kp.Variable(np.zeros(units, np.float32), name=f"head/dense_{i}/bias")
        self.step = kp.value_and_grad(loss_fn, dense=self.dense, tables={"rows": (self.table, ids_of)})
        self._predict = None

    @property
    def variables(self) -> list:
        """Every weight (what ``Checkpoint(model=model)`` saves; the names are the numpy model's)."""
        return [self.table, *self.dense.values()]

    def train_step(self, ids, dense, labels, optimizer) -> float:
        loss, grads = self.step((ids, dense, labels))
        optimizer.apply_gradients(self.step.grads_and_vars(grads))
        return loss

    def predict(self, ids, dense, batch_size: int = 8192) -> np.ndarray:
        """Click probabilities (on the chief: rows and weights read from the parameter servers)."""
        params = {name: var.read_value() for name, var in self.dense.items()}
        if self._predict is None:
            self._predict = jax.jit(lambda p, rows, d: jax.nn.sigmoid(logits_of(p, rows, d)))
        out = [np.asarray(self._predict(params, kp.embedding_lookup(self.table, ids[i: i + batch_size]),
                                        dense[i: i + batch_size]))
               for i in range(0, len(ids), batch_size)]
        return np.concatenate(out)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_predict": None}  # a scheduled function carries the variables, not the jit


def build_model(args) -> JaxCTRModel:
    return JaxCTRModel(args.vocab_size, args.embedding_dim, args.hidden, seed=args.seed)


def predict(params: dict, ids, dense) -> jax.Array:
    """Serving: click probabilities of ``ids [B, FIELDS]`` (int32) and ``dense [B, DENSE]``; ``params["table"]`` is
    the whole embedding table, gathered here (training gathers the batch's rows before the loss)."""
    head = {name: value for name, value in params.items() if name != "table"}
    return jax.nn.sigmoid(logits_of(head, jnp.take(params["table"], ids, axis=0), dense))


def serving_function(argv: list[str] | None = None):
    """For ``kubeps export``: :func:`predict` with the checkpoint variable of each parameter (the names of
    ``JaxCTRModel``, which are the numpy model's too: a checkpoint of either example exports the same way)."""
    args = ctr.parse_args(argv)
    params = {"table": "model/embedding/embeddings"}  # Checkpoint(model=model) prefixes the names with "model/"
    for i in range(len(args.hidden) + 1):
        params[f"w{i}"], params[f"b{i}"] = f"model/head/dense_{i}/kernel", f"model/head/dense_{i}/bias"
    return ServingFunction(predict, params, inputs=[("ids", (None, ctr.FIELDS), "int32"),
                                                     ("dense", (None, ctr.DENSE), "float32")])


if __name__ == "__main__":
    sys.exit(ctr.main(build=build_model))
