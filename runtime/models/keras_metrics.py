"""Keras metrics and validation for :func:`kubeps.runtime.models.keras_fit.fit`, computed where the data is:

* **training metrics on the workers.** ``compile(metrics=[...])`` or ``fit(metrics=[...])`` name Keras metrics
  (``"accuracy"``, ``keras.metrics.AUC()``, ...). Each worker resolves them as Keras's ``compile`` does
  (``"accuracy"`` becomes binary, sparse or categorical accuracy from the shapes of its first batch), updates their
  state with ``stateless_update_state`` after every step (jitted) and returns the state with the scheduled
  function's loss: the predictions never travel. The chief adds the states of all the functions since the last
  report (:class:`MetricTotals`) and asks the metric for its ``stateless_result``. Keras's metrics keep sums
  (totals, counts, confusion-matrix counts), so the sum of the workers' states is the state of one metric that saw
  every batch.
* **validation on the chief** (:class:`Validation`): at the end of an epoch the chief holds the weights it just pulled
  from the parameter servers -- the ones a checkpoint at that step saves -- and runs the model on
  ``validation_data`` under ``jax.jit``; a ``KubepsEmbedding`` reads the rows it needs from the parameter servers.
  So ``val_loss`` and the ``val_`` metrics are what the sidecar evaluator measures on the same data at that step.

:func:`batch_loss` is the one definition of a batch's loss, for training (on the workers) and validation.

Rule: imports keras (through :mod:`keras_layers`); no task, transport or coordinator code.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from kubeps.runtime.checks import PositiveInt, check, integer, number
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.models.keras_layers import keras

import jax  # after keras_layers: the backend is set
from keras.src.trainers.compile_utils import get_metric  # noqa: E402 - Keras's own "accuracy" resolution

__all__ = ["MetricTotals", "Validation", "batch_loss", "check_class_weight", "class_weights", "metric_specs",
           "resolve_metrics", "unpack"]


def unpack(batch: Any) -> tuple[Any, Any, Any]:
    """A dataset element as ``(x, y, sample_weight)`` (``None`` when it has none)."""
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return batch[0], batch[1], batch[2] if len(batch) == 3 else None
    raise RuntimeConfigError("dataset element", type(batch).__name__,
                             "fit needs (x, y) or (x, y, sample_weight) elements, as Keras's fit")


def batch_loss(loss_fn: Any, y: Any, y_pred: Any, sample_weight: Any, extra_losses: Sequence[Any] = ()) -> Any:
    """The loss of one batch, as Keras's ``compile``: a ``Loss`` object reduces itself (with the sample weights);
    a name or function gives one loss per example, averaged over the batch; the layers' own losses (regularizers,
    ``add_loss``) are added."""
    if isinstance(loss_fn, keras.losses.Loss):
        loss = loss_fn(y, y_pred) if sample_weight is None else loss_fn(y, y_pred, sample_weight=sample_weight)
    else:
        loss = loss_fn(y, y_pred)
        loss = keras.ops.mean(loss if sample_weight is None else loss * sample_weight)
    for extra in extra_losses:
        loss = loss + extra
    return loss


def class_weights(class_weight: Mapping[int, float] | None, y: Any, sample_weight: Any) -> Any:
    """``sample_weight`` times the weight of each example's class (Keras's ``class_weight``: the label, or the
    argmax of a one-hot label); ``sample_weight`` as it is when there is no ``class_weight``."""
    if not class_weight:
        return sample_weight
    labels = np.asarray(y)
    if labels.ndim > 1:
        labels = np.argmax(labels, axis=-1) if labels.shape[-1] != 1 else np.squeeze(labels, axis=-1)
    labels = np.round(labels).astype(np.int64)
    weights = np.array([class_weight.get(int(c), 1.0) for c in labels.reshape(-1)], dtype=np.float32)
    weights = weights.reshape(labels.shape)
    return weights if sample_weight is None else np.asarray(sample_weight, dtype=np.float32) * weights


def check_class_weight(class_weight: Any) -> dict[int, float] | None:
    """``class_weight`` as ``{class index: weight}``, or an error naming the bad entry."""
    if class_weight is None:
        return None
    if not isinstance(class_weight, Mapping):
        raise RuntimeConfigError("class_weight", type(class_weight).__name__,
                                 "must be a dict {class index: weight}, as Keras's fit")
    checked = {}
    for key, value in class_weight.items():
        allowed = "keys must be class indices (int) and values weights >= 0"
        check(f"class_weight[{key!r}]", key, integer(), allowed=allowed)
        checked[int(key)] = check(f"class_weight[{key!r}]", value, number(ge=0), allowed=allowed)
    return checked


def metric_specs(metrics: Any) -> list[Any]:
    """The ``metrics`` of ``compile``/``fit`` in a form that pickles to the workers: names as they are, metric
    objects serialized (``keras.metrics.serialize``), functions as they are."""
    if metrics is None:
        return []
    if isinstance(metrics, (str, keras.metrics.Metric)) or callable(metrics):
        metrics = [metrics]
    if not isinstance(metrics, (list, tuple)):
        raise RuntimeConfigError("metrics", type(metrics).__name__,
                                 "a list of Keras metrics: names ('accuracy', 'auc'), keras.metrics objects or "
                                 "functions (per-output dicts are not supported)")
    specs = []
    for i, metric in enumerate(metrics):
        if isinstance(metric, keras.metrics.Metric):
            specs.append(keras.metrics.serialize(metric))
        elif isinstance(metric, str):
            if metric.lower() not in ("accuracy", "acc"):
                try:
                    keras.metrics.get(metric)
                except ValueError:
                    raise RuntimeConfigError(f"metrics[{i}]", metric, "a name Keras knows ('accuracy', 'auc', "
                                             "'mae', ...), a keras.metrics object or a function") from None
            specs.append(metric)
        elif callable(metric):
            specs.append(metric)
        else:
            raise RuntimeConfigError(f"metrics[{i}]", type(metric).__name__,
                                     "a metric name, a keras.metrics object or a function")
    return specs


def resolve_metrics(specs: Sequence[Any], y: Any, y_pred: Any) -> list[Any]:
    """Keras metric objects for ``specs``, resolved against a batch as ``compile`` does (``"accuracy"``)."""
    return [get_metric(keras.metrics.deserialize(s) if isinstance(s, dict) else s, y, y_pred) for s in specs]


class MetricTotals:
    """The sum of metric states reported by scheduled functions since the last :meth:`reset`; :meth:`results`
    are the metrics' values (``{name: float}``). A state is a list of arrays per metric; each function's state
    started from the metric's initial values, which are subtracted once per function."""

    def __init__(self) -> None:
        self.metrics: list[Any] | None = None
        self.initial: list[list[np.ndarray]] = []
        self.totals: list[list[np.ndarray]] | None = None

    def add(self, configs: Sequence[Any], states: Sequence[Sequence[Any]]) -> None:
        if not configs:
            return
        if self.metrics is None:
            self.metrics = [keras.metrics.deserialize(c) for c in configs]
            self.initial = [[np.asarray(v.value) for v in m.variables] for m in self.metrics]
        if self.totals is None:
            self.totals = [[np.array(v, copy=True) for v in s] for s in self.initial]
        for total, initial, state in zip(self.totals, self.initial, states):
            for t, i, s in zip(total, initial, state):
                t += np.asarray(s) - i

    def results(self) -> dict[str, float]:
        if self.metrics is None or self.totals is None:
            return {}
        return {m.name: float(np.asarray(m.stateless_result(list(t)))) for m, t in zip(self.metrics, self.totals)}

    def reset(self) -> None:
        self.totals = None


class Validation:
    """``fit(validation_data=, validation_steps=, validation_freq=, validation_batch_size=)``: :meth:`run` gives
    ``val_loss`` and a ``val_<name>`` per metric of the model (its weights as they are, pulled by the chief) on the
    validation data. ``validation_data`` is a tuple ``(x, y[, sample_weight])`` of arrays, batched by
    ``validation_batch_size`` as Keras's fit does, or an iterable of such batches (a list, a kubeps ``Dataset``),
    read from its start at every validation; ``validation_steps`` batches of it (all when ``None``). The loss is
    averaged over the batches weighted by their sizes, as Keras's ``evaluate``; the forward pass is jitted once."""

    def __init__(self, model: Any, loss_fn: Any, specs: Sequence[Any], data: Any, steps: int | None = None,
                 freq: int = 1, batch_size: int | None = None):
        check("validation_steps", steps, PositiveInt | None)
        check("validation_freq", freq, integer(ge=1, allowed="an integer >= 1 (every N epochs)"))
        check("validation_batch_size", batch_size, PositiveInt | None)
        if isinstance(data, tuple):
            data = _array_batches(data, batch_size or 32)
        elif not hasattr(data, "__iter__") or isinstance(data, (str, bytes, Mapping)):
            raise RuntimeConfigError("validation_data", type(data).__name__,
                                     "a tuple (x, y) or (x, y, sample_weight) of arrays, or an iterable of such "
                                     "batches (a list, a kubeps Dataset)")
        loss_fn = keras.losses.get(loss_fn) if isinstance(loss_fn, (str, dict)) else loss_fn
        self.model, self.loss_fn, self.specs, self.data = model, loss_fn, list(specs), data
        self.steps, self.freq = steps, freq
        kwargs = {"training": False} if model._call_has_training_arg else {}

        def forward(trainable: Any, non_trainable: Any, x: Any) -> Any:
            y_pred, _, losses = model.stateless_call(trainable, non_trainable, x, return_losses=True, **kwargs)
            return y_pred, losses

        self.forward = jax.jit(forward)

    def due(self, epoch: int) -> bool:
        """Whether the epoch ``epoch`` (from 0) ends with a validation (every ``validation_freq`` epochs)."""
        return (epoch + 1) % self.freq == 0

    def run(self) -> dict[str, float]:
        model = self.model
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        loss_sum, examples, metrics, seen = 0.0, 0, None, 0
        for batch in self.data:
            if self.steps is not None and seen >= self.steps:
                break
            x, y, sample_weight = unpack(batch)
            y_pred, losses = self.forward(trainable, non_trainable, x)
            n = len(np.asarray(y))
            loss_sum += float(batch_loss(self.loss_fn, y, y_pred, sample_weight, losses)) * n
            examples += n
            if metrics is None:
                metrics = resolve_metrics(self.specs, y, y_pred)
            for metric in metrics:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
            seen += 1
        if not examples:
            raise RuntimeConfigError("validation_data", type(self.data).__name__,
                                     "gave no batch: it must yield (x, y) or (x, y, sample_weight) batches every "
                                     "epoch (a one-shot iterator is exhausted after the first validation)")
        if self.steps is not None and seen < self.steps:
            raise RuntimeConfigError("validation_steps", self.steps, f"validation_data ran out after {seen} batches")
        logs = {"val_loss": loss_sum / examples}
        logs.update({f"val_{m.name}": float(np.asarray(m.result())) for m in metrics or []})
        return logs


def _array_batches(data: tuple[Any, ...], batch_size: int) -> list[tuple[Any, ...]]:
    """``(x, y[, sample_weight])`` arrays cut into batches of ``batch_size`` (the last one may be smaller)."""
    if len(data) not in (2, 3):
        raise RuntimeConfigError("validation_data", f"a tuple of {len(data)}",
                                 "a tuple (x, y) or (x, y, sample_weight) of arrays, as Keras's fit")
    n = len(np.asarray(data[1]))
    return [jax.tree_util.tree_map(lambda a: np.asarray(a)[i:i + batch_size], data) for i in range(0, n, batch_size)]
