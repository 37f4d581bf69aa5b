"""Optimizers whose updates run on the parameter servers.

A PS task holds each variable shard together with its slots (``init_slots(shard)``) and applies pushed gradients
with ``apply_dense`` or ``apply_sparse`` in place. ``step`` is the PS-side update count of that variable, starting
at 1; learning-rate schedules are evaluated from it on the PS, so there is no "hot" learning-rate variable that
every worker has to read.

Conventions (TensorFlow's, see ``docs/kernels.md``):

* A schedule is evaluated at ``step - 1`` (the number of updates already applied), as TF evaluates it at
  ``optimizer.iterations`` before incrementing: the first update uses ``schedule(0)``.
* Bias corrections (Adam) use ``t = step``.
* Sparse updates are *lazy*: duplicate ids are summed first, then only the touched rows of the variable and of
  its slots change. For SGD and Adagrad this equals the dense update with a zero-filled gradient; for Momentum,
  Adam and FTRL untouched rows keep their slots and values (TF's ``SparseApply*`` / LazyAdam semantics).

Configuration crosses process boundaries as JSON: ``get_config()`` returns
``{"class_name": "Adam", "config": {...}}`` and ``optimizer_from_config`` rebuilds the optimizer.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from kubeps.runtime.ops import kernels

__all__ = [
    "LearningRateSchedule",
    "ExponentialDecay",
    "InverseTimeDecay",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "CosineDecay",
    "schedule_from_config",
    "Optimizer",
    "SGD",
    "Momentum",
    "Adagrad",
    "Adam",
    "Ftrl",
    "optimizer_from_config",
]


# --------------------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------------------


def _number(owner: str, name: str, value: Any, *, lo: float | None = None, lo_open: bool = False,
            hi: float | None = None, hi_open: bool = False) -> float:
    """``value`` as a finite float within the given bounds, or a ValueError naming owner, argument and range."""
    allowed = _range_text(lo, lo_open, hi, hi_open)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{owner}: {name}={value!r} is not a number; allowed: a finite number {allowed}".rstrip())
    v = float(value)
    ok = math.isfinite(v)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    if not ok:
        raise ValueError(f"{owner}: {name}={value!r} is out of range; allowed: a finite number {allowed}".rstrip())
    return v


def _range_text(lo: float | None, lo_open: bool, hi: float | None, hi_open: bool) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi:g}")
    return " and ".join(parts)


def _integer(owner: str, name: str, value: Any, *, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < lo:
        raise ValueError(f"{owner}: {name}={value!r} is not allowed; allowed: an integer >= {lo}")
    return int(value)


def _boolean(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{owner}: {name}={value!r} is not allowed; allowed: True or False")
    return bool(value)


def _build(kind: str, registry: Mapping[str, type], config: Any) -> Any:
    """Shared body of ``optimizer_from_config`` and ``schedule_from_config``."""
    if not isinstance(config, Mapping) or "class_name" not in config:
        raise ValueError(f"{kind} config must be a mapping {{'class_name': ..., 'config': {{...}}}}, got {config!r}")
    name = config["class_name"]
    if name not in registry:
        raise ValueError(f"unknown {kind} class_name={name!r}; allowed: {sorted(registry)}")
    cls = registry[name]
    args = config.get("config", {}) or {}
    if not isinstance(args, Mapping):
        raise ValueError(f"{kind} {name}: 'config' must be a mapping of arguments, got {args!r}")
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]  # cls is a class: its own __init__
    accepted = [p for p in params if p != "self"]
    unknown = sorted(set(args) - set(accepted))
    if unknown:
        raise ValueError(f"{kind} {name} does not accept argument(s) {unknown}; allowed: {accepted}")
    missing = [p for p, spec in params.items()
               if p != "self" and spec.default is inspect.Parameter.empty and p not in args]
    if missing:
        raise ValueError(f"{kind} {name} is missing required argument(s) {missing}")
    return cls(**args)


# --------------------------------------------------------------------------------------------------------------
# Learning-rate schedules
# --------------------------------------------------------------------------------------------------------------

_SCHEDULES: dict[str, type["LearningRateSchedule"]] = {}


class LearningRateSchedule:
    """A learning rate as a function of the number of updates already applied (``0`` for the first update)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _SCHEDULES[cls.__name__] = cls

    def __call__(self, step: int) -> float:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(step)")

    def _config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement _config()")

    def get_config(self) -> dict[str, Any]:
        return {"class_name": type(self).__name__, "config": self._config()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.get_config() == self.get_config()


def schedule_from_config(config: Mapping[str, Any]) -> LearningRateSchedule:
    """Rebuild a schedule from ``get_config()`` output."""
    return _build("learning-rate schedule", _SCHEDULES, config)


class ExponentialDecay(LearningRateSchedule):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)`` (integer division when ``staircase``)."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, decay_rate: float,
                 staircase: bool = False) -> None:
        o = "ExponentialDecay"
        self.initial_learning_rate = _number(o, "initial_learning_rate", initial_learning_rate, lo=0, lo_open=True)
        self.decay_steps = _integer(o, "decay_steps", decay_steps, lo=1)
        self.decay_rate = _number(o, "decay_rate", decay_rate, lo=0, lo_open=True)
        self.staircase = _boolean(o, "staircase", staircase)

    def __call__(self, step: int) -> float:
        p = step / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return self.initial_learning_rate * self.decay_rate ** p

    def _config(self) -> dict[str, Any]:
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "decay_rate": self.decay_rate, "staircase": self.staircase}


class InverseTimeDecay(LearningRateSchedule):
    """``initial_learning_rate / (1 + decay_rate * step / decay_steps)`` (integer division when ``staircase``)."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, decay_rate: float,
                 staircase: bool = False) -> None:
        o = "InverseTimeDecay"
        self.initial_learning_rate = _number(o, "initial_learning_rate", initial_learning_rate, lo=0, lo_open=True)
        self.decay_steps = _integer(o, "decay_steps", decay_steps, lo=1)
        self.decay_rate = _number(o, "decay_rate", decay_rate, lo=0)
        self.staircase = _boolean(o, "staircase", staircase)

    def __call__(self, step: int) -> float:
        p = step / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return self.initial_learning_rate / (1.0 + self.decay_rate * p)

    def _config(self) -> dict[str, Any]:
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "decay_rate": self.decay_rate, "staircase": self.staircase}


class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[0]`` while ``step <= boundaries[0]``, ``values[i]`` for ``boundaries[i-1] < step <= boundaries[i]``,
    ``values[-1]`` after the last boundary (TF's rule). ``len(values) == len(boundaries) + 1``."""

    def __init__(self, boundaries: Sequence[int], values: Sequence[float]) -> None:
        o = "PiecewiseConstantDecay"
        if not isinstance(boundaries, (list, tuple)) or not boundaries:
            raise ValueError(f"{o}: boundaries={boundaries!r} is not allowed; allowed: a non-empty list of integers")
        if not isinstance(values, (list, tuple)) or len(values) != len(boundaries) + 1:
            raise ValueError(f"{o}: values={values!r} is not allowed; allowed: a list of "
                             f"len(boundaries) + 1 = {len(boundaries) + 1} positive numbers")
        self.boundaries = [_integer(o, f"boundaries[{i}]", b, lo=0) for i, b in enumerate(boundaries)]
        if any(b2 <= b1 for b1, b2 in zip(self.boundaries, self.boundaries[1:])):
            raise ValueError(f"{o}: boundaries={boundaries!r} is not allowed; allowed: strictly increasing integers")
        self.values = [_number(o, f"values[{i}]", v, lo=0, lo_open=True) for i, v in enumerate(values)]

    def __call__(self, step: int) -> float:
        for b, v in zip(self.boundaries, self.values):
            if step <= b:
                return v
        return self.values[-1]

    def _config(self) -> dict[str, Any]:
        return {"boundaries": list(self.boundaries), "values": list(self.values)}


class PolynomialDecay(LearningRateSchedule):
    """``(initial - end) * (1 - min(step, decay_steps) / decay_steps) ** power + end`` (TF, without ``cycle``)."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, end_learning_rate: float = 0.0001,
                 power: float = 1.0) -> None:
        o = "PolynomialDecay"
        self.initial_learning_rate = _number(o, "initial_learning_rate", initial_learning_rate, lo=0, lo_open=True)
        self.decay_steps = _integer(o, "decay_steps", decay_steps, lo=1)
        self.end_learning_rate = _number(o, "end_learning_rate", end_learning_rate, lo=0)
        self.power = _number(o, "power", power, lo=0, lo_open=True)

    def __call__(self, step: int) -> float:
        frac = 1.0 - min(step, self.decay_steps) / self.decay_steps
        return (self.initial_learning_rate - self.end_learning_rate) * frac ** self.power + self.end_learning_rate

    def _config(self) -> dict[str, Any]:
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "end_learning_rate": self.end_learning_rate, "power": self.power}


class CosineDecay(LearningRateSchedule):
    """Cosine decay with optional linear warmup (TF 2.13+ ``CosineDecay``).

    During ``warmup_steps`` the rate rises linearly from ``initial_learning_rate`` to ``warmup_target``
    (no warmup when ``warmup_target`` is None); then, over ``decay_steps``, it falls as
    ``peak * ((1 - alpha) * 0.5 * (1 + cos(pi * s / decay_steps)) + alpha)`` and stays at ``peak * alpha``.
    """

    def __init__(self, initial_learning_rate: float, decay_steps: int, alpha: float = 0.0,
                 warmup_target: float | None = None, warmup_steps: int = 0) -> None:
        o = "CosineDecay"
        self.initial_learning_rate = _number(o, "initial_learning_rate", initial_learning_rate, lo=0)
        self.decay_steps = _integer(o, "decay_steps", decay_steps, lo=1)
        self.alpha = _number(o, "alpha", alpha, lo=0, hi=1)
        self.warmup_target = None if warmup_target is None else _number(o, "warmup_target", warmup_target,
                                                                         lo=0, lo_open=True)
        self.warmup_steps = _integer(o, "warmup_steps", warmup_steps, lo=0)
        if self.warmup_target is None and self.initial_learning_rate == 0:
            raise ValueError(f"{o}: initial_learning_rate=0 is only allowed with a warmup_target")

    def __call__(self, step: int) -> float:
        if self.warmup_target is not None and step < self.warmup_steps:
            return self.initial_learning_rate + (self.warmup_target - self.initial_learning_rate) * (
                step / self.warmup_steps)
        peak = self.initial_learning_rate if self.warmup_target is None else self.warmup_target
        s = min(step - (self.warmup_steps if self.warmup_target is not None else 0), self.decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * s / self.decay_steps))
        return peak * ((1.0 - self.alpha) * cosine + self.alpha)

    def _config(self) -> dict[str, Any]:
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "alpha": self.alpha, "warmup_target": self.warmup_target, "warmup_steps": self.warmup_steps}


# --------------------------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------------------------

_OPTIMIZERS: dict[str, type["Optimizer"]] = {}


def optimizer_from_config(config: Mapping[str, Any]) -> "Optimizer":
    """Rebuild an optimizer from ``Optimizer.get_config()`` output (``{"class_name": ..., "config": {...}}``).

    Raises ValueError for an unknown class name, an unknown or missing argument, or a bad argument value.
    """
    return _build("optimizer", _OPTIMIZERS, config)


class Optimizer:
    """Base class. Subclasses define ``_hyper()`` (their config), ``slot_names()``, ``_slot_init`` and ``_update``.

    ``_update(var, grad, slots, lr, step)`` is element-wise and in place; the base class derives the dense update
    from it directly and the sparse (lazy) update by running it on the touched rows only.
    """

    _slot_init: Mapping[str, float] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _OPTIMIZERS[cls.__name__] = cls

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any]) -> None:
        self.learning_rate = self._check_learning_rate(learning_rate)

    # -- configuration ---------------------------------------------------------------------------------------

    def _check_learning_rate(self, lr: Any) -> float | LearningRateSchedule:
        if isinstance(lr, LearningRateSchedule):
            return lr
        if isinstance(lr, Mapping):
            return schedule_from_config(lr)
        if callable(lr):
            raise ValueError(f"{type(self).__name__}: learning_rate={lr!r} is not allowed; allowed: a positive number "
                             f"or a LearningRateSchedule (plain callables cannot be sent to a parameter server)")
        return _number(type(self).__name__, "learning_rate", lr, lo=0, lo_open=True)

    def _hyper(self) -> dict[str, Any]:
        """JSON-able constructor arguments other than ``learning_rate``."""
        return {}

    def get_config(self) -> dict[str, Any]:
        """``{"class_name": <class>, "config": {constructor arguments}}``, JSON-able."""
        lr = self.learning_rate
        lr_cfg = lr.get_config() if isinstance(lr, LearningRateSchedule) else lr
        return {"class_name": type(self).__name__, "config": {"learning_rate": lr_cfg, **self._hyper()}}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "Optimizer":
        opt = optimizer_from_config(config)
        if not isinstance(opt, cls):
            raise ValueError(f"{cls.__name__}.from_config got a config for {type(opt).__name__}")
        return opt

    def __repr__(self) -> str:
        cfg = self.get_config()["config"]
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in cfg.items())})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.get_config() == self.get_config()

    def lr_at(self, step: int) -> float:
        """The learning rate used by update number ``step`` (1-based): ``schedule(step - 1)`` or the constant."""
        lr = self.learning_rate
        return float(lr(step - 1)) if isinstance(lr, LearningRateSchedule) else lr

    # -- slots -----------------------------------------------------------------------------------------------

    def slot_names(self) -> tuple[str, ...]:
        """Names of the per-variable state arrays, each shaped like the variable."""
        return tuple(self._slot_init)

    def init_slots(self, var: Any) -> dict[str, Any]:
        """Fresh slots for ``var`` (or for one shard of it): same shape, dtype and array module."""
        xp = kernels.array_module(var)
        return {name: xp.full(var.shape, self._slot_init[name], dtype=var.dtype) for name in self.slot_names()}

    # -- updates ---------------------------------------------------------------------------------------------

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _update")

    def _check_step(self, step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
            raise ValueError(f"{type(self).__name__}: step={step!r} is not allowed; allowed: an integer >= 1 "
                             f"(the variable's update count, 1 for its first update)")
        return int(step)

    def _check_slots(self, var: Any, slots: Mapping[str, Any]) -> None:
        names = self.slot_names()
        if set(slots) != set(names):
            raise ValueError(f"{type(self).__name__}: slots has keys {sorted(slots)}; expected {sorted(names)} "
                             f"(create them with init_slots(var))")
        for name in names:
            if tuple(slots[name].shape) != tuple(var.shape):
                raise ValueError(f"{type(self).__name__}: slot {name!r} has shape {tuple(slots[name].shape)}; "
                                 f"expected the variable's shape {tuple(var.shape)}")

    def apply_dense(self, var: Any, grad: Any, slots: dict[str, Any], step: int) -> None:
        """Apply a dense gradient to ``var`` and its ``slots`` in place."""
        step = self._check_step(step)
        self._check_slots(var, slots)
        xp = kernels.array_module(var)
        grad = xp.asarray(grad)
        if tuple(grad.shape) != tuple(var.shape):
            raise ValueError(f"{type(self).__name__}: grad has shape {tuple(grad.shape)}; "
                             f"expected the variable's shape {tuple(var.shape)}")
        grad = grad.astype(var.dtype, copy=False)
        self._update(var, grad, slots, self.lr_at(step), step)

    def apply_sparse(self, var: Any, indices: Any, values: Any, slots: dict[str, Any], step: int) -> None:
        """Apply a row-sparse gradient in place: ``values[k]`` belongs to row ``indices[k]`` (local row ids).

        Duplicate ids are summed first (``kernels.reduce_sparse``); only the touched rows of ``var`` and of its
        slots change (lazy semantics, see module docstring).
        """
        step = self._check_step(step)
        self._check_slots(var, slots)
        xp = kernels.array_module(var)
        indices = xp.asarray(indices)
        values = xp.asarray(values)
        if var.ndim < 1:
            raise ValueError(f"{type(self).__name__}: apply_sparse needs a variable of rank >= 1, got a scalar")
        if indices.ndim != 1:
            raise ValueError(f"{type(self).__name__}: indices must be 1-D, got shape {tuple(indices.shape)}")
        want = (indices.shape[0],) + tuple(var.shape[1:])
        if tuple(values.shape) != want:
            raise ValueError(f"{type(self).__name__}: values has shape {tuple(values.shape)}; expected "
                             f"(len(indices),) + var.shape[1:] = {want}")
        if indices.dtype.kind not in "iu":
            raise ValueError(f"{type(self).__name__}: indices has dtype {indices.dtype}; allowed: integer row ids")
        if indices.shape[0] == 0:
            return
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= var.shape[0]:
            raise ValueError(f"{type(self).__name__}: indices contains row id {lo if lo < 0 else hi}; "
                             f"allowed: 0 <= id < {var.shape[0]} (local row ids of this shard)")
        ids, grad = kernels.reduce_sparse(indices, values.astype(var.dtype, copy=False))
        self._apply_rows(var, ids, grad, slots, self.lr_at(step), step)

    def _apply_rows(self, var: Any, ids: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        """Run ``_update`` on the gathered rows ``ids`` (unique) and scatter the results back."""
        xp = kernels.array_module(var)
        rows = xp.take(var, ids, axis=0)
        slot_rows = {name: xp.take(s, ids, axis=0) for name, s in slots.items()}
        self._update(rows, grad, slot_rows, lr, step)
        var[ids] = rows
        for name, s in slots.items():
            s[ids] = slot_rows[name]

    # -- user-facing -----------------------------------------------------------------------------------------

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        """Push ``(gradient, variable)`` pairs to the parameter servers that own the variables.

        A gradient is a dense array or a row-sparse :class:`~kubeps.runtime.variables.indexed_slices.IndexedSlices`. The
        transport lives in ``kubeps.runtime.variables.push.apply_gradients``; the PS applies the update with this
        optimizer.
        """
        from kubeps.runtime.variables import push as training  # noqa: PLC0415 - the push loads grpc: only a worker pushing needs it

        return training.apply_gradients(self, grads_and_vars)


class SGD(Optimizer):
    """Plain gradient descent: ``var -= lr * grad``."""

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.01) -> None:
        super().__init__(learning_rate)

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        var -= lr * grad

    def _apply_rows(self, var: Any, ids: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        var[ids] -= lr * grad  # ids are unique, so fancy-index -= is exact


class Momentum(Optimizer):
    """Gradient descent with momentum, TensorFlow's ``ApplyMomentum`` (``tf.compat.v1.train.MomentumOptimizer``).

    ``accum = momentum * accum + grad``; ``var -= lr * accum``; with ``nesterov``:
    ``var -= lr * grad + lr * momentum * accum`` (after the accumulator update).
    """

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.01,
                 momentum: float = 0.9, nesterov: bool = False) -> None:
        super().__init__(learning_rate)
        self.momentum = _number("Momentum", "momentum", momentum, lo=0, hi=1, hi_open=True)
        self.nesterov = _boolean("Momentum", "nesterov", nesterov)
        self._slot_init = {"momentum": 0.0}

    def _hyper(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "nesterov": self.nesterov}

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        accum = slots["momentum"]
        accum *= self.momentum
        accum += grad
        if self.nesterov:
            var -= lr * (grad + self.momentum * accum)
        else:
            var -= lr * accum


class Adagrad(Optimizer):
    """Adagrad as in TF2 (``ResourceApplyAdagradV2``).

    ``accum += grad ** 2``; ``var -= lr * grad / (sqrt(accum) + epsilon)``; ``accum`` starts at
    ``initial_accumulator_value``.
    """

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.001,
                 initial_accumulator_value: float = 0.1, epsilon: float = 1e-7) -> None:
        super().__init__(learning_rate)
        self.initial_accumulator_value = _number("Adagrad", "initial_accumulator_value", initial_accumulator_value,
                                                 lo=0)
        self.epsilon = _number("Adagrad", "epsilon", epsilon, lo=0)
        if self.initial_accumulator_value == 0 and self.epsilon == 0:
            raise ValueError("Adagrad: initial_accumulator_value=0 with epsilon=0 divides by zero on a zero "
                             "gradient; allowed: either of them > 0")
        self._slot_init = {"accumulator": self.initial_accumulator_value}

    def _hyper(self) -> dict[str, Any]:
        return {"initial_accumulator_value": self.initial_accumulator_value, "epsilon": self.epsilon}

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        xp = kernels.array_module(var)
        accum = slots["accumulator"]
        accum += grad * grad
        denom = xp.sqrt(accum)
        denom += self.epsilon
        var -= lr * grad / denom


class Adam(Optimizer):
    """Adam as in TF2 (``ResourceApplyAdam``; Keras ``epsilon`` is the "epsilon hat" of the paper).

    With ``t = step``: ``m = beta_1 m + (1 - beta_1) g``; ``v = beta_2 v + (1 - beta_2) g ** 2``;
    ``lr_t = lr * sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)``; ``var -= lr_t * m / (sqrt(v) + epsilon)``.
    With ``amsgrad``: ``vhat = max(vhat, v)`` and ``vhat`` replaces ``v`` in the last step.
    Sparse updates are lazy (only touched rows' moments change; bias correction from the variable's step).
    """

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.001,
                 beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7, amsgrad: bool = False) -> None:
        super().__init__(learning_rate)
        self.beta_1 = _number("Adam", "beta_1", beta_1, lo=0, hi=1, hi_open=True)
        self.beta_2 = _number("Adam", "beta_2", beta_2, lo=0, hi=1, hi_open=True)
        self.epsilon = _number("Adam", "epsilon", epsilon, lo=0, lo_open=True)
        self.amsgrad = _boolean("Adam", "amsgrad", amsgrad)
        self._slot_init = {"m": 0.0, "v": 0.0, **({"vhat": 0.0} if self.amsgrad else {})}

    def _hyper(self) -> dict[str, Any]:
        return {"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon, "amsgrad": self.amsgrad}

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        xp = kernels.array_module(var)
        m, v = slots["m"], slots["v"]
        m *= self.beta_1
        m += (1.0 - self.beta_1) * grad
        v *= self.beta_2
        v += (1.0 - self.beta_2) * (grad * grad)
        lr_t = lr * math.sqrt(1.0 - self.beta_2 ** step) / (1.0 - self.beta_1 ** step)
        if self.amsgrad:
            vhat = slots["vhat"]
            xp.maximum(vhat, v, out=vhat)
            v = vhat
        denom = xp.sqrt(v)
        denom += self.epsilon
        var -= lr_t * m / denom


class Ftrl(Optimizer):
    """FTRL-Proximal (McMahan et al. 2013), TensorFlow's ``ApplyFtrlV2`` / Keras ``Ftrl``.

    With ``p = learning_rate_power`` (<= 0; -0.5 is the paper's per-coordinate rate)::

        g_s        = grad + 2 * l2_shrinkage * var
        accum_new  = accum + grad ** 2
        linear    += g_s - (accum_new ** -p - accum ** -p) / lr * var
        quadratic  = (accum_new ** -p + beta) / lr + 2 * l2
        var        = (sign(linear) * l1 - linear) / quadratic  if |linear| > l1  else 0
        accum      = accum_new

    The accumulator sums the raw gradient's squares, as TF's kernels and Keras do (TF's op docstring writes
    ``g_s ** 2``; the implementation uses ``grad ** 2``); with ``l2_shrinkage = 0`` the two agree.
    """

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.001,
                 learning_rate_power: float = -0.5, initial_accumulator_value: float = 0.1,
                 l1_regularization_strength: float = 0.0, l2_regularization_strength: float = 0.0,
                 l2_shrinkage_regularization_strength: float = 0.0, beta: float = 0.0) -> None:
        super().__init__(learning_rate)
        o = "Ftrl"
        self.learning_rate_power = _number(o, "learning_rate_power", learning_rate_power, hi=0)
        self.initial_accumulator_value = _number(o, "initial_accumulator_value", initial_accumulator_value, lo=0)
        self.l1_regularization_strength = _number(o, "l1_regularization_strength", l1_regularization_strength, lo=0)
        self.l2_regularization_strength = _number(o, "l2_regularization_strength", l2_regularization_strength, lo=0)
        self.l2_shrinkage_regularization_strength = _number(
            o, "l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength, lo=0)
        self.beta = _number(o, "beta", beta, lo=0)
        if self.initial_accumulator_value == 0 and self.learning_rate_power < 0:
            # accum ** -p is fine at 0, but quadratic = 0 on a zero first gradient would divide by zero.
            if self.beta == 0 and self.l2_regularization_strength == 0:
                raise ValueError(f"{o}: initial_accumulator_value=0 with beta=0 and l2_regularization_strength=0 "
                                 f"divides by zero on a zero gradient; allowed: initial_accumulator_value > 0")
        self._slot_init = {"accumulator": self.initial_accumulator_value, "linear": 0.0}

    def _hyper(self) -> dict[str, Any]:
        return {"learning_rate_power": self.learning_rate_power,
                "initial_accumulator_value": self.initial_accumulator_value,
                "l1_regularization_strength": self.l1_regularization_strength,
                "l2_regularization_strength": self.l2_regularization_strength,
                "l2_shrinkage_regularization_strength": self.l2_shrinkage_regularization_strength,
                "beta": self.beta}

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        xp = kernels.array_module(var)
        accum, linear = slots["accumulator"], slots["linear"]
        p = self.learning_rate_power
        l1, l2 = self.l1_regularization_strength, self.l2_regularization_strength
        shrink = self.l2_shrinkage_regularization_strength
        g_s = grad + (2.0 * shrink) * var if shrink else grad
        accum_new = accum + grad * grad
        if p == -0.5:
            new_pow, old_pow = xp.sqrt(accum_new), xp.sqrt(accum)
        else:
            new_pow, old_pow = accum_new ** (-p), accum ** (-p)
        linear += g_s - (new_pow - old_pow) / lr * var
        quadratic = (new_pow + self.beta) / lr + 2.0 * l2
        var[...] = xp.where(xp.abs(linear) > l1, (xp.sign(linear) * l1 - linear) / quadratic, 0.0)
        accum[...] = accum_new
