"""Gradients with JAX on the workers: the custom-training-loop path (TensorFlow's ``GradientTape``).

The user writes the forward pass and the loss with ``jax.numpy`` as a function of a dict of parameters and a batch;
:func:`value_and_grad` binds it to kubeps variables::

    step = value_and_grad(loss_fn, dense={"w": w, "b": b}, tables={"emb": (table, lambda batch: batch["ids"])})

    def train_step(iterator):                      # scheduled on a worker
        batch = next(iterator)
        loss, grads = step(batch)                  # pull, jitted value_and_grad
        optimizer.apply_gradients(step.grads_and_vars(grads))   # one Push per ps, carried by the next step's read
        return loss

A call, inside a function scheduled on a worker:

1. gathers, for every table, only the rows of the batch's ids (``tables[name][1](batch)``), deduplicated, with one
   ``ReadRows`` per parameter server (as ``embedding_lookup``); the first table's call also carries the batched pull
   of the dense variables and the previous step's deferred push (``ReadMany`` / ``PushRead``);
2. reads the dense variables (from that pull: no call of their own);
3. runs ``jax.value_and_grad`` of ``loss_fn`` (jit-compiled once per batch shape, and once per process: the
   compiled function is kept across scheduled functions) with ``params[name]`` the looked-up rows, shaped
   ``ids.shape + (dim,)``, for a table and the variable's value for a dense parameter;
4. returns the loss (a float) and the gradients keyed like the parameters: a numpy array for a dense variable
   (``ShardedVariable`` too: the push splits it by shard) and an ``IndexedSlices`` over the batch's unique ids for a
   table (the gradient with respect to the gathered rows; duplicates summed by XLA's scatter-add).

A multi-hot feature is a table entry ``(table, lookup(ids_fn, combiner="mean", weights=weights_fn))``: its ids
have shape ``(batch, L)`` padded with -1 and ``params[name]`` is their pooled rows, ``(batch, dim)``
(:mod:`kubeps.runtime.ops.combiners`); padding is never pulled and gets no gradient. Two entries may name one table
(a table two features read): their gradients are pushed as one update of it.

The rows are passed padded to the batch's id count, so the compiled function does not change with the number of
unique ids. On the first call of a process, a parameter ``loss_fn`` does not read is an error (TF would hand it a
``None`` gradient). Outside a scheduled function (on the chief, or with local variables) the same call reads and
the optimizer pushes directly.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from typing import Any, Callable, Mapping

import numpy as np

from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.models.xla import import_jax
from kubeps.runtime.ops import combiners
from kubeps.runtime.variables.indexed_slices import IndexedSlices
from kubeps.runtime.variables.variable import ShardedVariable, Variable, gather_padded_rows

__all__ = ["Lookup", "ValueAndGrad", "lookup", "value_and_grad"]

LossFn = Callable[[dict[str, Any], Any], Any]
IdsFn = Callable[[Any], Any]

#: compiled ``value_and_grad`` functions of this process, by the token of the :class:`ValueAndGrad` they belong to
#: (a scheduled function arrives unpickled, as a new object with the same token: it reuses the compiled code)
_COMPILED: "OrderedDict[str, Any]" = OrderedDict()
_COMPILED_MAX = 32
_compiled_lock = threading.Lock()


class Lookup:
    """A table's ids in a batch, pooled: ``ids(batch)`` of shape ``(batch, L)`` padded with -1, ``combiner`` (sum,
    mean, sqrtn) and optional ``weights(batch)`` of the ids' shape. Made by :func:`lookup`."""

    def __init__(self, ids: IdsFn, combiner: str, weights: IdsFn | None = None) -> None:
        if not callable(ids) or (weights is not None and not callable(weights)):
            raise RuntimeConfigError("lookup", (ids, weights), "ids and weights must be functions batch -> array")
        self.ids, self.weights = ids, weights
        self.combiner = combiners.check_combiner(combiner, owner="lookup")
        if self.combiner is None:
            raise RuntimeConfigError("lookup.combiner", None, f"one of {list(combiners.COMBINERS)}")

    def __call__(self, batch: Any) -> Any:
        return self.ids(batch)


def lookup(ids: IdsFn, combiner: str, weights: IdsFn | None = None) -> Lookup:
    """A pooled table entry for :func:`value_and_grad`: ``tables={"hist": (table, lookup(lambda b: b["hist"],
    "mean"))}`` gives ``params["hist"]`` of shape ``(batch, dim)``."""
    return Lookup(ids, combiner, weights)


def _check_variable(field: str, var: Any, rank: int) -> Variable | ShardedVariable:
    if not isinstance(var, (Variable, ShardedVariable)):
        raise RuntimeConfigError(field, type(var).__name__, "must be a kubeps Variable or ShardedVariable")
    if var.dtype.kind != "f":
        raise RuntimeConfigError(field, f"{var.name!r} of dtype {var.dtype}",
                                 "must have a floating dtype (float16, float32 or float64): only those have gradients")
    if var.ndim < rank:
        raise RuntimeConfigError(field, f"{var.name!r} of shape {list(var.shape)}",
                                 f"must have rank >= {rank} (an embedding table has one row per id)")
    return var


class ValueAndGrad:
    """``loss_fn(params, batch)`` bound to kubeps variables; calling it with a batch returns ``(loss, grads)``.

    ``dense``: ``{name: Variable | ShardedVariable}``, read whole. ``tables``: ``{name: (table, ids_fn)}``, where
    ``ids_fn(batch)`` gives the integer ids whose rows ``params[name]`` holds. Names are unique across both.
    """

    def __init__(self, loss_fn: LossFn, dense: Mapping[str, Any] | None = None,
                 tables: Mapping[str, tuple[Any, IdsFn]] | None = None) -> None:
        if not callable(loss_fn):
            raise RuntimeConfigError("loss_fn", type(loss_fn).__name__, "must be a function (params, batch) -> loss")
        dense, tables = dict(dense or {}), dict(tables or {})
        self.dense: dict[str, Variable | ShardedVariable] = {}
        for name, var in dense.items():
            if not isinstance(name, str):
                raise RuntimeConfigError("dense", repr(name), "keys must be strings")
            self.dense[name] = _check_variable(f"dense[{name!r}]", var, 0)
        self.tables: dict[str, tuple[Variable | ShardedVariable, IdsFn]] = {}
        for name, entry in tables.items():
            if not isinstance(name, str):
                raise RuntimeConfigError("tables", repr(name), "keys must be strings")
            if name in self.dense:
                raise RuntimeConfigError(f"tables[{name!r}]", name, "must not repeat a name of dense")
            if not isinstance(entry, tuple) or len(entry) != 2 or not callable(entry[1]):
                raise RuntimeConfigError(f"tables[{name!r}]", entry, "must be a pair (table, ids_fn) with ids_fn a "
                                                                     "function batch -> integer ids")
            self.tables[name] = (_check_variable(f"tables[{name!r}]", entry[0], 1), entry[1])
        if not self.dense and not self.tables:
            raise RuntimeConfigError("dense", dense, "value_and_grad needs at least one variable in dense or tables")
        self.loss_fn = loss_fn
        self._token = uuid.uuid4().hex  # travels with the pickled object: one compilation per process

    @property
    def variables(self) -> dict[str, Variable | ShardedVariable]:
        """Every variable by its parameter name (dense first, then tables), as ``model.trainable_variables``."""
        return {**self.dense, **{name: table for name, (table, _) in self.tables.items()}}

    def grads_and_vars(self, grads: Mapping[str, Any]) -> list[tuple[Any, Variable | ShardedVariable]]:
        """``(gradient, variable)`` pairs for ``optimizer.apply_gradients`` (``zip(grads, model.trainable_variables)``
        in TF)."""
        variables = self.variables
        if set(grads) != set(variables):
            raise RuntimeConfigError("grads", sorted(grads), f"must have the keys of the parameters {sorted(variables)}")
        return [(grads[name], var) for name, var in variables.items()]

    # -- a step ------------------------------------------------------------------------------------------------
    def _ids(self, name: str, table: Variable | ShardedVariable, ids_fn: IdsFn, batch: Any) -> np.ndarray:
        ids = np.asarray(ids_fn(batch))
        if ids.dtype.kind not in "iu":
            raise RuntimeConfigError(f"tables[{name!r}] ids", f"array of dtype {ids.dtype}", "must be integers")
        low = combiners.PADDING if isinstance(ids_fn, Lookup) else 0
        if ids.size and (int(ids.min()) < low or int(ids.max()) >= table.shape[0]):
            bad = int(ids.min()) if int(ids.min()) < low else int(ids.max())
            raise RuntimeConfigError(f"tables[{name!r}] ids", bad,
                                     f"must be in [0, {table.shape[0]}) (the rows of {table.name!r})"
                                     + (", or -1 (padding)" if low else ""))
        return ids

    def _coefficients(self, name: str, ids: np.ndarray, lookup: Lookup, dtype: Any, batch: Any) -> np.ndarray:
        weights = None if lookup.weights is None else np.asarray(lookup.weights(batch))
        combiners.check_multi_hot(ids.shape, ids.dtype, weights, owner=f"tables[{name!r}]")
        return combiners.coefficients(np, ids, weights, str(lookup.combiner), dtype)

    def __call__(self, batch: Any) -> tuple[float, dict[str, Any]]:
        """Pull, compute ``jax.value_and_grad(loss_fn)`` at the variables' values, return ``(loss, grads)``."""
        rows: dict[str, np.ndarray] = {}
        inverses: dict[str, np.ndarray] = {}
        uniques: dict[str, np.ndarray] = {}
        coefs: dict[str, np.ndarray] = {}
        for name, (table, ids_fn) in self.tables.items():  # first: the dense pull rides on the first lookup
            ids = self._ids(name, table, ids_fn, batch)
            if isinstance(ids_fn, Lookup):
                coefs[name] = self._coefficients(name, ids, ids_fn, table.dtype, batch)
            uniques[name], inverses[name], rows[name] = gather_padded_rows(table, ids, padding=name in coefs)
        values = {name: np.asarray(var.read_value()) for name, var in self.dense.items()}
        compiled = self._compiled(values, rows, inverses, coefs, batch)
        loss, (d_dense, d_rows) = compiled(values, rows, inverses, coefs, batch)
        grads: dict[str, Any] = {name: np.asarray(d_dense[name]) for name in self.dense}
        for name, (table, _) in self.tables.items():
            n = len(uniques[name])
            grads[name] = IndexedSlices(np.asarray(d_rows[name])[:n], uniques[name], table.shape)
        return float(loss), grads

    # -- compilation -------------------------------------------------------------------------------------------
    def _objective(self, jax: Any) -> Callable[..., Any]:
        loss_fn, table_names = self.loss_fn, list(self.tables)

        def objective(dense: dict[str, Any], rows: dict[str, Any], inverses: dict[str, Any], coefs: dict[str, Any],
                      batch: Any) -> Any:
            params = dict(dense)
            for name in table_names:
                params[name] = rows[name][inverses[name]]
                if name in coefs:
                    params[name] = combiners.pool(params[name], coefs[name])
            loss = jax.numpy.asarray(loss_fn(params, batch))
            if loss.shape != () or not jax.numpy.issubdtype(loss.dtype, jax.numpy.floating):
                raise RuntimeConfigError("loss_fn", f"a result of shape {list(loss.shape)} and dtype {loss.dtype}",
                                         "must return a floating scalar (the mean loss of the batch)")
            return loss

        return objective

    def _compiled(self, dense: dict[str, Any], rows: dict[str, Any], inverses: dict[str, Any], coefs: dict[str, Any],
                  batch: Any) -> Any:
        with _compiled_lock:
            compiled = _COMPILED.get(self._token)
            if compiled is not None:
                _COMPILED.move_to_end(self._token)
                return compiled
        jax = import_jax()
        objective = self._objective(jax)
        self._check_every_param_is_read(jax, objective, dense, rows, inverses, coefs, batch)
        compiled = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)))
        with _compiled_lock:
            _COMPILED[self._token] = compiled
            while len(_COMPILED) > _COMPILED_MAX:
                _COMPILED.popitem(last=False)
        return compiled

    def _check_every_param_is_read(self, jax: Any, objective: Callable[..., Any], dense: dict[str, Any],
                                   rows: dict[str, Any], inverses: dict[str, Any], coefs: dict[str, Any],
                                   batch: Any) -> None:
        """A parameter the loss never reads would get a zero gradient forever: name it instead."""
        jaxpr = jax.make_jaxpr(objective)(dense, rows, inverses, coefs, batch).jaxpr
        read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
        # jax flattens a dict in the order of its sorted keys: dense parameters, then the tables' rows
        names = [f"dense[{n!r}]" for n in sorted(dense)] + [f"tables[{n!r}]" for n in sorted(rows)]
        unread = [name for name, var in zip(names, jaxpr.invars) if id(var) not in read]
        if unread:
            raise RuntimeConfigError(unread[0], "a parameter loss_fn does not read",
                                     "every parameter must be used by the loss (its gradient would always be zero): "
                                     f"remove it from value_and_grad's arguments (unread: {', '.join(unread)})")


def value_and_grad(loss_fn: LossFn, dense: Mapping[str, Any] | None = None,
                   tables: Mapping[str, tuple[Any, IdsFn]] | None = None) -> ValueAndGrad:
    """Bind ``loss_fn(params, batch) -> scalar`` (written with ``jax.numpy``) to kubeps variables: see
    :class:`ValueAndGrad` and the module docstring."""
    return ValueAndGrad(loss_fn, dense=dense, tables=tables)
