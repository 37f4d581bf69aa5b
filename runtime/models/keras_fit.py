"""``fit`` for Keras 3 models (JAX backend) with a parameter server, following ``model.fit`` with TensorFlow's
``ParameterServerStrategy``: a dataset function per worker, ``epochs``/``steps_per_epoch``, ``steps_per_execution``
steps per scheduled function, callbacks (:mod:`kubeps.runtime.models.keras_callbacks`).

* **The weights live on the parameter servers.** :class:`KerasTrainer` creates a kubeps ``Variable`` (sharded by
  the strategy's partitioner) from each trainable weight of the built Keras model, inside ``strategy.scope()``;
  the tables of :class:`~kubeps.runtime.models.keras_layers.KubepsEmbedding` layers are kubeps variables already.
* **A step on a worker.** Every worker deserializes the model once (Keras's ``get_config``/``from_config``, a
  per-worker resource) and jits two functions around Keras's own ``model.stateless_call``: the *ids* pass (what ids
  each ``KubepsEmbedding`` looks up) and ``jax.value_and_grad`` of the loss. A step runs the ids pass (or takes
  the ids from the batch when every table is called on a functional model's input as it is), fetches the
  batch's unique rows of every table and the dense weights in one round trip per parameter server (which also
  carries the previous step's push), computes the loss and the gradients, and hands them to
  ``optimizer.apply_gradients``: dense gradients and row-sparse ``IndexedSlices`` of the tables, pushed with the
  next step's reads. Nothing of Keras is forked.
* **The optimizer runs on the parameter servers**: a kubeps optimizer, or a Keras optimizer mapped to one
  (:func:`kubeps_optimizer`: SGD, Adagrad, Adam, AdamW, Ftrl, RMSprop, Adadelta, Nadam, Adamax, Lion, with their
  hyper-parameters and weight decay) and its learning-rate schedule to a kubeps schedule (:func:`kubeps_schedule`);
  Lamb, Adafactor, Muon, clipping and EMA are refused with the reason.
* **Keras's side of fit**: ``compile``'s optimizer, loss and metrics (metrics on the workers, validation on the
  chief: :mod:`~kubeps.runtime.models.keras_metrics`), ``class_weight``, Keras's own callbacks through their
  protocol (``model.optimizer.learning_rate`` is the kubeps optimizer's), the model's weights pulled before a hook
  that may read them, and the step a job resumed from on the workers' ``InputContext.initial_step``.
* **Non-trainable variables**: Keras's random-seed states (``Dropout``) stay on each worker (each has its own
  stream); any other non-trainable variable (``BatchNormalization`` statistics) is refused with an error naming it.

Rule: imports keras and jax (through :mod:`keras_layers`); reaches the coordinator only through the object it is
given (``schedule``, ``join``, ``create_per_worker_dataset``, ``create_per_worker_resource``, ``strategy``).
"""

from __future__ import annotations

import functools
import gc
import math
import time
import types
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from kubeps.runtime.checks import NonNegativeInt, PositiveInt, check, number
from kubeps.runtime.checkpoint.saveables import StepCounter
from kubeps.runtime.data.options import InputContext
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.models.keras_callbacks import Callback, CallbackList, History
from kubeps.runtime.models.keras_layers import KubepsEmbedding, LookupFeed, keras, lookup_feed, replica_build
from kubeps.runtime.models.keras_metrics import (MetricTotals, Validation, batch_loss, check_class_weight, class_weights,
                                                 metric_specs, resolve_metrics, unpack)
from kubeps.runtime.ops.optimizers import (SGD, Adadelta, Adagrad, Adam, Adamax, AdamW, Ftrl, Lion, Momentum, Nadam,
                                           Optimizer, RMSprop)
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.ops.schedules import (CosineDecay, CosineDecayRestarts, ExponentialDecay, InverseTimeDecay,
                                          LearningRateSchedule, PiecewiseConstantDecay, PolynomialDecay)
from kubeps.runtime.variables.context import resolve_resource
from kubeps.runtime.variables.indexed_slices import IndexedSlices
from kubeps.runtime.variables.variable import ShardedVariable, Variable, gather_padded_rows

import jax  # after keras_layers: the backend is set

__all__ = ["KerasTrainer", "fit", "kubeps_optimizer", "kubeps_schedule", "restore_weights", "table_layers"]

#: Keras optimizer settings kubeps cannot apply on the parameter servers, with the value that means "off"
_UNSUPPORTED_OPTIMIZER_SETTINGS = {"clipnorm": None, "clipvalue": None, "global_clipnorm": None, "use_ema": False,
                                   "loss_scale_factor": None, "gradient_accumulation_steps": None}
#: Keras optimizers kubeps maps, with the keys of their config the kubeps optimizer takes (besides the rate and
#: ``weight_decay``)
_KERAS_OPTIMIZERS: dict[str, tuple[type[Optimizer], tuple[str, ...]]] = {
    "Adagrad": (Adagrad, ("initial_accumulator_value", "epsilon")),
    "Adam": (Adam, ("beta_1", "beta_2", "epsilon", "amsgrad")),
    "AdamW": (AdamW, ("beta_1", "beta_2", "epsilon", "amsgrad")),
    "Ftrl": (Ftrl, ("learning_rate_power", "initial_accumulator_value", "l1_regularization_strength",
                    "l2_regularization_strength", "l2_shrinkage_regularization_strength", "beta")),
    "RMSprop": (RMSprop, ("rho", "momentum", "epsilon", "centered")),
    "Adadelta": (Adadelta, ("rho", "epsilon")),
    "Nadam": (Nadam, ("beta_1", "beta_2", "epsilon")),
    "Adamax": (Adamax, ("beta_1", "beta_2", "epsilon")),
    "Lion": (Lion, ("beta_1", "beta_2")),
}
#: Keras optimizers kubeps refuses, and why
_REFUSED_OPTIMIZERS = {
    "Lamb": "its trust ratio divides by the norm of the whole variable, which no single parameter server holds "
            "when the variable is sharded",
    "Adafactor": "its factored second moments and relative step size are reduced over whole rows and columns of the "
                 "variable, which no single parameter server holds when the variable is sharded",
    "Muon": "it orthogonalizes whole weight matrices, which no single parameter server holds when they are sharded",
    "ScheduleFreeAdamW": "it trains one sequence of weights and evaluates another, which kubeps's fit does not keep",
    "LossScaleOptimizer": "loss scaling is for float16 training; kubeps's workers compute in float32",
    "MultiOptimizer": "it applies several optimizers to different variables; a kubeps fit pushes every gradient with "
                      "one optimizer",
}
#: Keras learning-rate schedules kubeps maps to its own (the same formulas, evaluated on the parameter servers)
_KERAS_SCHEDULES: dict[str, tuple[type[LearningRateSchedule], tuple[str, ...]]] = {
    "ExponentialDecay": (ExponentialDecay, ("initial_learning_rate", "decay_steps", "decay_rate", "staircase")),
    "InverseTimeDecay": (InverseTimeDecay, ("initial_learning_rate", "decay_steps", "decay_rate", "staircase")),
    "PiecewiseConstantDecay": (PiecewiseConstantDecay, ("boundaries", "values")),
    "PolynomialDecay": (PolynomialDecay, ("initial_learning_rate", "decay_steps", "end_learning_rate", "power",
                                          "cycle")),
    "CosineDecay": (CosineDecay, ("initial_learning_rate", "decay_steps", "alpha", "warmup_target", "warmup_steps")),
    "CosineDecayRestarts": (CosineDecayRestarts, ("initial_learning_rate", "first_decay_steps", "t_mul", "m_mul",
                                                  "alpha")),
}
#: Keras non-trainable variables that stay on each worker: the state of a ``SeedGenerator`` (``Dropout``'s)
_WORKER_LOCAL_STATE = "seed_generator_state"


# -- optimizers ---------------------------------------------------------------------------------------------------
def kubeps_optimizer(optimizer: Any) -> Optimizer:
    """A kubeps optimizer as it is; a Keras optimizer (object or name) mapped to the kubeps optimizer with the same
    update: ``SGD`` (``Momentum`` when ``momentum > 0``), ``Adagrad``, ``Adam``, ``AdamW``, ``Ftrl``, ``RMSprop``,
    ``Adadelta``, ``Nadam``, ``Adamax``, ``Lion``, with their hyper-parameters, ``weight_decay`` and a Keras
    learning-rate schedule (:func:`kubeps_schedule`).

    Refused, with the reason: ``Lamb``, ``Adafactor``, ``Muon``, ``ScheduleFreeAdamW``, ``LossScaleOptimizer`` and
    ``MultiOptimizer``; clipping, EMA, loss scaling, gradient accumulation and ``exclude_from_weight_decay``. Keras's
    ``Adagrad`` adds ``epsilon`` under the square root, kubeps's (TensorFlow's kernel) outside it: the same update
    up to that ``epsilon``."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise RuntimeConfigError("optimizer", type(optimizer).__name__,
                                 "allowed: a kubeps optimizer (kubeps.runtime.Adagrad(...)) or a Keras optimizer "
                                 "(keras.optimizers.Adagrad(...) or its name)")
    kind = type(optimizer).__name__
    if kind in _REFUSED_OPTIMIZERS:
        raise RuntimeConfigError("optimizer", kind, f"kubeps cannot run it on the parameter servers: "
                                 f"{_REFUSED_OPTIMIZERS[kind]}; allowed: {', '.join(['SGD', *_KERAS_OPTIMIZERS])}")
    if kind != "SGD" and kind not in _KERAS_OPTIMIZERS:
        raise RuntimeConfigError("optimizer", kind, f"allowed Keras optimizers: {', '.join(['SGD', *_KERAS_OPTIMIZERS])}"
                                 f", the ones whose update kubeps runs on the parameter servers (or pass a kubeps "
                                 f"optimizer)")
    schedule = optimizer._learning_rate  # the schedule object (get_config holds only its serialized form)
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        schedule = kubeps_schedule(schedule)  # first: get_config fails on a schedule without one
    config = optimizer.get_config()
    for key, off in _UNSUPPORTED_OPTIMIZER_SETTINGS.items():
        if config.get(key, off) not in (off, 0, 0.0) or (off is None and config.get(key) not in (None, 0, 0.0)):
            raise RuntimeConfigError(f"optimizer {kind} {key}", config.get(key),
                                     f"kubeps applies the optimizer on the parameter servers without {key}; "
                                     f"allowed: {off}")
    if getattr(optimizer, "_exclude_from_weight_decay", None) or \
            getattr(optimizer, "_exclude_from_weight_decay_pattern", None) is not None:
        raise RuntimeConfigError(f"optimizer {kind} exclude_from_weight_decay", "set",
                                 "kubeps pushes every gradient with one optimizer, so weight decay applies to every "
                                 "variable; allowed: no exclusions (or weight_decay=None)")
    if isinstance(schedule, LearningRateSchedule):
        lr: float | LearningRateSchedule = schedule
    else:
        lr = _float32(f"optimizer {kind} learning_rate", config.get("learning_rate"))
    decay = config.get("weight_decay")
    weight_decay = None if decay is None else _float32(f"optimizer {kind} weight_decay", decay)
    if kind == "SGD":
        momentum = float(config.get("momentum", 0.0))
        if momentum:
            return Momentum(lr, momentum, bool(config.get("nesterov", False)), weight_decay=weight_decay)
        return SGD(lr, weight_decay=weight_decay)
    cls, keys = _KERAS_OPTIMIZERS[kind]
    if kind == "AdamW" and weight_decay is None:
        cls = Adam  # Keras's AdamW with weight_decay=None is Adam
    try:
        return cls(lr, **{k: config[k] for k in keys}, weight_decay=weight_decay)
    except ValueError as err:
        raise RuntimeConfigError(f"optimizer {kind}", config, str(err)) from None


def kubeps_schedule(schedule: Any) -> LearningRateSchedule:
    """The kubeps schedule with the formula of a Keras learning-rate schedule (``ExponentialDecay``,
    ``InverseTimeDecay``, ``PiecewiseConstantDecay``, ``PolynomialDecay``, ``CosineDecay``, ``CosineDecayRestarts``):
    the parameter servers evaluate it at each update's step, Keras's ``optimizer.iterations``, so update ``k + 1``
    uses ``schedule(k)`` as in Keras (in float64 where Keras computes in float32).

    Refused, with the reason: a subclass of Keras's ``LearningRateSchedule`` (or of one of those), whose Python
    ``__call__`` the parameter servers cannot run."""
    kind = type(schedule).__name__
    known = _KERAS_SCHEDULES.get(kind)
    if known is None or type(schedule) is not getattr(keras.optimizers.schedules, kind):
        raise RuntimeConfigError("optimizer learning_rate", kind,
                                 "the parameter servers evaluate the learning rate at each update and cannot run a "
                                 "schedule's Python code; allowed: Keras's "
                                 f"{', '.join(_KERAS_SCHEDULES)} (or a constant rate, changed by "
                                 "LearningRateScheduler or ReduceLROnPlateau)")
    cls, keys = known
    config = schedule.get_config()
    args = {k: config[k] for k in keys if k in config}
    for k in ("decay_steps", "first_decay_steps", "warmup_steps"):
        if k in args:
            args[k] = _whole(f"{kind} {k}", args[k])
    if "boundaries" in args:  # steps are whole: step <= b exactly when step <= floor(b)
        args["boundaries"] = [math.floor(float(b)) for b in args["boundaries"]]
    try:
        return cls(**args)
    except ValueError as err:
        raise RuntimeConfigError(f"optimizer learning_rate {kind}", config, str(err)) from None


def _float32(field: str, value: Any) -> float:
    """A Keras hyper-parameter as Keras keeps it, float32, written back as the shortest float (0.1, not
    0.10000000149011612)."""
    return float(str(np.float32(check(field, value, number()))))


_WHOLE_STEPS = "a whole number of steps (kubeps's schedules take no fractions)"


def _whole(field: str, value: Any) -> int:
    steps = check(field, value, number(), allowed=_WHOLE_STEPS)
    if steps != math.floor(steps):
        raise RuntimeConfigError(field, value, _WHOLE_STEPS)
    return int(steps)


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
        self.metric_specs: list[Any] = []
        self.metrics: list[Any] | None = None  # resolved against the first batch, as Keras's compile does
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
                return batch_loss(loss_fn, y, y_pred, sample_weight, losses), (non_trainable_out, y_pred)

            (loss, (non_trainable_out, y_pred)), grads = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(
                trainable, rows)
            return loss, grads[0], grads[1], non_trainable_out, y_pred

        def update_metrics(states: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
            return [m.stateless_update_state(s, y, y_pred, sample_weight=sample_weight)
                    for m, s in zip(self.metrics or [], states)]

        self.ids_pass = jax.jit(ids_pass)
        self.loss_and_grads = jax.jit(loss_and_grads)
        self.update_metrics = jax.jit(update_metrics)
        self.direct = self._direct_ids(x)
        self.built = True
        # Keras, jax and the compiled step are built for good: leave them out of the collector's full passes, which
        # otherwise walk every one of their objects every few hundred steps (6% of a worker's CPU on the CTR bench).
        # The garbage of the moment is collected first, so nothing unreachable is frozen with them.
        gc.collect()
        gc.freeze()

    def _direct_ids(self, x: Any) -> list[int] | None:
        """Where each ``KubepsEmbedding``'s ids are in a batch's inputs when every one is called on an input of a
        functional model as it is (the common case): a step then takes them from the batch, without the ids pass
        (one jitted call and its transfers less per step). Checked against the ids pass on the first batch; None,
        the ids pass at every step, for any other model."""
        inputs = list(getattr(self.model, "inputs", None) or [])
        struct = getattr(self.model, "_inputs_struct", None)  # a functional model's inputs, as it was built
        if not (isinstance(struct, (list, tuple)) or len(inputs) == 1) or _flat_inputs(x, inputs) is None:
            return None
        positions = []
        for layer in self.layers:
            nodes = getattr(layer, "_inbound_nodes", [])
            tensors = list(nodes[0].input_tensors) if len(nodes) == 1 else []
            found = [i for i, t in enumerate(inputs) if len(tensors) == 1 and t is tensors[0]]
            if len(found) != 1:
                return None
            positions.append(found[0])
        flat = _flat_inputs(x, inputs) or []
        traced = self.ids_pass(self.initial, self.non_trainable, x)
        for p, calls in zip(positions, traced):
            mine = np.asarray(flat[p])
            if (len(calls) != 1 or mine.dtype.kind not in "iu" or mine.shape != tuple(calls[0].shape)
                    or not np.array_equal(mine, calls[0])):
                return None
        return positions

    def _ids(self, x: Any) -> list[list[np.ndarray]]:
        """The ids of each call of each table's layer in batch ``x``: from the batch itself (:meth:`_direct_ids`)
        or from the ids pass."""
        if self.direct is not None:
            flat = _flat_inputs(x, self.model.inputs)
            if flat is not None:
                ids = [np.asarray(flat[p]) for p in self.direct]
                if all(i.dtype.kind in "iu" for i in ids):
                    return [[i] for i in ids]
        return [[np.asarray(ids) for ids in calls] for calls in self.ids_pass(self.initial, self.non_trainable, x)]

    def run(self, iterator: Any, variables: Sequence[Variable | ShardedVariable],
            tables: Sequence[Variable | ShardedVariable], optimizer: Optimizer, steps: int,
            metrics: Sequence[Any] = (), class_weight: Mapping[int, float] | None = None) -> "StepsResult":
        """``steps`` training steps; ``(sum of the batch losses, examples, metric configs, metric states)``: the
        states of the training ``metrics`` (specs: :func:`~kubeps.runtime.models.keras_metrics.metric_specs`) over
        these steps, from their initial values, which the chief adds up."""
        if list(metrics) != self.metric_specs:
            self.metric_specs, self.metrics = list(metrics), None
        total, examples, states = 0.0, 0, None
        for _ in range(steps):
            x, y, sample_weight = unpack(next(iterator))
            sample_weight = class_weights(class_weight, y, sample_weight)
            if not self.built:
                self._build(x)
            rows, inverse, unique_ids = [], [], []
            if tables:
                for table, layer, calls in zip(tables, self.layers, self._ids(x)):
                    unique, inv, padded = _gather_calls(table, calls, layer.combiner is not None)
                    rows.append(padded)
                    inverse.append(inv)
                    unique_ids.append(unique)
            values = [v.read_value() for v in variables]  # from the step's pull (cached)
            loss, grads, row_grads, self.non_trainable, y_pred = self.loss_and_grads(
                values, rows, inverse, self.non_trainable, x, y, sample_weight)
            if self.metric_specs:
                if self.metrics is None:
                    self.metrics = resolve_metrics(self.metric_specs, y, y_pred)
                if states is None:
                    states = [[v.value for v in m.variables] for m in self.metrics]
                states = self.update_metrics(states, y, y_pred, sample_weight)
            loss, grads, row_grads = jax.device_get((loss, grads, row_grads))  # to numpy in one call
            pairs: list[tuple[Any, Any]] = list(zip(grads, variables))
            pairs += [(IndexedSlices(g[: u.size], u), t) for g, u, t in zip(row_grads, unique_ids, tables)]
            optimizer.apply_gradients(pairs)  # deferred: rides with the next step's reads
            total += float(loss)
            examples += len(np.asarray(y))
        if states is None:
            return total, examples, [], []
        configs = [keras.metrics.serialize(m) for m in self.metrics or []]
        return total, examples, configs, [[np.asarray(v) for v in state] for state in states]


def _gather_calls(table: Variable | ShardedVariable, calls: Sequence[np.ndarray],
                  padding: bool) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """One pull for every call of a table's layer in a step (one call per parameter server, carrying the last
    step's push): ``(unique, [inverse of each call], rows)``, each distinct id pulled once; -1 is padding (a zero
    row, never pulled) for a layer with a combiner."""
    flat = np.concatenate([c.reshape(-1) for c in calls]) if len(calls) > 1 else calls[0]
    unique, inverse, rows = gather_padded_rows(table, flat, padding=padding)
    if len(calls) == 1:
        return unique, [inverse], rows
    bounds = np.cumsum([c.size for c in calls])[:-1]
    return unique, [part.reshape(c.shape) for part, c in zip(np.split(inverse, bounds), calls)], rows


def _flat_inputs(x: Any, inputs: Sequence[Any]) -> list[Any] | None:
    """A batch's inputs as a list in the order of the model's ``inputs``: ``x`` itself when it is a list or tuple of
    that length, ``[x]`` for a one-input model given one array; None for anything else (a dict, nested inputs)."""
    if isinstance(x, (list, tuple)):
        return list(x) if len(x) == len(inputs) else None
    return [x] if len(inputs) == 1 and hasattr(x, "shape") else None


#: dataset functions fit wraps to pass the resumed step (a DistributedDataset or PerWorkerDataset goes as it is)
_FUNCTION_TYPES = (types.FunctionType, functools.partial)
#: what a scheduled function returns: loss sum, examples, metric configs, metric states
StepsResult = tuple[float, int, list[Any], list[list[np.ndarray]]]


class _ReplicaRef:
    """Stands for every worker's replica (as a per-worker dataset does): pickles as a reference that resolves, on
    a worker, to its own :class:`_Replica`."""

    def __init__(self, coordinator: Any, resource_id: str, values: Any):
        self.resource_id = resource_id
        self.values = values

    def __reduce__(self) -> tuple[Callable[[str], Any], tuple[str]]:
        return (resolve_resource, (self.resource_id,))


def _train_execution(replica: _Replica, iterator: Any, variables: list[Any], tables: list[Any],
                     optimizer: Optimizer, steps: int, metrics: Sequence[Any] = (),
                     class_weight: Mapping[int, float] | None = None) -> StepsResult:
    """What the coordinator schedules: ``steps`` steps on whichever worker runs it."""
    return replica.run(iterator, variables, tables, optimizer, steps, metrics, class_weight)


class _ResumedDatasetFn:
    """``dataset_fn`` called with an ``InputContext`` whose ``initial_step`` is the step ``fit`` starts from (the
    step ``BackupAndRestore`` restored), so a worker's dataset can skip what the lost run consumed; a
    ``dataset_fn()`` without arguments is called as it is. Carries the user function's ``__module__`` so the
    coordinator ships the user's module by value, as it does for the bare function."""

    def __init__(self, dataset_fn: Callable[..., Any], initial_step: int):
        self.dataset_fn = dataset_fn
        self.initial_step = initial_step
        self.__module__ = getattr(dataset_fn, "__module__", __name__)

    def __call__(self, input_context: Any) -> Any:
        import inspect  # noqa: PLC0415 - once per worker

        try:
            takes_context = any(p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                                    p.POSITIONAL_OR_KEYWORD)
                                for p in inspect.signature(self.dataset_fn).parameters.values())
        except (TypeError, ValueError):
            takes_context = True
        if not takes_context:
            return self.dataset_fn()
        return self.dataset_fn(InputContext(input_context.num_input_pipelines, input_context.input_pipeline_id,
                                            input_context.num_replicas_in_sync, initial_step=self.initial_step))


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
class _OptimizerView:
    """``model.optimizer`` while kubeps's ``fit`` runs, for Keras's callbacks: ``learning_rate`` reads the kubeps
    optimizer's rate (at the current step, for a schedule) and setting it (``ReduceLROnPlateau``,
    ``LearningRateScheduler``) sets the kubeps optimizer's constant rate, which the next scheduled function carries
    to the workers and their pushes to the parameter servers (where the update runs; the slots are kept)."""

    def __init__(self, trainer: "KerasTrainer"):
        self._trainer = trainer

    @property
    def learning_rate(self) -> float:
        return float(self._trainer.optimizer.lr_at(int(self._trainer.step.value) + 1))  # the next update's

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        optimizer = self._trainer.optimizer
        if not isinstance(optimizer.learning_rate, (int, float)):
            raise RuntimeConfigError("optimizer learning_rate", type(optimizer.learning_rate).__name__,
                                     "a callback cannot set the rate of an optimizer with a schedule: use a constant "
                                     "rate with ReduceLROnPlateau/LearningRateScheduler, or the schedule alone")
        optimizer.learning_rate = optimizer._check_learning_rate(float(np.asarray(value)))

    @property
    def iterations(self) -> int:
        return int(self._trainer.step.value)


#: Keras callbacks that need Keras's trainer, with the kubeps callback that does their work
_KERAS_REPLACED = {"ModelCheckpoint": "keras_callbacks.ModelCheckpoint", "BackupAndRestore":
                   "keras_callbacks.BackupAndRestore", "TensorBoard": "keras_callbacks.TensorBoard"}
#: keys of fit's logs that are bookkeeping, not metrics: Keras's callbacks (CSVLogger, ProgbarLogger) see the rest
_BOOKKEEPING = ("step", "examples", "examples_per_s")


class _KerasCallbacks(Callback):
    """Keras's own callbacks (``keras.callbacks.Callback`` subclasses: ``EarlyStopping``, ``CSVLogger``,
    ``LambdaCallback``, ``ProgbarLogger``, ``ReduceLROnPlateau``, ``TerminateOnNaN``, the user's) called through
    Keras's protocol: ``set_model`` (the chief's model, its weights pulled before every hook), ``set_params``
    (``epochs``, ``steps``, ``verbose``), ``on_train_batch_begin/end`` with the batch index in the epoch, and
    ``self.model.stop_training`` honoured after every hook."""

    def __init__(self, callbacks: Sequence[Any], epochs: int, steps_per_epoch: int, verbose: int):
        super().__init__()
        for cb in callbacks:
            name = type(cb).__name__
            if isinstance(cb, (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore,
                               keras.callbacks.TensorBoard)):
                raise RuntimeConfigError("callbacks", f"keras.callbacks.{name}",
                                         f"needs Keras's own trainer and weights in the process: use "
                                         f"kubeps.runtime.models.{_KERAS_REPLACED[name]}")
            if isinstance(cb, keras.callbacks.EarlyStopping) and cb.restore_best_weights:
                raise RuntimeConfigError("EarlyStopping restore_best_weights", True,
                                         "the weights live on the parameter servers (the tables are not in "
                                         "get_weights): keep it False and load the best checkpoint of a "
                                         "ModelCheckpoint instead")
        self.callbacks = list(callbacks)
        self.params = {"epochs": epochs, "steps": steps_per_epoch, "verbose": verbose}

    def set_trainer(self, trainer: Any) -> None:
        super().set_trainer(trainer)
        for cb in self.callbacks:
            cb.set_model(trainer.model)
            cb.set_params(dict(self.params))

    def _epoch_batch(self, step: int) -> int:
        return (step - 1) % self.trainer.steps_per_epoch

    @staticmethod
    def _metrics(logs: dict[str, Any] | None) -> dict[str, Any]:
        return {k: v for k, v in (logs or {}).items() if k not in _BOOKKEEPING}

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        for cb in self.callbacks:
            cb.on_train_begin(self._metrics(logs))

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        for cb in self.callbacks:
            cb.on_epoch_begin(epoch, self._metrics(logs))

    def on_train_batch_begin(self, step: int, logs: dict[str, Any] | None = None) -> None:
        for cb in self.callbacks:
            cb.on_train_batch_begin(self._epoch_batch(step + 1), self._metrics(logs))

    def on_train_batch_end(self, step: int, logs: dict[str, Any] | None = None) -> None:
        for cb in self.callbacks:
            cb.on_train_batch_end(self._epoch_batch(step), self._metrics(logs))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        metrics = self._metrics(logs)
        for cb in self.callbacks:
            cb.on_epoch_end(epoch, metrics)
        if logs is not None:
            logs.update(metrics)  # ReduceLROnPlateau adds learning_rate: the History keeps it, as Keras's does

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        for cb in self.callbacks:
            cb.on_train_end(self._metrics(logs))


class _TableWeight:
    """A table's shape and dtype, for ``model.summary()``'s totals (the rows stay on the parameter servers)."""

    def __init__(self, table: Any):
        self.shape, self.dtype = tuple(table.shape), table.dtype


def _check_model(model: Any, coordinator: Any) -> None:
    """Refuse what ``KerasTrainer`` cannot train: not a built Keras model with weights, or no kubeps coordinator."""
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


def _compiled_arguments(model: Any, optimizer: Any, loss: Any, metrics: Any) -> tuple[Any, Any, Any]:
    """``optimizer``, ``loss`` and ``metrics``, each defaulting to the model's ``compile`` argument; refused when
    there is no optimizer or loss (or the loss's name is unknown to Keras)."""
    compiled = getattr(model, "_compile_config", None)
    compiled = compiled.config if compiled is not None and getattr(model, "compiled", False) else {}
    optimizer = compiled.get("optimizer") if optimizer is None else optimizer
    loss = compiled.get("loss") if loss is None else loss
    metrics = compiled.get("metrics") if metrics is None else metrics
    if optimizer is None:
        raise RuntimeConfigError("optimizer", None, "fit needs an optimizer: pass optimizer= or compile the "
                                 "model with one (a kubeps or Keras optimizer)")
    if loss is None:
        raise RuntimeConfigError("loss", None, "fit needs a loss: a Keras loss object, its name, or a function "
                                 "loss(y_true, y_pred) (fit(loss=...) or model.compile(loss=...))")
    if isinstance(loss, str):
        keras.losses.get(loss)  # an unknown name fails here, on the chief
    return optimizer, loss, metrics


def _compile_for_evaluate(model: Any, optimizer: Any, loss: Any, metrics: Any) -> None:
    """Compile a model ``fit`` was given its loss and metrics for, so that ``model.evaluate`` works after ``fit`` as
    after Keras's own (a compiled model keeps its ``compile``: fit's arguments only add to what it lacked). The
    optimizer is Keras's when fit was given one, else none: the parameter servers' optimizer trains the model."""
    if getattr(model, "compiled", False):
        return
    model.compile(optimizer=optimizer if isinstance(optimizer, keras.optimizers.Optimizer) else None, loss=loss,
                  metrics=metrics)


def _remote_tables(layers: list[KubepsEmbedding]) -> list[Any]:
    """The tables of the model's ``KubepsEmbedding`` layers, refused when one was built outside the strategy's
    scope (it would live in this process, not on the parameter servers)."""
    tables = [layer.table for layer in layers]
    for layer, table in zip(layers, tables):
        shards = table.variables if isinstance(table, ShardedVariable) else [table]
        if not all(s.is_remote for s in shards):
            raise RuntimeConfigError(f"KubepsEmbedding {layer.name!r} table", table.name,
                                     "is local to this process: build the model inside strategy.scope()")
    return tables


class KerasTrainer:
    """A built Keras model's weights on the parameter servers, the kubeps optimizer that updates them there, and
    the training step the workers run; :meth:`fit` trains it. Created by :func:`fit`, or directly to keep the
    variables between ``fit`` calls. ``optimizer``, ``loss`` and ``metrics`` default to the model's ``compile``
    arguments."""

    def __init__(self, model: Any, coordinator: Any, *, optimizer: Any = None, loss: Any = None,
                 metrics: Any = None, steps_per_execution: int = 1):
        _check_model(model, coordinator)
        self.steps_per_execution = check("steps_per_execution", steps_per_execution, PositiveInt)
        optimizer, loss, metrics = _compiled_arguments(model, optimizer, loss, metrics)
        _compile_for_evaluate(model, optimizer, loss, metrics)
        _check_non_trainable(model)
        self._model = model
        self._stale = False
        self.coordinator = coordinator
        self.optimizer = kubeps_optimizer(optimizer)
        self.loss = loss
        self.loss_fn = keras.losses.get(loss) if isinstance(loss, (str, dict)) else loss
        self.metrics = metric_specs(metrics)
        self.step = StepCounter()  # training steps done (a checkpoint saves and restores it)
        self.steps_per_epoch: int | None = None
        self.total_steps: int | None = None
        self.stop_training = False
        self.layers = table_layers(model)
        self.tables = tables = _remote_tables(self.layers)
        keras_vars = list(model.trainable_variables)
        with coordinator.strategy.scope():
            self.weights = weights = [Variable(np.asarray(v.value), name=v.path) for v in keras_vars]
        #: every weight by its Keras path (the tables by their variable names): what a checkpoint holds
        self.variables: dict[str, Variable | ShardedVariable] = {
            **{v.path: w for v, w in zip(keras_vars, weights)},
            **{t.name: t for t in tables},
        }
        # model.summary() totals: Keras counts `_collected_trainable_weights` when a model has it (its only hook);
        # set around Keras's attribute tracking, which would wrap the list
        object.__setattr__(model, "_collected_trainable_weights",
                           [*keras_vars, *(_TableWeight(t) for t in tables)])
        spec = (type(model), _plain(model.get_config()), _custom_objects(model), loss,
                [tuple(v.shape) for v in keras_vars], len(tables))
        self.replica = coordinator.create_per_worker_resource(functools.partial(_Replica, *spec), "keras-model",
                                                              _ReplicaRef)

    @property
    def settings(self) -> TaskSettings:
        """The chief's settings: those its strategy read (the callbacks' log dir and checkpoint roots)."""
        settings: TaskSettings = self.coordinator.strategy.settings
        return settings

    @property
    def model(self) -> Any:
        """The Keras model, its dense weights pulled from the parameter servers when training moved them since the
        last pull (its ``KubepsEmbedding`` layers read their rows from the parameter servers)."""
        if self._stale:
            self.pull_weights()
        return self._model

    def pull_weights(self) -> None:
        """Copy the weights from the parameter servers into the Keras model (the tables stay there: the model's
        ``KubepsEmbedding`` layers look their rows up)."""
        for keras_var, weight in zip(self._model.trainable_variables, self.weights):
            keras_var.assign(weight.read_value())
        self._stale = False

    def fit(self, dataset_fn: Any, *, epochs: int = 1, steps_per_epoch: int, callbacks: Iterable[Any] = (),
            initial_epoch: int = 0, verbose: int = 1, validation_data: Any = None,
            validation_steps: int | None = None, validation_freq: int = 1, validation_batch_size: int | None = None,
            class_weight: Mapping[int, float] | None = None) -> History:
        """Train for ``epochs`` epochs of ``steps_per_epoch`` steps (from ``initial_epoch``, or from the step a
        callback restored), as ``model.fit`` with ``ParameterServerStrategy``; returns the :class:`History`."""
        check("epochs", epochs, PositiveInt)
        check("steps_per_epoch", steps_per_epoch, PositiveInt)
        check("initial_epoch", initial_epoch, NonNegativeInt)
        spx = self.steps_per_execution
        if steps_per_epoch % spx:
            raise RuntimeConfigError("steps_per_epoch", steps_per_epoch,
                                     f"must be a multiple of steps_per_execution={spx}")
        class_weight = check_class_weight(class_weight)
        validation = None if validation_data is None else Validation(
            self._model, self.loss_fn, self.metrics, validation_data, validation_steps, validation_freq,
            validation_batch_size)
        history = History()
        ours = [cb for cb in callbacks if isinstance(cb, Callback)]
        theirs = [cb for cb in callbacks if isinstance(cb, keras.callbacks.Callback)]
        for i, cb in enumerate(callbacks):
            if not isinstance(cb, (Callback, keras.callbacks.Callback)):
                raise RuntimeConfigError(f"callbacks[{i}]", type(cb).__name__,
                                         "must be a keras.callbacks.Callback or a "
                                         "kubeps.runtime.models.keras_callbacks.Callback")
        if theirs:  # first: EarlyStopping decides before a checkpoint callback saves the epoch (then as final)
            ours.insert(0, _KerasCallbacks(theirs, epochs, steps_per_epoch, verbose))
        self.steps_per_epoch, self.total_steps = steps_per_epoch, epochs * steps_per_epoch
        callback_list = CallbackList([*ours, history], self)
        for cb in callback_list:
            if cb.sync_every is not None and cb.sync_every % spx:
                raise RuntimeConfigError(f"{type(cb).__name__} save_freq", cb.sync_every,
                                         f"must be a multiple of steps_per_execution={spx}")
        # a callback other than kubeps's checkpoints and writers may read the model: pull before every hook
        reads_model = any(cb.reads_model for cb in callback_list)
        self.stop_training = False
        self._model.stop_training = False
        saved_optimizer = self._model.__dict__.get("optimizer")
        object.__setattr__(self._model, "optimizer", _OptimizerView(self))  # what Keras's callbacks adjust
        try:
            self._fit(dataset_fn, epochs, steps_per_epoch, initial_epoch, verbose, callback_list, validation,
                      class_weight, reads_model)
        finally:
            object.__setattr__(self._model, "optimizer", saved_optimizer)
        return history

    @property
    def stopping(self) -> bool:
        """Whether a callback asked ``fit`` to stop (``stop_training`` on the trainer or on the Keras model)."""
        return self._stopping()

    def _stopping(self) -> bool:
        if getattr(self._model, "stop_training", False):  # Keras's callbacks (EarlyStopping) set it on the model
            self.stop_training = True
        return self.stop_training

    def _fit(self, dataset_fn: Any, epochs: int, steps_per_epoch: int, initial_epoch: int, verbose: int,
             callback_list: CallbackList, validation: Validation | None, class_weight: dict[int, float] | None,
             reads_model: bool) -> None:
        spx = self.steps_per_execution
        if self.step.value < initial_epoch * steps_per_epoch:
            self.step.assign(initial_epoch * steps_per_epoch)
        self._stale = True
        callback_list.on_train_begin()  # BackupAndRestore restores the variables and the step here
        self._stale = True
        start = self.step.value
        if start % spx:
            raise RuntimeConfigError("restored step", start, f"must be a multiple of steps_per_execution={spx}")
        if callable(dataset_fn) and isinstance(dataset_fn, _FUNCTION_TYPES):
            dataset_fn = _ResumedDatasetFn(dataset_fn, start)  # the step reaches the workers' InputContext
        iterator = iter(self.coordinator.create_per_worker_dataset(dataset_fn))
        totals = MetricTotals()
        for epoch in range(start // steps_per_epoch, epochs):
            if self._stopping():
                break
            callback_list.on_epoch_begin(epoch)
            epoch_end = (epoch + 1) * steps_per_epoch
            loss_sum, examples, started, first = 0.0, 0, time.perf_counter(), self.step.value
            totals.reset()
            while self.step.value < epoch_end and not self._stopping():
                step = self.step.value
                stop = min([epoch_end] + [(step // cb.sync_every + 1) * cb.sync_every
                                          for cb in callback_list if cb.sync_every])
                t0 = time.perf_counter()
                callback_list.on_train_batch_begin(step)
                results = [self.coordinator.schedule(
                    _train_execution, args=(self.replica, iterator, self.weights, self.tables, self.optimizer, spx,
                                            self.metrics, class_weight))
                    for _ in range((stop - step) // spx)]
                self.coordinator.join()
                chunk = [rv.fetch() for rv in results]
                chunk_loss, chunk_examples = sum(c[0] for c in chunk), sum(c[1] for c in chunk)
                loss_sum, examples = loss_sum + chunk_loss, examples + chunk_examples
                chunk_metrics = MetricTotals()
                for _, _, configs, states in chunk:
                    chunk_metrics.add(configs, states)
                    totals.add(configs, states)
                self.step.assign(stop)
                self._stale = True
                if reads_model:
                    self.pull_weights()
                seconds = time.perf_counter() - t0
                callback_list.on_train_batch_end(stop, {
                    "loss": chunk_loss / (stop - step), **chunk_metrics.results(), "step": stop,
                    "examples": chunk_examples, "examples_per_s": chunk_examples / seconds if seconds > 0 else math.inf})
            seconds = time.perf_counter() - started
            logs = {"loss": loss_sum / max(1, self.step.value - first), **totals.results(), "step": self.step.value,
                    "examples": examples, "examples_per_s": examples / seconds if seconds > 0 else math.inf}
            if validation is not None and validation.due(epoch):
                self.pull_weights()
                logs.update(validation.run())
            elif reads_model:
                self.pull_weights()
            if verbose:
                shown = "  ".join(f"{k} {v:.4f}" for k, v in logs.items() if k not in _BOOKKEEPING)
                print(f"epoch {epoch + 1}/{epochs}: {shown}  step {self.step.value}/{self.total_steps}  "
                      f"{logs['examples_per_s']:.0f} examples/s", flush=True)
            callback_list.on_epoch_end(epoch, logs)
        self._stopping()
        self.pull_weights()
        callback_list.on_train_end({"step": self.step.value, "stopped_early": self.step.value != self.total_steps})


def fit(model: Any, coordinator: Any, dataset_fn: Any, *, optimizer: Any = None, loss: Any = None,
        metrics: Any = None, epochs: int = 1, steps_per_epoch: int, steps_per_execution: int = 1,
        callbacks: Iterable[Any] = (), initial_epoch: int = 0, verbose: int = 1, validation_data: Any = None,
        validation_steps: int | None = None, validation_freq: int = 1, validation_batch_size: int | None = None,
        class_weight: Mapping[int, float] | None = None) -> History:
    """``model.fit`` with a parameter server: ``model`` is a built Keras 3 model (JAX backend) made inside
    ``coordinator.strategy.scope()``; ``dataset_fn(input_context)`` runs on every worker and yields ``(x, y)`` or
    ``(x, y, sample_weight)`` batches; ``optimizer`` a kubeps or Keras optimizer (:func:`kubeps_optimizer`);
    ``loss`` a Keras loss (object or name) or ``loss(y_true, y_pred)``; ``metrics`` Keras metrics (computed on the
    workers: :mod:`~kubeps.runtime.models.keras_metrics`); the three default to ``model.compile``'s.
    ``validation_data`` is evaluated on the chief at the end of every ``validation_freq``-th epoch (``val_loss``,
    ``val_<metric>``); ``class_weight`` weighs each example by its class; ``callbacks`` are kubeps callbacks or
    Keras's own. Returns the :class:`History` (its ``trainer`` holds the variables on the parameter servers); the
    trained weights are copied into ``model``."""
    trainer = KerasTrainer(model, coordinator, optimizer=optimizer, loss=loss, metrics=metrics,
                           steps_per_execution=steps_per_execution)
    return trainer.fit(dataset_fn, epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks,
                       initial_epoch=initial_epoch, verbose=verbose, validation_data=validation_data,
                       validation_steps=validation_steps, validation_freq=validation_freq,
                       validation_batch_size=validation_batch_size, class_weight=class_weight)


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
