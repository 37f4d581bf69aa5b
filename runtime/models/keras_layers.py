"""Keras 3 on kubeps: importing Keras with the JAX backend (:func:`import_keras`) and :class:`KubepsEmbedding`, a
Keras layer whose table is a kubeps ``Variable``/``ShardedVariable`` on the parameter servers.

``KubepsEmbedding(input_dim, output_dim)`` is used like ``keras.layers.Embedding``. Built inside
``strategy.scope()`` its table is created on the parameter servers (sharded by the scope's partitioner); built
outside a scope (the sidecar evaluator) it is a local variable. Called eagerly it looks up only the rows of its
ids (``embedding_lookup``: from their owners when remote). Inside :func:`kubeps.runtime.models.keras_fit.fit` a
training step never calls it eagerly: the step first runs the model in *ids* mode (every ``KubepsEmbedding``
records its ids and returns zeros; jitted, so XLA keeps only the ids' computation), fetches the batch's unique rows
in one round trip per parameter server, then runs the model in *rows* mode under ``jax.value_and_grad``, where the
layer gathers from those rows -- so the gradient of the table is a gradient of the unique rows, pushed as
``IndexedSlices``. The two modes are set by :func:`lookup_feed` around Keras's own ``stateless_call``.

Rule: importing this module imports keras (and sets ``KERAS_BACKEND=jax`` when unset); nothing of the runtime imports
it except the other ``keras*`` modules of this package.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

import numpy as np

from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.variables.variable import ShardedVariable, Variable, embedding_lookup

__all__ = ["KubepsEmbedding", "LookupFeed", "import_keras", "lookup_feed"]


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
    """What the ``KubepsEmbedding`` layers of one model call see: mode ``"ids"`` records each layer's ids (and the
    layer returns zeros); mode ``"rows"`` gives each layer ``(rows, inverse)`` to gather from; mode ``"build"``
    returns zeros (a replica is built by calling it once). Keyed by layer."""

    def __init__(self, mode: str, rows: dict[int, tuple[Any, Any]] | None = None):
        if mode not in ("ids", "rows", "build"):
            raise RuntimeConfigError("mode", mode, "allowed: 'ids', 'rows' or 'build'")
        self.mode = mode
        self.rows = rows or {}
        self.ids: dict[int, Any] = {}

    def lookup(self, layer: "KubepsEmbedding", ids: Any) -> Any:
        key = id(layer)
        if self.mode == "build":
            return keras.ops.zeros(tuple(ids.shape) + (layer.output_dim,), dtype=layer.compute_dtype)
        if self.mode == "ids":
            if key in self.ids:
                raise RuntimeConfigError(f"KubepsEmbedding {layer.name!r}", "called twice in one step",
                                         "a KubepsEmbedding layer is called once per step (concatenate its ids)")
            self.ids[key] = ids
            return keras.ops.zeros(tuple(ids.shape) + (layer.output_dim,), dtype=layer.compute_dtype)
        if key not in self.rows:
            raise RuntimeConfigError(f"KubepsEmbedding {layer.name!r}", "no rows were fetched for it",
                                     "the layer must be called in the ids pass of the same step")
        rows, inverse = self.rows[key]
        return keras.ops.take(rows, inverse, axis=0)


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


_Layer: Any = keras.layers.Layer  # a module attribute mypy cannot see through `keras = import_keras()`


@keras.saving.register_keras_serializable(package="kubeps")
class KubepsEmbedding(_Layer):
    """``KubepsEmbedding(input_dim, output_dim, embeddings_initializer="uniform")``: ``keras.layers.Embedding``
    with its table on the parameter servers; ``table`` is the kubeps ``Variable`` or ``ShardedVariable``."""

    def __init__(self, input_dim: int, output_dim: int, embeddings_initializer: Any = "uniform", **kwargs: Any):
        super().__init__(**kwargs)
        for field, value in (("input_dim", input_dim), ("output_dim", output_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise RuntimeConfigError(f"KubepsEmbedding {field}", value, "must be an integer >= 1")
        self.input_dim = int(input_dim)
        self.output_dim = int(output_dim)
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

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        return tuple(input_shape) + (self.output_dim,)

    def call(self, ids: Any) -> Any:
        feed = getattr(_state, "feed", None)
        if feed is not None:
            return feed.lookup(self, ids)
        if in_symbolic_scope():  # Keras traces a model's call for shapes only (to build it): no lookup
            return keras.ops.zeros(tuple(ids.shape) + (self.output_dim,), dtype=self.compute_dtype)
        try:
            ids_array = np.asarray(ids)
        except Exception as err:  # noqa: BLE001 - a jax tracer: say where lookups can run
            raise RuntimeConfigError(f"KubepsEmbedding {self.name!r} ids", type(ids).__name__,
                                     "a lookup outside kubeps fit needs concrete ids: call the model eagerly "
                                     f"(not under jax.jit) ({type(err).__name__})") from None
        rows = embedding_lookup(self.table, ids_array.astype(np.int64, copy=False))
        return keras.ops.convert_to_tensor(rows, dtype=self.compute_dtype)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(input_dim=self.input_dim, output_dim=self.output_dim,
                      embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer))
        return config
