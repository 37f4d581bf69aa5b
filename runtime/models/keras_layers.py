"""Keras 3 on kubeps: importing Keras with the JAX backend (:func:`import_keras`), :class:`KubepsEmbedding`, a
Keras layer whose table is a kubeps ``Variable``/``ShardedVariable`` on the parameter servers, and :class:`Hashing`,
integer ids into buckets with kubeps's hash.

``KubepsEmbedding(input_dim, output_dim)`` is used like ``keras.layers.Embedding``. Built inside
``strategy.scope()`` its table is created on the parameter servers (sharded by the scope's partitioner); built
outside a scope (the sidecar evaluator) it is a local variable. Called eagerly it looks up only the rows of its
ids (``embedding_lookup``: from their owners when remote); under ``jax.jit`` (Keras's ``model.predict`` and
``model.evaluate``) it looks them up the same way through a ``jax.pure_callback``. ``model.save()`` writes the whole
table (read from the parameter servers) and ``model.summary()`` counts it. Inside :func:`kubeps.runtime.models.keras_fit.fit` a
training step never calls it eagerly: the step first runs the model in *ids* mode (every ``KubepsEmbedding``
records its ids and returns zeros; jitted, so XLA keeps only the ids' computation), fetches the batch's unique rows
in one round trip per parameter server, then runs the model in *rows* mode under ``jax.value_and_grad``, where the
layer gathers from those rows -- so the gradient of the table is a gradient of the unique rows, pushed as
``IndexedSlices``. The two modes are set by :func:`lookup_feed` around Keras's own ``stateless_call``.

Rule: importing this module imports keras (and sets ``KERAS_BACKEND=jax`` when unset); nothing of the runtime imports
it except the other ``keras*`` modules of this package. It wraps ``keras.Model.fit`` to refuse, before it changes
anything, a model that holds a ``KubepsEmbedding`` (Keras's fit cannot update a table on the parameter servers);
other models fit as before.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any, Iterator

import numpy as np

from kubeps.runtime.checks import PositiveInt, check, integer
from kubeps.runtime.data.hashing import hash_bucket
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.ops import combiners
from kubeps.runtime.variables.variable import ShardedVariable, Variable, gather_padded_rows

__all__ = ["Hashing", "KubepsEmbedding", "LookupFeed", "import_keras", "lookup_feed"]


def import_keras() -> Any:
    """The ``keras`` module with the JAX backend: sets ``KERAS_BACKEND=jax`` when unset, refuses any other."""
    backend = os.environ.setdefault("KERAS_BACKEND", "jax")
    if backend != "jax":
        raise RuntimeConfigError("KERAS_BACKEND", backend,
                                 "kubeps trains Keras models with the JAX backend only: set KERAS_BACKEND=jax or "
                                 "leave it unset")
    import keras  # noqa: PLC0415 - keras is optional: loaded only by the keras* modules, after the backend is set

    if keras.config.backend() != "jax":
        raise RuntimeConfigError("keras.config.backend()", keras.config.backend(),
                                 "keras was imported with another backend before kubeps set KERAS_BACKEND=jax; "
                                 "set KERAS_BACKEND=jax before importing keras")
    return keras


keras = import_keras()

import jax  # noqa: E402 - after import_keras(), which sets the backend
from keras.src.backend import in_symbolic_scope  # noqa: E402 - Keras's own layers ask it; no public name yet

_state = threading.local()


class LookupFeed:
    """What the ``KubepsEmbedding`` layers of one model call see: mode ``"ids"`` records the ids of each call of each
    layer (and the layer returns zeros); mode ``"rows"`` gives each layer ``(rows, inverses)``, the unique rows of
    all its calls and one ``inverse`` per call to gather them with; mode ``"build"`` returns zeros (a replica is
    built by calling it once). Keyed by layer; a layer called twice in a step (a table two features read) has two
    calls, in call order."""

    def __init__(self, mode: str, rows: dict[int, tuple[Any, Any]] | None = None):
        if mode not in ("ids", "rows", "build"):
            raise RuntimeConfigError("mode", mode, "allowed: 'ids', 'rows' or 'build'")
        self.mode = mode
        self.rows = rows or {}
        self.ids: dict[int, list[Any]] = {}
        self._calls: dict[int, int] = {}

    def lookup(self, layer: "KubepsEmbedding", ids: Any, weights: Any = None) -> Any:
        key = id(layer)
        if self.mode != "rows":
            if self.mode == "ids":
                self.ids.setdefault(key, []).append(ids)
            return keras.ops.zeros(layer.compute_output_shape(tuple(ids.shape)), dtype=layer.compute_dtype)
        if key not in self.rows:
            raise RuntimeConfigError(f"KubepsEmbedding {layer.name!r}", "no rows were fetched for it",
                                     "the layer must be called in the ids pass of the same step")
        rows, inverses = self.rows[key]
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        return layer.pooled(keras.ops.take(rows, inverses[call], axis=0), ids, weights, jax.numpy)


@contextlib.contextmanager
def lookup_feed(feed: LookupFeed) -> Iterator[LookupFeed]:
    """Make ``feed`` what this thread's ``KubepsEmbedding`` calls use (while a model is traced)."""
    previous = getattr(_state, "feed", None)
    _state.feed = feed
    try:
        yield feed
    finally:
        _state.feed = previous


@contextlib.contextmanager
def replica_build() -> Iterator[None]:
    """While a worker builds its replica of a model, ``KubepsEmbedding`` creates no table (the rows come from the
    parameter servers through the feed)."""
    previous = getattr(_state, "replica", False)
    _state.replica = True
    try:
        yield
    finally:
        _state.replica = previous


def _padded_lookup(layer: "KubepsEmbedding", ids: Any) -> np.ndarray:
    """``table[ids]`` on the host, with zero rows at padding for a layer with a combiner (padding is never pulled)."""
    _, inverse, rows = gather_padded_rows(layer.table, np.asarray(ids).astype(np.int64, copy=False),
                                          padding=layer.combiner is not None)
    return np.asarray(np.take(rows, inverse, axis=0), dtype=layer.compute_dtype)


def _host_lookup(layer: "KubepsEmbedding", ids: Any) -> Any:
    """The rows of traced ``ids`` (Keras's ``predict``/``evaluate`` run the model under ``jax.jit``), looked up on
    the host by a ``jax.pure_callback``: the live rows of the parameter servers, or of the local table. Forward
    only: the rows are constants to a gradient, so :meth:`KubepsEmbedding.call` refuses ``training=True`` here."""
    out = jax.ShapeDtypeStruct(tuple(ids.shape) + (layer.output_dim,), layer.compute_dtype)
    return jax.pure_callback(lambda concrete: _padded_lookup(layer, concrete), out, ids, vmap_method="sequential")


_Layer: Any = keras.layers.Layer  # a module attribute mypy cannot see through `keras = import_keras()`
_KERAS_FIT_REFUSED = ("Keras's own fit cannot update a table on the parameter servers: train with "
                      "kubeps.runtime.models.keras_fit.fit(model, coordinator, dataset_fn, ...); model.predict and "
                      "model.evaluate work")


@keras.saving.register_keras_serializable(package="kubeps")
class KubepsEmbedding(_Layer):
    """``KubepsEmbedding(input_dim, output_dim, embeddings_initializer="uniform", combiner=None)``:
    ``keras.layers.Embedding`` with its table on the parameter servers; ``table`` is the kubeps ``Variable`` or
    ``ShardedVariable``.

    With ``combiner`` (``"sum"``, ``"mean"``, ``"sqrtn"``: :mod:`kubeps.runtime.ops.combiners`) the layer takes ids of
    shape ``(batch, L)`` padded with -1 and, optionally, ``weights`` of that shape (``layer(ids, weights=w)``), and
    returns ``(batch, output_dim)``. Called on two inputs (``emb(item)`` and ``emb(history)``), the layer is one
    table two features read: one pull of the rows of both, one gradient of the table."""

    def __init__(self, input_dim: int, output_dim: int, embeddings_initializer: Any = "uniform",
                 combiner: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.input_dim = check("input_dim", input_dim, PositiveInt, owner="KubepsEmbedding")
        self.output_dim = check("output_dim", output_dim, PositiveInt, owner="KubepsEmbedding")
        self.combiner = combiners.check_combiner(combiner, owner="KubepsEmbedding")
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self._table: Variable | ShardedVariable | None = None

    def build(self, input_shape: Any = None) -> None:
        if self._table is None and not getattr(_state, "replica", False):
            shape, dtype = (self.input_dim, self.output_dim), self.variable_dtype
            # Keras may build a layer while tracing its model's call (jax.jit): the initial value is computed
            # concretely all the same, and the table created once
            with jax.ensure_compile_time_eval():
                initial = np.asarray(self.embeddings_initializer(shape, dtype))
            # a kubeps Variable: on the parameter servers inside strategy.scope(), local outside
            self._table = Variable(initial, name=f"{self.path}/embeddings", dtype=dtype)
        self.built = True

    @property
    def table(self) -> Variable | ShardedVariable:
        """The kubeps variable holding the table (created when the layer is built)."""
        if self._table is None:
            raise RuntimeConfigError(f"KubepsEmbedding {self.name!r}", "no table",
                                     "build the model (call it on a batch) before using its table; a worker's "
                                     "replica has none: its rows come from the parameter servers")
        return self._table

    def compute_output_shape(self, ids_shape: Any, weights_shape: Any = None) -> tuple[Any, ...]:
        if self.combiner is not None:
            return (tuple(ids_shape)[0], self.output_dim)
        return tuple(ids_shape) + (self.output_dim,)

    def pooled(self, rows: Any, ids: Any, weights: Any, xp: Any) -> Any:
        """``rows`` (``ids.shape + (output_dim,)``, zeros at padding) pooled by the combiner; as they are without."""
        if self.combiner is None:
            return rows
        return combiners.pool(rows, combiners.coefficients(xp, ids, weights, self.combiner, self.compute_dtype))

    def _check_inputs(self, ids: Any, weights: Any) -> None:
        owner = f"KubepsEmbedding {self.name!r}"
        if self.combiner is not None:
            combiners.check_multi_hot(tuple(ids.shape), ids.dtype, weights, owner=owner)
        elif weights is not None:
            raise RuntimeConfigError(f"{owner} weights", "given",
                                     "weights only with a combiner (KubepsEmbedding(..., combiner='sum'))")

    def call(self, ids: Any, weights: Any = None, training: Any = None) -> Any:
        ids = ids if hasattr(ids, "shape") else np.asarray(ids)
        self._check_inputs(ids, weights)
        feed = getattr(_state, "feed", None)
        if feed is not None:
            return feed.lookup(self, ids, weights)
        if in_symbolic_scope():  # Keras traces a model's call for shapes only (to build it): no lookup
            return keras.ops.zeros(self.compute_output_shape(tuple(ids.shape)), dtype=self.compute_dtype)
        if isinstance(ids, jax.core.Tracer):  # model.predict / model.evaluate jit the call: look up from the host
            if training:  # a training step of Keras's (a custom loop): the table would silently stay as it is
                raise RuntimeConfigError(f"KubepsEmbedding {self.name!r}", "trained by Keras's model.fit",
                                         _KERAS_FIT_REFUSED)
            return self.pooled(_host_lookup(self, ids), ids, weights, jax.numpy)
        rows = self.pooled(_padded_lookup(self, ids), np.asarray(ids), None if weights is None else np.asarray(weights),
                           np)
        return keras.ops.convert_to_tensor(rows, dtype=self.compute_dtype)

    def count_params(self) -> int:
        """The table's size (``model.summary()`` counts it, though its rows live on the parameter servers)."""
        return self.input_dim * self.output_dim

    def save_own_variables(self, store: Any) -> None:
        """``model.save()`` writes the whole table, read from its owners (the trained rows on the parameter
        servers): a ``.keras`` file that loads back with kubeps installed. A table too big for one process is
        exported with ``kubeps export`` instead."""
        store["0"] = np.asarray(self.table.numpy())

    def load_own_variables(self, store: Any) -> None:
        """``keras.saving.load_model`` puts the saved table into this layer's table (local, or on the parameter
        servers when loaded inside ``strategy.scope()``)."""
        if "0" not in store:
            raise RuntimeConfigError(f"KubepsEmbedding {self.name!r} saved variables", sorted(store.keys()),
                                     "the file has no table for this layer (saved by a kubeps before model.save "
                                     "wrote tables?): export the checkpoint with kubeps export")
        value = np.asarray(store["0"])
        if value.shape != (self.input_dim, self.output_dim):
            raise RuntimeConfigError(f"KubepsEmbedding {self.name!r} saved table shape", value.shape,
                                     f"must be ({self.input_dim}, {self.output_dim})")
        self.table.assign(value)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(input_dim=self.input_dim, output_dim=self.output_dim, combiner=self.combiner,
                      embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer))
        return config


@keras.saving.register_keras_serializable(package="kubeps")
class Hashing(_Layer):
    """``Hashing(num_bins, mask_value=None, salt=0)``: Keras's ``Hashing`` layer for integer ids, with kubeps's
    hash (:func:`~kubeps.runtime.data.hashing.hash_bucket`: the buckets the input pipeline's ``hash_bucket`` gives
    the same ids). It runs where the model runs (a worker's step, ``predict``, ``evaluate``), on the host: under
    ``jax.jit`` through a ``jax.pure_callback``. Its output is int32 (JAX's integers without x64), and so is what
    JAX hands it: an id above 2**31 - 1 (Criteo's 32-bit categoricals) is hashed in the input pipeline instead.
    Strings too: JAX has no string tensors."""

    def __init__(self, num_bins: int, mask_value: int | None = None, salt: int = 0, **kwargs: Any):
        super().__init__(**kwargs)
        self.num_bins = check("num_bins", num_bins, integer(ge=1, le=2**31 - 1), owner="Hashing")
        self.mask_value = mask_value
        self.salt = salt
        hash_bucket(np.zeros(1, np.int64), num_bins, salt, mask_value)  # the salt and mask_value, checked now
        self.built = True

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        return tuple(input_shape)

    def _buckets(self, ids: Any) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise RuntimeConfigError(f"Hashing {self.name!r} input dtype", str(ids.dtype),
                                     "integer ids (hash strings in the input pipeline with kp.hash_bucket)")
        return hash_bucket(ids.astype(np.int64), self.num_bins, self.salt, self.mask_value).astype(np.int32)

    def call(self, ids: Any) -> Any:
        if in_symbolic_scope():
            return keras.ops.zeros(tuple(ids.shape), dtype="int32")
        if isinstance(ids, jax.core.Tracer):
            return jax.pure_callback(self._buckets, jax.ShapeDtypeStruct(tuple(ids.shape), np.int32), ids,
                                     vmap_method="sequential")
        return keras.ops.convert_to_tensor(self._buckets(ids), dtype="int32")

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(num_bins=self.num_bins, mask_value=self.mask_value, salt=self.salt)
        return config


def _refusing_tables(fit: Any) -> Any:
    """``keras.Model.fit``, refusing a model with a ``KubepsEmbedding`` before it changes anything: Keras's fit takes
    the weights out of the model's variables for its steps and puts them back only after a step succeeded, so a
    refusal from inside the first step would leave the model without weights (``model.save`` then fails)."""

    @functools.wraps(fit)
    def guarded(model: Any, *args: Any, **kwargs: Any) -> Any:
        tables = [layer.name for layer in model._flatten_layers(include_self=False)
                  if isinstance(layer, KubepsEmbedding)]
        if tables:
            raise RuntimeConfigError(f"model {model.name!r} with KubepsEmbedding {tables}", "Keras's model.fit",
                                     _KERAS_FIT_REFUSED)
        return fit(model, *args, **kwargs)

    guarded.kubeps_refuses_tables = True  # type: ignore[attr-defined]  # a mark on the function: wrapped once
    return guarded


if not getattr(keras.Model.fit, "kubeps_refuses_tables", False):  # once, however often this module is reloaded
    keras.Model.fit = _refusing_tables(keras.Model.fit)
