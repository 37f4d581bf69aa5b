"""Layers with explicit forward and backward passes, for training on parameter servers without autodiff.

Each layer's ``forward(x)`` caches what its ``backward(dy)`` needs; ``backward`` returns ``dx`` and records the
gradients of the layer's variables, which ``grads_and_vars()`` hands out ready for
``optimizer.apply_gradients``. Dense gradients are arrays; an :class:`Embedding` produces a row-sparse
``IndexedSlices(values, indices)`` over only the rows the batch used (duplicates already summed).

Variables are ``kubeps.runtime.variables.variable.Variable`` objects created when the layer is built: inside
``strategy.scope()`` they live on the parameter servers (an embedding table may be a ``ShardedVariable``), outside
they are local numpy arrays in this process -- the same model code runs in-process or distributed. Build the
model on the coordinator (``build(input_dim)``, or give ``input_dim`` to the layer) so the variables exist before
a scheduled function carries the model to a worker. An ``Embedding`` may also be given a plain numpy table (gathered
locally) or an existing ``Variable``/``ShardedVariable`` (rows pulled with ``embedding_lookup``).

Loss objects (:class:`SigmoidCrossEntropy`, :class:`SoftmaxCrossEntropy`) return the mean loss from ``forward`` and
``d loss / d logits`` from ``backward()``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Literal, Sequence

import numpy as np

from kubeps.runtime.checks import NonNegativeInt, PositiveInt, check, integer, number
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.ops import combiners, kernels
from kubeps.runtime.ops.losses import Loss, SigmoidCrossEntropy, SoftmaxCrossEntropy  # noqa: F401 - nn's losses
from kubeps.runtime.variables.indexed_slices import IndexedSlices

__all__ = [
    "Layer",
    "Dense",
    "Embedding",
    "DynamicEmbeddingLayer",
    "Flatten",
    "Concatenate",
    "Add",
    "Sequential",
    "MLP",
    "Loss",
    "SigmoidCrossEntropy",
    "SoftmaxCrossEntropy",
    "glorot_uniform",
    "random_uniform",
    "zeros",
    "get_initializer",
]

# --------------------------------------------------------------------------------------------------------------
# Initializers: callables (shape, dtype) -> numpy array
# --------------------------------------------------------------------------------------------------------------


class glorot_uniform:
    """Glorot/Xavier uniform: ``U(-l, l)``, ``l = sqrt(6 / (fan_in + fan_out))`` (fans of the first two axes).

    Initializers are small picklable objects ``(shape, dtype) -> numpy array`` with their own seeded generator.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        fan_in = shape[0] if len(shape) >= 1 else 1
        fan_out = shape[1] if len(shape) >= 2 else shape[0] if shape else 1
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        return self.rng.uniform(-limit, limit, size=shape).astype(dtype)


class random_uniform:
    """``U(minval, maxval)`` (Keras' default for embeddings: -0.05, 0.05)."""

    def __init__(self, minval: float = -0.05, maxval: float = 0.05, seed: int | None = None) -> None:
        self.minval = check("minval", minval, number(), owner="random_uniform")
        self.maxval = check("maxval", maxval, number(gt=self.minval, allowed=f"a number > minval ({minval!r})"),
                            owner="random_uniform")
        self.rng = np.random.default_rng(seed)

    def __call__(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return self.rng.uniform(self.minval, self.maxval, size=shape).astype(dtype)


class zeros:
    """All zeros."""

    def __init__(self, seed: int | None = None) -> None:
        pass

    def __call__(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)


_INITIALIZERS = {"glorot_uniform": glorot_uniform, "uniform": random_uniform, "zeros": zeros}


def get_initializer(spec: Any, seed: int | None, what: str) -> Callable[[tuple[int, ...], Any], np.ndarray]:
    """A name (``"glorot_uniform"``, ``"uniform"``, ``"zeros"``) or a callable ``(shape, dtype) -> array``."""
    if callable(spec):
        return spec
    if isinstance(spec, str) and spec in _INITIALIZERS:
        return _INITIALIZERS[spec](seed=seed)
    raise RuntimeConfigError(what, spec, f"one of {sorted(_INITIALIZERS)} or a callable (shape, dtype) -> array")


# --------------------------------------------------------------------------------------------------------------
# Variables: kubeps Variables (local or on a PS) or plain arrays
# --------------------------------------------------------------------------------------------------------------


def _new_variable(initial: np.ndarray, name: str) -> Any:
    from kubeps.runtime.variables.variable import Variable  # noqa: PLC0415 - nn on local arrays loads no grpc

    return Variable(initial, name=name)


def _value(var: Any) -> Any:
    """The current value of a weight: arrays as they are, kubeps variables read (cached per step on a worker)."""
    if isinstance(var, np.ndarray) or kernels.array_module(var) is not np:
        return var
    if hasattr(var, "read_value"):
        return var.read_value()
    raise TypeError(f"weight of type {type(var).__name__} is neither an array nor a kubeps Variable")


def _on_device(x: Any, *weights: Any) -> tuple[Any, ...]:
    """``x`` and ``weights`` where the layer computes: on a GPU worker (:func:`kernels.compute_module`) or when
    ``x`` is already a device array, the host ones among them moved in one transfer; otherwise as they are."""
    if kernels.compute_module() is np and kernels.array_module(x) is np:
        return (x, *weights)
    if kernels.compute_module() is np:  # a CuPy input on a task that did not choose a device: follow the input
        xp = kernels.array_module(x)
        return (x, *(None if w is None else xp.asarray(w) for w in weights))
    present = [a for a in (x, *weights) if a is not None]
    moved = iter(kernels.to_device(*present))
    return tuple(None if a is None else next(moved) for a in (x, *weights))


_ACTIVATIONS = {
    None: (None, None),
    "linear": (None, None),
    "relu": (kernels.relu, "x"),
    "sigmoid": (kernels.sigmoid, "y"),
    "tanh": (kernels.tanh, "y"),
}


# --------------------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------------------


class Layer:
    """Base: ``forward``/``backward``, the variables it owns and the gradients of its last backward pass."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or type(self).__name__.lower()
        self._grads: list[tuple[Any, Any]] = []

    @property
    def trainable_variables(self) -> list[Any]:
        return []

    @property
    def built(self) -> bool:
        return True

    def build(self, input_dim: int | None) -> int | None:
        """Create variables for inputs with ``input_dim`` features; return the output's feature count."""
        return input_dim

    def forward(self, x: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def backward(self, dy: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.backward")

    def __call__(self, x: Any) -> Any:
        return self.forward(x)

    def grads_and_vars(self) -> list[tuple[Any, Any]]:
        """``(gradient, variable)`` pairs from the last ``backward``, for ``optimizer.apply_gradients``."""
        if not self._grads and self.trainable_variables:
            raise RuntimeError(f"layer {self.name!r}: no gradients yet; call forward then backward first")
        return list(self._grads)

    def __getstate__(self) -> dict[str, Any]:
        # Caches and gradients never travel with a scheduled function (they may be large and are per step).
        state = dict(self.__dict__)
        for key in list(state):
            if key.startswith("_cache"):
                state[key] = None
        state["_grads"] = []
        return state


class Dense(Layer):
    """``y = activation(x @ kernel + bias)`` for ``x`` of shape ``(batch, input_dim)``."""

    def __init__(self, units: int, activation: str | None = None, use_bias: bool = True,
                 kernel_initializer: Any = "glorot_uniform", bias_initializer: Any = "zeros",
                 input_dim: int | None = None, seed: int | None = None, dtype: Any = "float32",
                 name: str | None = None) -> None:
        super().__init__(name)
        self.units = check("units", units, PositiveInt, owner="Dense")
        self.activation = check("activation", activation, Literal[tuple(_ACTIVATIONS)], owner="Dense",
                                allowed=f"one of {[a for a in _ACTIVATIONS if a is not None]} or None")
        self.use_bias = bool(use_bias)
        self._kernel_init = get_initializer(kernel_initializer, seed, "kernel_initializer")
        self._bias_init = get_initializer(bias_initializer, None if seed is None else seed + 1, "bias_initializer")
        self.dtype = np.dtype(dtype)
        self.kernel: Any = None
        self.bias: Any = None
        self._cache_x = self._cache_w = self._cache_act = None
        if input_dim is not None:
            self.build(input_dim)

    @property
    def built(self) -> bool:
        return self.kernel is not None

    def build(self, input_dim: int | None) -> int:
        if self.built:
            if input_dim is not None and input_dim != self.kernel.shape[0]:
                raise ValueError(f"Dense {self.name!r}: built for {self.kernel.shape[0]} input features, got {input_dim}")
            return self.units
        if input_dim is None:
            raise ValueError(f"Dense {self.name!r}: input_dim is unknown; pass input_dim or call build(input_dim)")
        d = check("input_dim", input_dim, PositiveInt, owner="Dense")
        self.kernel = _new_variable(self._kernel_init((d, self.units), self.dtype), f"{self.name}/kernel")
        if self.use_bias:
            self.bias = _new_variable(self._bias_init((self.units,), self.dtype), f"{self.name}/bias")
        return self.units

    @property
    def trainable_variables(self) -> list[Any]:
        if not self.built:
            return []
        return [self.kernel] + ([self.bias] if self.use_bias else [])

    def forward(self, x: Any) -> Any:
        if x.ndim != 2:
            raise ValueError(f"Dense {self.name!r}: input has shape {tuple(x.shape)}; allowed: (batch, features)")
        if not self.built:
            self.build(int(x.shape[1]))
        w = _value(self.kernel)
        b = _value(self.bias) if self.use_bias else None
        x, w, b = _on_device(x, w, b)
        if x.shape[1] != w.shape[0]:
            raise ValueError(f"Dense {self.name!r}: input has {x.shape[1]} features; the layer was built for "
                             f"{w.shape[0]}")
        z = kernels.dense_forward(x, w, b)
        fn, keep = _ACTIVATIONS[self.activation]
        y = z if fn is None else fn(z)
        self._cache_x, self._cache_w = x, w
        self._cache_act = None if fn is None else (z if keep == "x" else y)
        return y

    def backward(self, dy: Any) -> Any:
        if self._cache_x is None:
            raise RuntimeError(f"Dense {self.name!r}: backward called before forward")
        if self.activation == "relu":
            dy = kernels.relu_grad(self._cache_act, dy)
        elif self.activation == "sigmoid":
            dy = kernels.sigmoid_grad(self._cache_act, dy)
        elif self.activation == "tanh":
            dy = kernels.tanh_grad(self._cache_act, dy)
        dx, dw, db = kernels.dense_backward(self._cache_x, self._cache_w, dy, with_bias=self.use_bias)
        self._grads = [(dw, self.kernel)] + ([(db, self.bias)] if self.use_bias else [])
        return dx


class _StepCalls:
    """The calls of a layer reused within a step (one table, two features): ``forward`` records each call, the
    backward passes take them back last-in first-out (reverse mode's order) and their gradients add up.

    A forward after a backward starts a new step; forwards never followed by a backward (evaluation) keep only the
    last :data:`MAX_CALLS` calls."""

    MAX_CALLS = 16

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.backward_done = False

    def record(self, call: Any) -> None:
        if self.backward_done:
            self.calls, self.backward_done = [], False
        self.calls.append(call)
        del self.calls[: -self.MAX_CALLS]

    def take(self, layer: str) -> tuple[Any, bool]:
        """The last call not yet taken, and whether it is the first taken in this step (its gradient replaces the
        previous step's) or a later one (its gradient adds to this step's)."""
        if not self.calls:
            more = " (one more backward than forwards in this step)" if self.backward_done else ""
            raise RuntimeError(f"{layer}: backward called before forward{more}")
        first = not self.backward_done
        self.backward_done = True
        return self.calls.pop(), first


def _add_slices(previous: IndexedSlices, new: IndexedSlices) -> IndexedSlices:
    """One table's gradient from two calls in a step: rows of ids both used summed, ids ascending."""
    xp = kernels.array_module(previous.values, new.values)
    uniq, summed = kernels.reduce_sparse(xp.concatenate([xp.asarray(previous.indices), xp.asarray(new.indices)]),
                                         xp.concatenate([previous.values, new.values]))
    return IndexedSlices(summed, uniq, previous.dense_shape)


class Embedding(Layer):
    """Rows of a ``(input_dim, output_dim)`` table for integer ids of any shape, or with ``combiner`` one pooled row
    per example for ids of shape ``(batch, L)`` padded with -1.

    ``embeddings`` may be given: a plain array (gathered locally), or a ``Variable``/``ShardedVariable`` (only the
    rows the batch needs are pulled, with ``kubeps.runtime.variables.variable.embedding_lookup``). Otherwise a table is
    created as a kubeps ``Variable`` (on the PS inside ``strategy.scope()``, sharded by the scope's partitioner).
    The gradient is an ``IndexedSlices`` over the unique ids of the batch.

    ``combiner`` (``"sum"``, ``"mean"`` or ``"sqrtn"``: :mod:`kubeps.runtime.ops.combiners`) pools the rows of each
    example's ids, optionally weighted (``forward(ids, weights)``, weights of the ids' shape), to ``(batch,
    output_dim)``; padding is never pulled and gets no gradient. A table two features read is one layer called on
    both in a step (its backward passes, in reverse order, add up into one gradient), or :meth:`share`, a second
    layer over the same table with its own combiner; either way one push carries the table's rows.

    ``hot_rows=N`` (default 0: off) keeps the ``N`` rows of a remote table this worker looks up most often in the
    worker and pulls only the batch's other rows; the hot rows are pulled again, with a lookup's own, every
    ``hot_refresh_steps`` lookups, so a cached row is at most that many lookups stale
    (:mod:`kubeps.runtime.variables.hot_rows`; gradients are pushed for every row). ``rows_pulled`` counts the rows
    this layer's lookups asked the parameter servers for.
    """

    def __init__(self, input_dim: int, output_dim: int, embeddings_initializer: Any = "uniform",
                 embeddings: Any = None, seed: int | None = None, dtype: Any = "float32",
                 name: str | None = None, combiner: str | None = None, hot_rows: int = 0,
                 hot_refresh_steps: int = 20) -> None:
        super().__init__(name)
        self.input_dim = check("input_dim", input_dim, PositiveInt, owner="Embedding")
        self.output_dim = check("output_dim", output_dim, PositiveInt, owner="Embedding")
        self.combiner = combiners.check_combiner(combiner, owner="Embedding")
        self.hot_rows = check("hot_rows", hot_rows, NonNegativeInt, owner="Embedding")
        self.hot_refresh_steps = check("hot_refresh_steps", hot_refresh_steps, PositiveInt, owner="Embedding")
        self.rows_pulled = 0
        self.dtype = np.dtype(dtype)
        if embeddings is None:
            init = get_initializer(embeddings_initializer, seed, "embeddings_initializer")
            embeddings = _new_variable(init((self.input_dim, self.output_dim), self.dtype), f"{self.name}/embeddings")
        shape = tuple(embeddings.shape)
        if shape != (self.input_dim, self.output_dim):
            raise ValueError(f"Embedding {self.name!r}: embeddings has shape {shape}; expected "
                             f"(input_dim, output_dim) = {(self.input_dim, self.output_dim)}")
        self.embeddings = embeddings
        self._cache_calls: _StepCalls | None = None
        self._cache_prefetch: tuple[np.ndarray, Any] | None = None  # (ids, their PendingLookup)

    def share(self, combiner: str | None = None, name: str | None = None) -> "Embedding":
        """A second layer reading this layer's table (a shared table: item id and clicked-item history), with its
        own ``combiner``. Its gradient and this layer's are pushed as one update of the table."""
        return Embedding(self.input_dim, self.output_dim, embeddings=self.embeddings, dtype=self.dtype,
                         name=name or f"{self.name}_shared", combiner=combiner)

    @property
    def trainable_variables(self) -> list[Any]:
        return [self.embeddings]

    def build(self, input_dim: int | None) -> int | None:
        return self.output_dim if self.combiner else None  # else (..., output_dim): its width depends on the ids

    def _lookup(self, ids: Any) -> Any:
        table = self.embeddings
        if isinstance(table, np.ndarray) or kernels.array_module(table) is not np:
            return kernels.embedding_gather(table, ids)
        from kubeps.runtime.variables import hot_rows, variable as variables  # noqa: PLC0415 - nn on local arrays loads no grpc

        ids = kernels.to_numpy(ids)
        cache = hot_rows.cache_for(table, self.hot_rows, self.hot_refresh_steps) if self.hot_rows else None
        if cache is not None:
            rows, pulled = cache.lookup(table, ids)
            self.rows_pulled += pulled
            return rows
        ids, unique, inverse, rows = variables.gather_unique_rows(table, ids)
        self.rows_pulled += unique.size
        return np.take(rows, inverse, axis=0).reshape(ids.shape + tuple(table.shape[1:]))

    def _check_ids(self, ids: Any) -> Any:
        ids = kernels.array_module(ids).asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"Embedding {self.name!r}: ids must be integers, got dtype {ids.dtype}")
        low = combiners.PADDING if self.combiner else 0
        if ids.size and (int(ids.min()) < low or int(ids.max()) >= self.input_dim):
            bad = int(ids.min()) if int(ids.min()) < low else int(ids.max())
            padding = " or -1 (padding)" if self.combiner else ""
            raise IndexError(f"Embedding {self.name!r}: id {bad} is out of range; allowed: 0 <= id < "
                             f"{self.input_dim}{padding}")
        return ids

    def _pulled(self, ids: Any) -> Any:
        """The rows of ``ids`` (prefetched, or looked up now), where the layer computes: on the compute device, else
        in the ids' array module."""
        rows = self._take_prefetched(ids)
        if rows is None:
            rows = self._lookup(ids)
        if kernels.compute_module() is not np and kernels.array_module(rows) is np:
            (rows,) = kernels.to_device(rows)  # the looked-up rows: one transfer
            return rows
        return kernels.array_module(ids).asarray(rows)

    def forward(self, ids: Any, weights: Any = None) -> Any:
        """Rows ``ids.shape + (output_dim,)``; with a combiner, ``(batch, output_dim)`` pooled with ``weights``."""
        ids = self._check_ids(ids)
        if self.combiner is None:
            if weights is not None:
                raise RuntimeConfigError(f"Embedding {self.name!r} weights", "given",
                                         "weights only with a combiner (Embedding(..., combiner='sum'))")
            rows = self._pulled(ids)
            self._calls().record((ids, None))
            return rows
        combiners.check_multi_hot(tuple(ids.shape), ids.dtype, weights, owner=f"Embedding {self.name!r}")
        xp = kernels.array_module(ids)
        real = ids != combiners.PADDING
        unique, inverse = xp.unique(ids[real], return_inverse=True)
        rows = self._pulled(unique)
        xp = kernels.array_module(rows)  # where the layer computes (a GPU worker's device)
        ids, real, inverse = xp.asarray(ids), xp.asarray(real), xp.asarray(inverse)
        rows = xp.concatenate([rows, xp.zeros((1, self.output_dim), dtype=rows.dtype)])  # padding reads the last
        positions = xp.full(ids.shape, unique.size, dtype=xp.int64)
        positions[real] = inverse.reshape(-1)
        coef = combiners.coefficients(xp, ids, None if weights is None else xp.asarray(weights), self.combiner,
                                      rows.dtype)
        self._calls().record((ids, coef))
        return combiners.pool(xp.take(rows, positions, axis=0), coef)

    def __call__(self, ids: Any, weights: Any = None) -> Any:
        return self.forward(ids, weights)

    def _calls(self) -> _StepCalls:
        if self._cache_calls is None:
            self._cache_calls = _StepCalls()
        return self._cache_calls

    def prefetch(self, ids: Any) -> None:
        """Start pulling the rows of ``ids`` -- the next batch's -- in the background, right after this step's
        ``forward``; the next ``forward`` given these same ids takes them instead of pulling. The pull overlaps this
        step's compute and, inside a scheduled function, is the step's one call per parameter server: it carries
        this worker's previous push and pulls the dense variables too, so the next step computes on values one step
        stale (``docs/kernels.md``, "Overlap"). A table that is a local array gathers at ``forward`` as always."""
        table = self.embeddings
        if isinstance(table, np.ndarray) or kernels.array_module(table) is not np:
            return
        from kubeps.runtime.variables import variable as variables  # noqa: PLC0415 - nn on local arrays loads no grpc

        host = np.asarray(kernels.to_numpy(ids))
        if self.combiner is not None:  # what a pooled forward pulls: the distinct real ids
            host = np.unique(host[host != combiners.PADDING])
        self._cache_prefetch = (host, variables.start_lookup(table, host))

    def _take_prefetched(self, ids: Any) -> Any:
        pending, self._cache_prefetch = self._cache_prefetch, None
        if pending is None:
            return None
        want, lookup = pending
        rows = lookup.result()  # taken even if unused: no lookup outlives its step
        if want is ids or (want.shape == tuple(ids.shape) and np.array_equal(want, kernels.to_numpy(ids))):
            return rows
        return None

    def backward(self, dy: Any) -> None:
        (ids, coef), first = self._calls().take(f"Embedding {self.name!r}")
        want = (ids.shape[0], self.output_dim) if self.combiner else tuple(ids.shape) + (self.output_dim,)
        if tuple(dy.shape) != want:
            raise ValueError(f"Embedding {self.name!r}: dy has shape {tuple(dy.shape)}; expected {want}")
        if coef is None:
            uniq, summed = kernels.reduce_sparse(ids.reshape(-1).astype("int64"), dy.reshape(-1, self.output_dim))
        else:  # row i gets sum of c[b, j] * dy[b] over its positions: padding has none
            real = ids != combiners.PADDING
            uniq, summed = kernels.reduce_sparse(ids[real].astype("int64"), (coef[..., None] * dy[:, None, :])[real])
        grad = _indexed_slices(summed, uniq, (self.input_dim, self.output_dim))
        if not first:
            grad = _add_slices(self._grads[0][0], grad)
        self._grads = [(grad, self.embeddings)]
        return None  # integer inputs have no gradient


class DynamicEmbeddingLayer(Layer):
    """Rows of a :class:`~kubeps.runtime.variables.dynamic.DynamicEmbedding` for ids of any shape (integers of any
    size, or strings for a ``key_dtype="string"`` table): ``(..., ) -> (..., dim)``, as :class:`Embedding`.

    ``forward`` looks up the batch's distinct keys once (a training lookup inside a scheduled function: keys are
    counted for admission and new rows created); ``backward`` sums ``dy`` per distinct key and records an
    ``IndexedSlices`` whose indices are the keys, which ``optimizer.apply_gradients`` pushes to the table.
    """

    def __init__(self, table: Any, name: str | None = None) -> None:
        super().__init__(name)
        if not hasattr(table, "gather_unique") or not hasattr(table, "dim"):
            raise TypeError(f"DynamicEmbeddingLayer: table must be a kubeps DynamicEmbedding, got {type(table).__name__}")
        self.table = table
        self.output_dim = int(table.dim)
        self._cache_keys: Any = None

    @property
    def trainable_variables(self) -> list[Any]:
        return [self.table]

    def build(self, input_dim: int | None) -> int | None:
        return None  # output is (..., dim); its flattened width depends on the id shape

    def forward(self, ids: Any) -> Any:
        keys, unique, inverse, rows = self.table.gather_unique(kernels.to_numpy(ids))
        self._cache_keys = (unique, inverse, keys.shape)
        return kernels.array_module(ids).asarray(rows[inverse].reshape(tuple(keys.shape) + (self.output_dim,)))

    def backward(self, dy: Any) -> None:
        if self._cache_keys is None:
            raise RuntimeError(f"DynamicEmbeddingLayer {self.name!r}: backward called before forward")
        unique, inverse, shape = self._cache_keys
        want = tuple(shape) + (self.output_dim,)
        if tuple(dy.shape) != want:
            raise ValueError(f"DynamicEmbeddingLayer {self.name!r}: dy has shape {tuple(dy.shape)}; expected {want}")
        # every position of ``unique`` occurs in ``inverse``: the summed rows come back in ``unique``'s order
        _, summed = kernels.reduce_sparse(inverse.astype(np.int64), kernels.to_numpy(dy).reshape(-1, self.output_dim))
        self._grads = [(IndexedSlices(summed.astype(self.table.dtype, copy=False), unique), self.table)]
        return None  # ids have no gradient


def _indexed_slices(values: Any, indices: Any, dense_shape: tuple[int, ...]) -> IndexedSlices:
    # device arrays stay on the device: apply_gradients moves every gradient of a step back in one transfer
    return IndexedSlices(values, indices, dense_shape)


class Flatten(Layer):
    """``(batch, d1, d2, ...) -> (batch, d1 * d2 * ...)``."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._cache_shape: tuple[int, ...] | None = None

    def forward(self, x: Any) -> Any:
        self._cache_shape = tuple(x.shape)
        return x.reshape(x.shape[0], -1)

    def backward(self, dy: Any) -> Any:
        if self._cache_shape is None:
            raise RuntimeError(f"Flatten {self.name!r}: backward called before forward")
        return dy.reshape(self._cache_shape)


class _Merge(Layer):
    """Base of the layers that merge several inputs: ``forward(inputs)`` takes a list of arrays and ``backward(dy)``
    returns a list with one gradient per input. They own no variables."""

    def _check_inputs(self, inputs: Sequence[Any]) -> list[Any]:
        if isinstance(inputs, np.ndarray) or not isinstance(inputs, (list, tuple)) or len(inputs) < 2:
            got = f"a {type(inputs).__name__}" if not isinstance(inputs, (list, tuple)) else f"{len(inputs)} input(s)"
            raise ValueError(f"{type(self).__name__} {self.name!r}: inputs is {got}; allowed: a list of at least 2 "
                             f"arrays")
        return list(inputs)


class Concatenate(_Merge):
    """``concatenate(inputs, axis)``, as Keras' ``Concatenate``: the inputs agree on every axis but ``axis``.

    ``backward(dy)`` splits ``dy`` back into one slice per input (wide-and-deep: the wide and the deep parts)."""

    def __init__(self, axis: int = -1, name: str | None = None) -> None:
        super().__init__(name)
        self.axis = check("axis", axis, integer(), owner="Concatenate")
        self._cache_sizes: list[int] | None = None

    def forward(self, inputs: Sequence[Any]) -> Any:
        arrays = self._check_inputs(inputs)
        ndim = arrays[0].ndim
        if not -ndim <= self.axis < ndim:
            raise ValueError(f"Concatenate {self.name!r}: axis={self.axis} is out of range for inputs of rank {ndim}; "
                             f"allowed: {-ndim} <= axis < {ndim}")
        axis = self.axis % ndim
        for i, a in enumerate(arrays):
            same = a.ndim == ndim and all(a.shape[k] == arrays[0].shape[k] for k in range(ndim) if k != axis)
            if not same:
                raise ValueError(f"Concatenate {self.name!r}: inputs[{i}] has shape {tuple(a.shape)}; allowed: the "
                                 f"shape of inputs[0] {tuple(arrays[0].shape)} on every axis but {self.axis}")
        self._cache_sizes = [int(a.shape[axis]) for a in arrays]
        return kernels.array_module(arrays[0]).concatenate(arrays, axis=axis)

    def backward(self, dy: Any) -> list[Any]:
        if self._cache_sizes is None:
            raise RuntimeError(f"Concatenate {self.name!r}: backward called before forward")
        axis = self.axis % dy.ndim
        bounds = np.cumsum(self._cache_sizes)[:-1].tolist()
        return kernels.array_module(dy).split(dy, bounds, axis=axis)


class Add(_Merge):
    """The element-wise sum of inputs of one shape, as Keras' ``Add`` (a residual or a wide + deep logit);
    ``backward(dy)`` hands ``dy`` to every input."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._cache_count: int | None = None

    def forward(self, inputs: Sequence[Any]) -> Any:
        arrays = self._check_inputs(inputs)
        for i, a in enumerate(arrays):
            if tuple(a.shape) != tuple(arrays[0].shape):
                raise ValueError(f"Add {self.name!r}: inputs[{i}] has shape {tuple(a.shape)}; allowed: the shape of "
                                 f"inputs[0] {tuple(arrays[0].shape)} (no broadcasting)")
        out = arrays[0] + arrays[1]
        for a in arrays[2:]:
            out = out + a
        self._cache_count = len(arrays)
        return out

    def backward(self, dy: Any) -> list[Any]:
        if self._cache_count is None:
            raise RuntimeError(f"Add {self.name!r}: backward called before forward")
        return [dy] * self._cache_count


class Sequential(Layer):
    """Layers applied in order; ``backward`` runs them in reverse. Gradients are collected from every layer."""

    def __init__(self, layers: Sequence[Layer], name: str | None = None) -> None:
        super().__init__(name)
        layers = list(layers)
        for i, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise RuntimeConfigError(f"Sequential.layers[{i}]", type(layer).__name__,
                                         "a kubeps.runtime.ops.nn Layer instance")
        names = [layer.name for layer in layers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"Sequential: layer names {dupes} repeat; give each layer a unique name (variables are "
                             f"named after their layer)")
        self.layers = layers

    @property
    def built(self) -> bool:
        return all(layer.built for layer in self.layers)

    def build(self, input_dim: int | None) -> int | None:
        """Create every layer's variables (call on the coordinator, inside ``strategy.scope()`` to place them)."""
        for layer in self.layers:
            input_dim = layer.build(input_dim)
        return input_dim

    @property
    def trainable_variables(self) -> list[Any]:
        return [v for layer in self.layers for v in layer.trainable_variables]

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, dy: Any) -> Any:
        for layer in reversed(self.layers):
            dy = layer.backward(dy)
        return dy

    def grads_and_vars(self) -> list[tuple[Any, Any]]:
        return [gv for layer in self.layers for gv in layer.grads_and_vars()]

    def train_step(self, x: Any, labels: Any, loss: "Loss", optimizer: Any) -> float:
        """forward, loss, backward, ``optimizer.apply_gradients``; returns the batch's mean loss."""
        value = loss.forward(self.forward(x), labels)
        self.backward(loss.backward())
        optimizer.apply_gradients(self.grads_and_vars())
        return value


class MLP(Sequential):
    """``Dense(h, activation) for h in hidden_units`` then ``Dense(output_units, output_activation)``.

    Layer ``i`` gets seed ``seed + 2 * i`` so a seeded MLP is reproducible.
    """

    def __init__(self, hidden_units: Sequence[int], output_units: int, activation: str = "relu",
                 output_activation: str | None = None, input_dim: int | None = None, seed: int | None = None,
                 dtype: Any = "float32", name: str = "mlp") -> None:
        check("hidden_units", hidden_units, list[PositiveInt] | tuple[PositiveInt, ...], owner="MLP",
              allowed="a list of integers >= 1")
        sizes = list(hidden_units) + [output_units]
        acts = [activation] * len(hidden_units) + [output_activation]
        layers = [Dense(u, activation=a, seed=None if seed is None else seed + 2 * i, dtype=dtype,
                        name=f"{name}/dense_{i}") for i, (u, a) in enumerate(zip(sizes, acts))]
        super().__init__(layers, name=name)
        if input_dim is not None:
            self.build(input_dim)


def all_grads_and_vars(layers: Iterable[Layer]) -> list[tuple[Any, Any]]:
    """Concatenated ``grads_and_vars()`` of several layers or models (e.g. an embedding and an MLP)."""
    return [gv for layer in layers for gv in layer.grads_and_vars()]


__all__.append("all_grads_and_vars")
