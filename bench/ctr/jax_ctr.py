"""The JAX side of ``bench/ctr_vs_tf.py --jax``: the same workload and chief as ``kubeps_ctr.py`` (whose numpy ``nn``
model is this one's baseline, measured in the same run), with the model written as a ``jax.numpy`` loss and its
gradients from ``kp.value_and_grad`` (jitted ``jax.value_and_grad``; only the batch's rows travel).

    kubeps local --ps 2 --workers 2 bench/ctr/jax_ctr.py -- --data DIR --steps 3000
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kubeps_ctr  # noqa: E402 - next to this file: the chief and the dataset

import kubeps.runtime as kp  # noqa: E402


def loss_fn(params: dict, batch) -> jax.Array:
    _, dense, labels = batch
    rows = params["embedding"]
    x = jnp.concatenate([rows.reshape(rows.shape[0], -1), dense], axis=1)
    layers = sum(1 for name in params if name.startswith("w"))  # the head's depth (``--head``)
    for i in range(layers):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            x = jax.nn.relu(x)
    logits = x[:, 0]
    return jnp.mean(jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits))))


def ids_of(batch):
    return batch[0]


class JaxModel:
    side = "jax"

    def __init__(self, init: dict[str, np.ndarray]):
        self.table = kp.Variable(np.asarray(init["embedding"]), name="embedding")
        self.dense = {f"{k}{i}": kp.Variable(np.asarray(init[f"{k}{i}"]), name=f"dense_{i}/{k}")
                      for i in range(sum(1 for n in init if n.startswith("w"))) for k in ("w", "b")}
        self.step = kp.value_and_grad(loss_fn, dense=self.dense, tables={"embedding": (self.table, ids_of)})

    def train_step(self, ids, dense, labels, optimizer, next_ids=None) -> float:  # noqa: ARG002 - no --overlap
        loss, grads = self.step((ids, dense, labels))
        optimizer.apply_gradients(self.step.grads_and_vars(grads))
        return loss

    def weights(self) -> dict[str, np.ndarray]:
        return {"embedding": self.table.numpy(), **{k: v.numpy() for k, v in self.dense.items()}}


if __name__ == "__main__":
    sys.exit(kubeps_ctr.main(JaxModel))
