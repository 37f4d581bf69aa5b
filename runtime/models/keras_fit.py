"""``fit`` for Keras 3 models (JAX backend) with a parameter server, following ``model.fit`` with TensorFlow's
``ParameterServerStrategy``: a dataset function per worker, ``epochs``/``steps_per_epoch``, ``steps_per_execution``
steps per scheduled function, callbacks (:mod:`kubeps.runtime.models.keras_callbacks`).

* **The weights live on the parameter servers.** :class:`KerasTrainer` creates a kubeps ``Variable`` (sharded by
  the strategy's partitioner) from each trainable weight of the built Keras model, inside ``strategy.scope()``;
  the tables of :class:`~kubeps.runtime.models.keras_layers.KubepsEmbedding` layers are kubeps variables already.
* **A step on a worker.** Every worker deserializes the model once (Keras's ``get_config``/``from_config``, a
  per-worker resource) and jits two functions around Keras's own ``model.stateless_call``: the *ids* pass (what ids
  each ``KubepsEmbedding`` looks up) and ``jax.value_and_grad`` of the loss. A step runs the ids pass, fetches the
  batch's unique rows of every table and the dense weights in one round trip per parameter server (which also
  carries the previous step's push), computes the loss and the gradients, and hands them to
  ``optimizer.apply_gradients``: dense gradients and row-sparse ``IndexedSlices`` of the tables, pushed with the
  next step's reads. Nothing of Keras is forked.
* **The optimizer runs on the parameter servers**: a kubeps optimizer, or a Keras optimizer mapped to one
  (:func:`kubeps_optimizer`: SGD, Adagrad, Adam, Ftrl, with their hyper-parameters; learning-rate schedules, weight
  decay, clipping and EMA are refused).
* **Non-trainable variables**: Keras's random-seed states (``Dropout``) stay on each worker (each has its own
  stream); any other non-trainable variable (``BatchNormalization`` statistics) is refused with an error naming it.

Rule: imports keras and jax (through :mod:`keras_layers`); reaches the coordinator only through the object it is
given (``schedule``, ``join``, ``create_per_worker_dataset``, ``create_per_worker_resource``, ``strategy``).
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from kubeps.runtime.checkpoint.saveables import StepCounter
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.models.keras_callbacks import Callback, CallbackList, History
from kubeps.runtime.models.keras_layers import KubepsEmbedding, LookupFeed, keras, lookup_feed, replica_build
from kubeps.runtime.ops.optimizers import SGD, Adagrad, Adam, Ftrl, Momentum, Optimizer
from kubeps.runtime.variables.context import resolve_resource
from kubeps.runtime.variables.indexed_slices import IndexedSlices
from kubeps.runtime.variables.variable import ShardedVariable, Variable, embedding_lookup

import jax  # after keras_layers: the backend is set

__all__ = ["KerasTrainer", "fit", "kubeps_optimizer", "restore_weights", "table_layers"]

#: Keras optimizer settings kubeps cannot apply on the parameter servers, with the value that means "off"
_UNSUPPORTED_OPTIMIZER_SETTINGS = {"weight_decay": None, "clipnorm": None, "clipvalue": None,
                                   "global_clipnorm": None, "use_ema": False, "loss_scale_factor": None,
                                   "gradient_accumulation_steps": None}
#: Keras non-trainable variables that stay on each worker: the state of a ``SeedGenerator`` (``Dropout``'s)
_WORKER_LOCAL_STATE = "seed_generator_state"


# -- optimizers ---------------------------------------------------------------------------------------------------
def kubeps_optimizer(optimizer: Any) -> Optimizer:
    """A kubeps optimizer as it is; a Keras optimizer (object or name) mapped to the kubeps optimizer with the same
    update: ``SGD`` (``Momentum`` when ``momentum > 0``), ``Adagrad``, ``Adam``, ``Ftrl``.

    Refused, with the setting named: a learning-rate schedule (use a kubeps optimizer with a kubeps schedule),
    ``weight_decay``, clipping, EMA, loss scaling and gradient accumulation. Keras's ``Adagrad`` adds ``epsilon``
    under the square root, kubeps's (TensorFlow's kernel) outside it: the same update up to that ``epsilon``."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise RuntimeConfigError("optimizer", type(optimizer).__name__,
                                 "allowed: a kubeps optimizer (kubeps.runtime.Adagrad(...)) or a Keras optimizer "
                                 "(keras.optimizers.Adagrad(...) or its name)")
    config = optimizer.get_config()
    kind = type(optimizer).__name__
    for key, off in _UNSUPPORTED_OPTIMIZER_SETTINGS.items():
        if config.get(key, off) not in (off, 0, 0.0) or (off is None and config.get(key) not in (None, 0, 0.0)):
            raise RuntimeConfigError(f"optimizer {kind} {key}", config.get(key),
                                     f"kubeps applies the optimizer on the parameter servers without {key}; "
                                     f"allowed: {off}")
    lr = config.get("learning_rate")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise RuntimeConfigError(f"optimizer {kind} learning_rate", lr,
                                 "a Keras optimizer is mapped with a constant learning rate; for a schedule pass a "
                                 "kubeps optimizer with a kubeps schedule (kubeps.runtime.ExponentialDecay, ...)")
    lr = float(str(np.float32(lr)))  # Keras keeps it as float32: 0.1, not 0.10000000149011612
    if kind == "SGD":
        momentum = float(config.get("momentum", 0.0))
        return Momentum(lr, momentum, bool(config.get("nesterov", False))) if momentum else SGD(lr)
    if kind == "Adagrad":
        return Adagrad(lr, float(config["initial_accumulator_value"]), float(config["epsilon"]))
    if kind == "Adam":
        return Adam(lr, float(config["beta_1"]), float(config["beta_2"]), float(config["epsilon"]),
                    bool(config.get("amsgrad", False)))
    if kind == "Ftrl":
        return Ftrl(lr, float(config["learning_rate_power"]), float(config["initial_accumulator_value"]),
                    float(config["l1_regularization_strength"]), float(config["l2_regularization_strength"]),
                    float(config["l2_shrinkage_regularization_strength"]), float(config["beta"]))
    raise RuntimeConfigError("optimizer", kind, "allowed Keras optimizers: SGD, Adagrad, Adam, Ftrl (or pass a "
                             "kubeps optimizer)")


# -- the model's parts ----------------------------------------------------------------------------------------------
def table_layers(model: Any) -> list[KubepsEmbedding]:
    """The model's ``KubepsEmbedding`` layers, in a fixed order (the same on the chief and in a worker's replica)."""
    return [layer for layer in model._flatten_layers(include_self=False) if isinstance(layer, KubepsEmbedding)]


def _check_non_trainable(model: Any) -> None:
    refused = [v.path for v in model.non_trainable_variables if v.name != _WORKER_LOCAL_STATE]
    if refused:
        raise RuntimeConfigError("model non-trainable variables", refused,
                                 "kubeps fit supports no non-trainable state but Keras's random-seed states "
                                 "(Dropout): BatchNormalization statistics and the like are not supported yet")


def _unpack(batch: Any) -> tuple[Any, Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return batch[0], batch[1], batch[2] if len(batch) == 3 else None
    raise RuntimeConfigError("dataset element", type(batch).__name__,
                             "fit needs (x, y) or (x, y, sample_weight) elements, as Keras's fit")


class _Replica:
    """A worker's copy of the model (no weights of its own: they come from the parameter servers) and its two
    jitted functions. Built once per worker (a per-worker resource), from the model's Keras config."""

    def __init__(self, model_class: Any, config: Mapping[str, Any], custom_objects: Mapping[str, Any],
                 loss: Any, shapes: Sequence[tuple[int, ...]], tables: int):
        with replica_build(), keras.saving.custom_object_scope(dict(custom_objects)):
            self.model = model_class.from_config(dict(config))
        self.loss = keras.losses.get(loss) if isinstance(loss, (str, dict)) else loss
        self.shapes = [tuple(s) for s in shapes]
        self.tables = tables
        self.built = False

    def _build(self, x: Any) -> None:
        model = self.model
        if len(model.trainable_variables) != len(self.shapes):
            with replica_build(), lookup_feed(LookupFeed("build")), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # Keras's note on subclassed models without build()
                model(x)
        got = [tuple(v.shape) for v in model.trainable_variables]
        if got != self.shapes:
            raise RuntimeConfigError("worker replica weights", got,
                                     f"the model rebuilt from its config must have the chief's weights {self.shapes}")
        self.layers = table_layers(model)
        if len(self.layers) != self.tables:
            raise RuntimeConfigError("worker replica KubepsEmbedding layers", len(self.layers),
                                     f"the chief's model has {self.tables}")
        _check_non_trainable(model)
        self.non_trainable = [v.value for v in model.non_trainable_variables]
        self.initial = [v.value for v in model.trainable_variables]
        loss_fn, layers = self.loss, self.layers
        # as Keras's own trainer: ``training`` only for a call() that takes it
        kwargs = {"training": True} if model._call_has_training_arg else {}

        def ids_pass(trainable: Any, non_trainable: Any, x: Any) -> list[Any]:
            with lookup_feed(LookupFeed("ids")) as feed:
                model.stateless_call(trainable, non_trainable, x, **kwargs)
            return [feed.ids[id(layer)] for layer in layers]

        def loss_and_grads(trainable: Any, rows: Any, inverse: Any, non_trainable: Any, x: Any, y: Any,
                           sample_weight: Any) -> Any:
            def loss_of(trainable: Any, rows: Any) -> Any:
                feed = LookupFeed("rows", {id(layer): (r, i) for layer, r, i in zip(layers, rows, inverse)})
                with lookup_feed(feed):
                    y_pred, non_trainable_out, losses = model.stateless_call(
                        trainable, non_trainable, x, return_losses=True, **kwargs)
                if isinstance(loss_fn, keras.losses.Loss):
                    loss = loss_fn(y, y_pred) if sample_weight is None else loss_fn(y, y_pred, sample_weight=sample_weight)
                else:  # "mse" or a function: one loss per example, averaged over the batch as Keras's compile does
                    loss = loss_fn(y, y_pred)
                    loss = keras.ops.mean(loss if sample_weight is None else loss * sample_weight)
                for extra in losses:  # the layers' own losses (regularizers, add_loss), as Keras's fit adds them
                    loss = loss + extra
                return loss, non_trainable_out

            (loss, non_trainable_out), grads = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(
                trainable, rows)
            return loss, grads[0], grads[1], non_trainable_out

        self.ids_pass = jax.jit(ids_pass)
        self.loss_and_grads = jax.jit(loss_and_grads)
        self.built = True

    def run(self, iterator: Any, variables: Sequence[Variable | ShardedVariable],
            tables: Sequence[Variable | ShardedVariable], optimizer: Optimizer, steps: int) -> tuple[float, int]:
        """``steps`` training steps; ``(sum of the batch losses, examples)``."""
        total, examples = 0.0, 0
        for _ in range(steps):
            x, y, sample_weight = _unpack(next(iterator))
            if not self.built:
                self._build(x)
            rows, inverse, unique_ids = [], [], []
            if tables:
                for table, ids in zip(tables, self.ids_pass(self.initial, self.non_trainable, x)):
                    ids = np.asarray(ids)
                    unique, inv = np.unique(ids.reshape(-1), return_inverse=True)
                    # padded to one row per id: a fixed shape, so the gradient function compiles once
                    padded = np.zeros((ids.size,) + tuple(table.shape[1:]), dtype=table.dtype)
                    padded[: unique.size] = embedding_lookup(table, unique)  # carries the last step's push
                    rows.append(padded)
                    inverse.append(inv.reshape(ids.shape).astype(np.int32))
                    unique_ids.append(unique)
            values = [v.read_value() for v in variables]  # from the step's pull (cached)
            loss, grads, row_grads, self.non_trainable = self.loss_and_grads(
                values, rows, inverse, self.non_trainable, x, y, sample_weight)
            pairs: list[tuple[Any, Any]] = [(np.asarray(g), v) for g, v in zip(grads, variables)]
            pairs += [(IndexedSlices(np.asarray(g)[: u.size], u), t) for g, u, t in zip(row_grads, unique_ids, tables)]
            optimizer.apply_gradients(pairs)  # deferred: rides with the next step's reads
            total += float(loss)
            examples += len(np.asarray(y))
        return total, examples


class _ReplicaRef:
    """Stands for every worker's replica (as a per-worker dataset does): pickles as a reference that resolves, on
    a worker, to its own :class:`_Replica`."""

    def __init__(self, coordinator: Any, resource_id: str, values: Any):
        self.resource_id = resource_id
        self.values = values

    def __reduce__(self) -> tuple[Callable[[str], Any], tuple[str]]:
        return (resolve_resource, (self.resource_id,))


def _train_execution(replica: _Replica, iterator: Any, variables: list[Any], tables: list[Any],
                     optimizer: Optimizer, steps: int) -> tuple[float, int]:
    """What the coordinator schedules: ``steps`` steps on whichever worker runs it."""
    return replica.run(iterator, variables, tables, optimizer, steps)


def _plain(value: Any) -> Any:
    """A model config with Keras's tracked containers (``TrackedList``, ``TrackedDict``) made plain lists and dicts,
    which pickle (a tracked container does not unpickle)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _custom_objects(model: Any) -> dict[str, type]:
    """The classes of the model and its layers that are not Keras's own, by their registered names, so a worker
    can rebuild the model from its config (classes from ``__main__`` travel by value)."""
    found: dict[str, type] = {}
    for obj in [model, *model._flatten_layers(include_self=False)]:
        cls = type(obj)
        if not cls.__module__.startswith("keras."):
            found[keras.saving.get_registered_name(cls)] = cls
    return found


# -- the trainer ------------------------------------------------------------------------------------------------
class KerasTrainer:
    """A built Keras model's weights on the parameter servers, the kubeps optimizer that updates them there, and
    the training step the workers run; :meth:`fit` trains it. Created by :func:`fit`, or directly to keep the
    variables between ``fit`` calls."""

    def __init__(self, model: Any, coordinator: Any, *, optimizer: Any, loss: Any, steps_per_execution: int = 1):
        if not isinstance(model, keras.Model):
            raise RuntimeConfigError("model", type(model).__name__, "must be a keras.Model (Keras 3, JAX backend)")
        if not model.built or not model.trainable_variables:
            raise RuntimeConfigError("model", model.name,
                                     "build the model before fit, inside strategy.scope(): call it on a batch or "
                                     "model.build(input_shape); it must have trainable weights")
        for attr in ("schedule", "join", "create_per_worker_dataset", "create_per_worker_resource", "strategy"):
            if not hasattr(coordinator, attr):
                raise RuntimeConfigError("coordinator", type(coordinator).__name__,
                                         "must be a kubeps ClusterCoordinator")
        if isinstance(steps_per_execution, bool) or not isinstance(steps_per_execution, int) \
                or steps_per_execution < 1:
            raise RuntimeConfigError("steps_per_execution", steps_per_execution, "must be an integer >= 1")
        if loss is None:
            raise RuntimeConfigError("loss", None, "fit needs a loss: a Keras loss object, its name, or a function "
                                     "loss(y_true, y_pred)")
        if isinstance(loss, str):
            keras.losses.get(loss)  # an unknown name fails here, on the chief
        _check_non_trainable(model)
        self.model = model
        self.coordinator = coordinator
        self.optimizer = kubeps_optimizer(optimizer)
        self.loss = loss
        self.steps_per_execution = steps_per_execution
        self.step = StepCounter()  # training steps done (a checkpoint saves and restores it)
        self.steps_per_epoch: int | None = None
        self.total_steps: int | None = None
        self.stop_training = False
        self.layers = table_layers(model)
        tables = [layer.table for layer in self.layers]
        for layer, table in zip(self.layers, tables):
            shards = table.variables if isinstance(table, ShardedVariable) else [table]
            if not all(s.is_remote for s in shards):
                raise RuntimeConfigError(f"KubepsEmbedding {layer.name!r} table", table.name,
                                         "is local to this process: build the model inside strategy.scope()")
        keras_vars = list(model.trainable_variables)
        with coordinator.strategy.scope():
            weights = [Variable(np.asarray(v.value), name=v.path) for v in keras_vars]
        self.tables = tables
        self.weights = weights
        #: every weight by its Keras path (the tables by their variable names): what a checkpoint holds
        self.variables: dict[str, Variable | ShardedVariable] = {
            **{v.path: w for v, w in zip(keras_vars, weights)},
            **{t.name: t for t in tables},
        }
        spec = (type(model), _plain(model.get_config()), _custom_objects(model), loss,
                [tuple(v.shape) for v in keras_vars], len(tables))
        self.replica = coordinator.create_per_worker_resource(functools.partial(_Replica, *spec), "keras-model",
                                                              _ReplicaRef)

    def pull_weights(self) -> None:
        """Copy the weights from the parameter servers into the Keras model (the tables stay there: the model's
        ``KubepsEmbedding`` layers look their rows up)."""
        for keras_var, weight in zip(self.model.trainable_variables, self.weights):
            keras_var.assign(weight.read_value())

    def fit(self, dataset_fn: Any, *, epochs: int = 1, steps_per_epoch: int, callbacks: Iterable[Callback] = (),
            initial_epoch: int = 0, verbose: int = 1) -> History:
        """Train for ``epochs`` epochs of ``steps_per_epoch`` steps (from ``initial_epoch``, or from the step a
        callback restored), as ``model.fit`` with ``ParameterServerStrategy``; returns the :class:`History`."""
        for field, value, low in (("epochs", epochs, 1), ("steps_per_epoch", steps_per_epoch, 1),
                                  ("initial_epoch", initial_epoch, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RuntimeConfigError(field, value, f"must be an integer >= {low}")
        spx = self.steps_per_execution
        if steps_per_epoch % spx:
            raise RuntimeConfigError("steps_per_epoch", steps_per_epoch,
                                     f"must be a multiple of steps_per_execution={spx}")
        history = History()
        callback_list = CallbackList([*callbacks, history], self)
        for cb in callback_list:
            if cb.sync_every is not None and cb.sync_every % spx:
                raise RuntimeConfigError(f"{type(cb).__name__} save_freq", cb.sync_every,
                                         f"must be a multiple of steps_per_execution={spx}")
        self.steps_per_epoch, self.total_steps = steps_per_epoch, epochs * steps_per_epoch
        self.stop_training = False
        if self.step.value < initial_epoch * steps_per_epoch:
            self.step.assign(initial_epoch * steps_per_epoch)
        callback_list.on_train_begin()  # BackupAndRestore restores the variables and the step here
        start = self.step.value
        if start % spx:
            raise RuntimeConfigError("restored step", start, f"must be a multiple of steps_per_execution={spx}")
        iterator = iter(self.coordinator.create_per_worker_dataset(dataset_fn))
        for epoch in range(start // steps_per_epoch, epochs):
            if self.stop_training:
                break
            callback_list.on_epoch_begin(epoch)
            epoch_end = (epoch + 1) * steps_per_epoch
            loss_sum, examples, started, first = 0.0, 0, time.perf_counter(), self.step.value
            while self.step.value < epoch_end:
                step = self.step.value
                stop = min([epoch_end] + [(step // cb.sync_every + 1) * cb.sync_every
                                          for cb in callback_list if cb.sync_every])
                t0 = time.perf_counter()
                results = [self.coordinator.schedule(
                    _train_execution, args=(self.replica, iterator, self.weights, self.tables, self.optimizer, spx))
                    for _ in range((stop - step) // spx)]
                self.coordinator.join()
                chunk = [rv.fetch() for rv in results]
                chunk_loss, chunk_examples = sum(c[0] for c in chunk), sum(c[1] for c in chunk)
                loss_sum, examples = loss_sum + chunk_loss, examples + chunk_examples
                self.step.assign(stop)
                seconds = time.perf_counter() - t0
                callback_list.on_train_batch_end(stop, {
                    "loss": chunk_loss / (stop - step), "step": stop, "examples": chunk_examples,
                    "examples_per_s": chunk_examples / seconds if seconds > 0 else math.inf})
            seconds = time.perf_counter() - started
            logs = {"loss": loss_sum / max(1, self.step.value - first), "step": self.step.value, "examples": examples,
                    "examples_per_s": examples / seconds if seconds > 0 else math.inf}
            if verbose:
                print(f"epoch {epoch + 1}/{epochs}: loss {logs['loss']:.4f}  step {self.step.value}/"
                      f"{self.total_steps}  {logs['examples_per_s']:.0f} examples/s", flush=True)
            callback_list.on_epoch_end(epoch, logs)
        callback_list.on_train_end({"step": self.step.value})
        self.pull_weights()
        return history


def fit(model: Any, coordinator: Any, dataset_fn: Any, *, optimizer: Any, loss: Any, epochs: int = 1,
        steps_per_epoch: int, steps_per_execution: int = 1, callbacks: Iterable[Callback] = (),
        initial_epoch: int = 0, verbose: int = 1) -> History:
    """``model.fit`` with a parameter server: ``model`` is a built Keras 3 model (JAX backend) made inside
    ``coordinator.strategy.scope()``; ``dataset_fn(input_context)`` runs on every worker and yields ``(x, y)`` or
    ``(x, y, sample_weight)`` batches; ``optimizer`` a kubeps or Keras optimizer (:func:`kubeps_optimizer`);
    ``loss`` a Keras loss (object or name) or ``loss(y_true, y_pred)``. Returns the :class:`History` (its
    ``trainer`` holds the variables on the parameter servers); the trained weights are copied into ``model``."""
    trainer = KerasTrainer(model, coordinator, optimizer=optimizer, loss=loss, steps_per_execution=steps_per_execution)
    return trainer.fit(dataset_fn, epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks,
                       initial_epoch=initial_epoch, verbose=verbose)


def restore_weights(model: Any, values: Mapping[str, Any], prefix: str = "model/") -> None:
    """Load the weights of a checkpoint written by :class:`~kubeps.runtime.models.keras_callbacks.ModelCheckpoint`
    into a Keras model built the same way outside any strategy scope (its ``KubepsEmbedding`` tables are local):
    what a sidecar evaluator does with each checkpoint (``values``: the evaluator's ``CheckpointValues``, or any
    mapping from the checkpoint's variable names to arrays)."""
    for keras_var in model.trainable_variables:
        keras_var.assign(np.asarray(_value(values, prefix + keras_var.path)))
    for layer in table_layers(model):
        layer.table.assign(np.asarray(_value(values, prefix + layer.table.name)))


def _value(values: Mapping[str, Any], name: str) -> Any:
    try:
        return values[name]
    except KeyError:
        raise RuntimeConfigError("checkpoint variable", name,
                                 f"is not in the checkpoint; it holds {sorted(values)[:8]}: build the model the "
                                 "same way as the chief did") from None
