"""Optimizers whose updates run on the parameter servers.

A PS task holds each variable shard together with its slots (``init_slots(shard)``) and applies pushed gradients
with ``apply_dense`` or ``apply_sparse`` in place. ``step`` is the PS-side update count of that variable, starting
at 1; learning-rate schedules are evaluated from it on the PS, so there is no "hot" learning-rate variable that
every worker has to read.

Conventions (TensorFlow's, see ``docs/kernels.md``):

* A schedule is evaluated at ``step - 1`` (the number of updates already applied), as TF evaluates it at
  ``optimizer.iterations`` before incrementing: the first update uses ``schedule(0)``.
* Bias corrections (Adam, Nadam, Adamax) use ``t = step``.
* Sparse updates are *lazy*: duplicate ids are summed first, then only the touched rows of the variable and of
  its slots change. For SGD and Adagrad this equals the dense update with a zero-filled gradient; for the others
  untouched rows keep their slots and values (TF's ``SparseApply*`` / LazyAdam semantics).
* ``weight_decay`` (every optimizer; ``AdamW``'s default 0.004) is Keras's decoupled decay,
  ``var -= var * weight_decay * lr`` before the update, with the update's rate; a sparse update decays the touched
  rows only (as TF-Addons' ``DecoupledWeightDecayExtension`` does for sparse gradients).

``RMSprop``, ``Adadelta``, ``Nadam``, ``AdamW``, ``Adamax`` and ``Lion`` follow Keras 3's update rules (slot names
too); ``SGD``, ``Momentum``, ``Adagrad``, ``Adam`` and ``Ftrl`` TensorFlow's kernels (Keras's equal them but for
Adagrad's ``epsilon``, which Keras adds under the square root).

Learning-rate schedules are :mod:`kubeps.runtime.ops.schedules` (re-exported here); the hyperparameter checks are
:mod:`kubeps.runtime.ops.hyperparams`.

Configuration crosses process boundaries as JSON: ``get_config()`` returns
``{"class_name": "Adam", "config": {...}}`` and ``optimizer_from_config`` rebuilds the optimizer.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import numpy as np

from kubeps.runtime.ops import kernels
from kubeps.runtime.checks import Flag, check, integer, number
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.ops.hyperparams import build
from kubeps.runtime.variables.indexed_slices import IndexedSlices
from kubeps.runtime.ops.schedules import (  # noqa: F401 - re-exported: optimizers take schedules as their rate
    MAX_SCHEDULE_STEP,
    CosineDecay,
    CosineDecayRestarts,
    ExponentialDecay,
    InverseTimeDecay,
    LearningRateSchedule,
    PiecewiseConstantDecay,
    PolynomialDecay,
    schedule_from_config,
)

__all__ = [
    "LearningRateSchedule",
    "ExponentialDecay",
    "InverseTimeDecay",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "CosineDecay",
    "CosineDecayRestarts",
    "schedule_from_config",
    "Optimizer",
    "SGD",
    "Momentum",
    "Adagrad",
    "Adam",
    "Ftrl",
    "RMSprop",
    "Adadelta",
    "Nadam",
    "AdamW",
    "Adamax",
    "Lion",
    "optimizer_from_config",
]


# --------------------------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------------------------

_OPTIMIZERS: dict[str, type["Optimizer"]] = {}


def optimizer_from_config(config: Mapping[str, Any]) -> "Optimizer":
    """Rebuild an optimizer from ``Optimizer.get_config()`` output (``{"class_name": ..., "config": {...}}``).

    Raises ValueError for an unknown class name, an unknown or missing argument, or a bad argument value.
    """
    return build("optimizer", _OPTIMIZERS, config)


#: a variable's update count on its ps, 1 for its first update
_UPDATE_COUNT = integer(ge=1, allowed="an integer >= 1 (the variable's update count, 1 for its first update)")


class Optimizer:
    """Base class. Subclasses define ``_hyper()`` (their config), ``slot_names()``, ``_slot_init`` and ``_update``.

    ``_update(var, grad, slots, lr, step)`` is element-wise and in place; the base class derives the dense update
    from it directly and the sparse (lazy) update by running it on the touched rows only.
    """

    _slot_init: Mapping[str, float] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _OPTIMIZERS[cls.__name__] = cls

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any],
                 weight_decay: float | None = None) -> None:
        self.learning_rate = self._check_learning_rate(learning_rate)
        #: Keras's decoupled weight decay: ``var -= var * weight_decay * lr`` before each update (None: off)
        self.weight_decay = None if weight_decay is None else check("weight_decay", weight_decay, number(ge=0), owner=type(self).__name__)

    # -- configuration ---------------------------------------------------------------------------------------

    def _check_learning_rate(self, lr: Any) -> float | LearningRateSchedule:
        if isinstance(lr, LearningRateSchedule):
            return lr
        if isinstance(lr, Mapping):
            return schedule_from_config(lr)
        if callable(lr):
            raise RuntimeConfigError(f"{type(self).__name__}.learning_rate", lr, "a positive number or a "
                                     "LearningRateSchedule (plain callables cannot be sent to a parameter server)")
        return check("learning_rate", lr, number(gt=0), owner=type(self).__name__)

    def _moments(self, beta_1: Any, beta_2: Any, epsilon: Any) -> dict[str, Any]:
        """Check and keep the hyper-parameters of the Adam family (``beta_1``, ``beta_2`` in [0, 1), ``epsilon``
        > 0); returns them as config."""
        o = type(self).__name__
        self.beta_1 = check("beta_1", beta_1, number(ge=0, lt=1), owner=o)
        self.beta_2 = check("beta_2", beta_2, number(ge=0, lt=1), owner=o)
        self.epsilon = check("epsilon", epsilon, number(gt=0), owner=o)
        return {"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon}

    def _hyper(self) -> dict[str, Any]:
        """JSON-able constructor arguments other than ``learning_rate``."""
        return {}

    def get_config(self) -> dict[str, Any]:
        """``{"class_name": <class>, "config": {constructor arguments}}``, JSON-able."""
        lr = self.learning_rate
        lr_cfg = lr.get_config() if isinstance(lr, LearningRateSchedule) else lr
        decay = {} if self.weight_decay is None else {"weight_decay": self.weight_decay}
        return {"class_name": type(self).__name__, "config": {"learning_rate": lr_cfg, **self._hyper(), **decay}}

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
        return int(check("step", step, _UPDATE_COUNT, owner=type(self).__name__))

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
        lr = self.lr_at(step)
        self._decay(var, lr)
        self._update(var, grad, slots, lr, step)

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
        self._decay(rows, lr)
        self._update(rows, grad, slot_rows, lr, step)
        kernels.set_rows(var, ids, rows)
        for name, s in slots.items():
            kernels.set_rows(s, ids, slot_rows[name])

    def _decay(self, var: Any, lr: float) -> None:
        """Keras's decoupled weight decay, in place, before the update: ``var -= var * weight_decay * lr``."""
        if self.weight_decay:
            var -= var * (self.weight_decay * lr)

    # -- user-facing -----------------------------------------------------------------------------------------

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        """Push ``(gradient, variable)`` pairs to the parameter servers that own the variables.

        A gradient is a dense array or a row-sparse :class:`~kubeps.runtime.variables.indexed_slices.IndexedSlices`. The
        transport lives in ``kubeps.runtime.variables.push.apply_gradients``; the PS applies the update with this
        optimizer.
        """
        from kubeps.runtime.variables import push as training  # noqa: PLC0415 - the push loads grpc: only a worker pushing needs it

        return training.apply_gradients(self, _on_host(list(grads_and_vars)))


class SGD(Optimizer):
    """Plain gradient descent: ``var -= lr * grad``."""

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.01,
                 weight_decay: float | None = None) -> None:
        super().__init__(learning_rate, weight_decay)

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        var -= lr * grad

    def _apply_rows(self, var: Any, ids: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        if self.weight_decay:
            super()._apply_rows(var, ids, grad, slots, lr, step)
        else:
            var[ids] -= lr * grad  # ids are unique, so fancy-index -= is exact


class Momentum(Optimizer):
    """Gradient descent with momentum, TensorFlow's ``ApplyMomentum`` (``tf.compat.v1.train.MomentumOptimizer``).

    ``accum = momentum * accum + grad``; ``var -= lr * accum``; with ``nesterov``:
    ``var -= lr * grad + lr * momentum * accum`` (after the accumulator update).
    """

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.01,
                 momentum: float = 0.9, nesterov: bool = False, weight_decay: float | None = None) -> None:
        super().__init__(learning_rate, weight_decay)
        self.momentum = check("momentum", momentum, number(ge=0, lt=1), owner="Momentum")
        self.nesterov = check("nesterov", nesterov, Flag, owner="Momentum")
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
                 initial_accumulator_value: float = 0.1, epsilon: float = 1e-7,
                 weight_decay: float | None = None) -> None:
        super().__init__(learning_rate, weight_decay)
        self.initial_accumulator_value = check("initial_accumulator_value", initial_accumulator_value, number(ge=0), owner="Adagrad")
        self.epsilon = check("epsilon", epsilon, number(ge=0), owner="Adagrad")
        if self.initial_accumulator_value == 0 and self.epsilon == 0:
            raise RuntimeConfigError("Adagrad.epsilon", 0, "> 0 when initial_accumulator_value=0 (both 0 divide by "
                                     "zero on a zero gradient)")
        self._slot_init = {"accumulator": self.initial_accumulator_value}

    def _hyper(self) -> dict[str, Any]:
        return {"initial_accumulator_value": self.initial_accumulator_value, "epsilon": self.epsilon}

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        xp = kernels.array_module(var)
        accum = slots["accumulator"]
        # two temporaries, not four (the dense weights of a big MLP are megabytes a step); the same arithmetic, in
        # the same order, as ``var -= lr * grad / (sqrt(accum) + eps)``
        denom = xp.multiply(grad, grad)
        accum += denom
        xp.sqrt(accum, out=denom)
        denom += self.epsilon
        step_ = xp.multiply(grad, lr, dtype=var.dtype) if xp is np else lr * grad
        step_ /= denom
        var -= step_


class Adam(Optimizer):
    """Adam as in TF2 (``ResourceApplyAdam``; Keras ``epsilon`` is the "epsilon hat" of the paper).

    With ``t = step``: ``m = beta_1 m + (1 - beta_1) g``; ``v = beta_2 v + (1 - beta_2) g ** 2``;
    ``lr_t = lr * sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)``; ``var -= lr_t * m / (sqrt(v) + epsilon)``.
    With ``amsgrad``: ``vhat = max(vhat, v)`` and ``vhat`` replaces ``v`` in the last step.
    Sparse updates are lazy (only touched rows' moments change; bias correction from the variable's step).
    """

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.001,
                 beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7, amsgrad: bool = False,
                 weight_decay: float | None = None) -> None:
        super().__init__(learning_rate, weight_decay)
        self._moment_config = self._moments(beta_1, beta_2, epsilon)
        self.amsgrad = check("amsgrad", amsgrad, Flag, owner=type(self).__name__)
        self._slot_init = {"m": 0.0, "v": 0.0, **({"vhat": 0.0} if self.amsgrad else {})}

    def _hyper(self) -> dict[str, Any]:
        return {**self._moment_config, "amsgrad": self.amsgrad}

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
                 l2_shrinkage_regularization_strength: float = 0.0, beta: float = 0.0,
                 weight_decay: float | None = None) -> None:
        super().__init__(learning_rate, weight_decay)
        o = "Ftrl"
        self.learning_rate_power = check("learning_rate_power", learning_rate_power, number(le=0), owner=o)
        self.initial_accumulator_value = check("initial_accumulator_value", initial_accumulator_value, number(ge=0), owner=o)
        self.l1_regularization_strength = check("l1_regularization_strength", l1_regularization_strength, number(ge=0), owner=o)
        self.l2_regularization_strength = check("l2_regularization_strength", l2_regularization_strength, number(ge=0), owner=o)
        self.l2_shrinkage_regularization_strength = check("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength, number(ge=0), owner=o)
        self.beta = check("beta", beta, number(ge=0), owner=o)
        if self.initial_accumulator_value == 0 and self.learning_rate_power < 0:
            # accum ** -p is fine at 0, but quadratic = 0 on a zero first gradient would divide by zero.
            if self.beta == 0 and self.l2_regularization_strength == 0:
                raise RuntimeConfigError(f"{o}.initial_accumulator_value", 0, "> 0 when beta=0 and "
                                         "l2_regularization_strength=0 (all 0 divide by zero on a zero gradient)")
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


class AdamW(Adam):
    """Keras's ``AdamW``: :class:`Adam` with decoupled weight decay on by default (``weight_decay=0.004``), the
    decay ``var -= var * weight_decay * lr`` applied before the Adam update (Loshchilov & Hutter, as Keras does)."""

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.001,
                 weight_decay: float = 0.004, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7,
                 amsgrad: bool = False) -> None:
        if weight_decay is None:
            raise RuntimeConfigError("AdamW.weight_decay", None, "a number >= 0 (use Adam for none)")
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad, weight_decay)


class RMSprop(Optimizer):
    """Keras's ``RMSprop`` (TensorFlow's ``ApplyRMSProp``/``ApplyCenteredRMSProp``, ``epsilon`` under the root)::

        velocity = rho * velocity + (1 - rho) * grad ** 2
        average_gradient = rho * average_gradient + (1 - rho) * grad               (centered only)
        increment = lr * grad / sqrt(velocity - average_gradient ** 2 + epsilon)   (without the square: not centered)
        momentum = momentum_coef * momentum + increment; var -= momentum           (var -= increment when 0)

    Slots ``velocity``, ``momentum`` when ``momentum > 0``, ``average_gradient`` when ``centered``; all start at 0.
    """

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.001, rho: float = 0.9,
                 momentum: float = 0.0, epsilon: float = 1e-7, centered: bool = False,
                 weight_decay: float | None = None) -> None:
        super().__init__(learning_rate, weight_decay)
        self.rho = check("rho", rho, number(ge=0, lt=1), owner="RMSprop")
        self.momentum = check("momentum", momentum, number(ge=0, lt=1), owner="RMSprop")
        self.epsilon = check("epsilon", epsilon, number(gt=0), owner="RMSprop")
        self.centered = check("centered", centered, Flag, owner="RMSprop")
        self._slot_init = {"velocity": 0.0, **({"momentum": 0.0} if self.momentum > 0 else {}),
                           **({"average_gradient": 0.0} if self.centered else {})}

    def _hyper(self) -> dict[str, Any]:
        return {"rho": self.rho, "momentum": self.momentum, "epsilon": self.epsilon, "centered": self.centered}

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        xp = kernels.array_module(var)
        velocity = slots["velocity"]
        velocity *= self.rho
        velocity += (1.0 - self.rho) * (grad * grad)
        if self.centered:
            average = slots["average_gradient"]
            average *= self.rho
            average += (1.0 - self.rho) * grad
            denom = velocity - average * average
            denom += self.epsilon
        else:
            denom = velocity + self.epsilon
        increment = lr * grad / xp.sqrt(denom)
        if self.momentum > 0:
            momentum = slots["momentum"]
            momentum *= self.momentum
            momentum += increment
            var -= momentum
        else:
            var -= increment


class Adadelta(Optimizer):
    """Keras's ``Adadelta`` (Zeiler 2012, with a learning rate; TensorFlow's ``ApplyAdadelta``)::

        accumulated_grad = rho * accumulated_grad + (1 - rho) * grad ** 2
        delta = -sqrt(accumulated_delta_var + epsilon) / sqrt(accumulated_grad + epsilon) * grad
        accumulated_delta_var = rho * accumulated_delta_var + (1 - rho) * delta ** 2
        var += lr * delta

    Slots ``accumulated_grad`` and ``accumulated_delta_var``, both starting at 0.
    """

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.001, rho: float = 0.95,
                 epsilon: float = 1e-7, weight_decay: float | None = None) -> None:
        super().__init__(learning_rate, weight_decay)
        self.rho = check("rho", rho, number(ge=0, lt=1), owner="Adadelta")
        self.epsilon = check("epsilon", epsilon, number(gt=0), owner="Adadelta")
        self._slot_init = {"accumulated_grad": 0.0, "accumulated_delta_var": 0.0}

    def _hyper(self) -> dict[str, Any]:
        return {"rho": self.rho, "epsilon": self.epsilon}

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        xp = kernels.array_module(var)
        acc_grad, acc_delta = slots["accumulated_grad"], slots["accumulated_delta_var"]
        acc_grad *= self.rho
        acc_grad += (1.0 - self.rho) * (grad * grad)
        delta = -xp.sqrt(acc_delta + self.epsilon) * grad / xp.sqrt(acc_grad + self.epsilon)
        acc_delta *= self.rho
        acc_delta += (1.0 - self.rho) * (delta * delta)
        var += lr * delta


#: ``prod_{i=1..n} (1 - 0.5 * 0.96 ** i)`` for ``n = 0..``: Nadam's momentum-cache products without ``beta_1``; past
#: the end every factor is 1.0 in float64 (0.5 * 0.96 ** 1000 < 1e-17)
_NADAM_CACHE = np.concatenate([[1.0], np.cumprod(1.0 - 0.5 * 0.96 ** np.arange(1, 1001, dtype=np.float64))])


class Nadam(Optimizer):
    """Keras's ``Nadam`` (Dozat 2016, Adam with Nesterov momentum and the momentum schedule
    ``u_t = beta_1 * (1 - 0.5 * 0.96 ** t)``). With ``t = step`` and ``P_t = u_1 * ... * u_t``::

        m = beta_1 * m + (1 - beta_1) * grad;  v = beta_2 * v + (1 - beta_2) * grad ** 2
        m_hat = u_{t+1} * m / (1 - P_{t+1}) + (1 - u_t) * grad / (1 - P_t)
        var -= lr * m_hat / (sqrt(v / (1 - beta_2 ** t)) + epsilon)

    Keras keeps ``P_t`` as an optimizer variable multiplied once per step; here it is computed from ``t`` (the same
    product, in float64), so a ps needs no state beyond the slots ``momentum`` and ``velocity``.
    """

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.001,
                 beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7,
                 weight_decay: float | None = None) -> None:
        super().__init__(learning_rate, weight_decay)
        self._moment_config = self._moments(beta_1, beta_2, epsilon)
        self._slot_init = {"momentum": 0.0, "velocity": 0.0}

    def _hyper(self) -> dict[str, Any]:
        return dict(self._moment_config)

    def _u(self, t: int) -> float:
        return self.beta_1 * (1.0 - 0.5 * 0.96 ** t)

    def _product(self, t: int) -> float:
        return self.beta_1 ** t * float(_NADAM_CACHE[min(t, len(_NADAM_CACHE) - 1)])

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        xp = kernels.array_module(var)
        m, v = slots["momentum"], slots["velocity"]
        m *= self.beta_1
        m += (1.0 - self.beta_1) * grad
        v *= self.beta_2
        v += (1.0 - self.beta_2) * (grad * grad)
        u_t, u_next = self._u(step), self._u(step + 1)
        product = self._product(step)
        m_hat = (u_next / (1.0 - product * u_next)) * m
        m_hat += ((1.0 - u_t) / (1.0 - product)) * grad
        denom = xp.sqrt(v / (1.0 - self.beta_2 ** step))
        denom += self.epsilon
        var -= lr * m_hat / denom


class Adamax(Optimizer):
    """Keras's ``Adamax`` (Kingma & Ba, section 7: Adam with the infinity norm). With ``t = step``::

        m = beta_1 * m + (1 - beta_1) * grad;  u = max(beta_2 * u, |grad|)
        var -= lr * m / ((1 - beta_1 ** t) * (u + epsilon))

    Slots ``momentum`` and ``norm``, both starting at 0.
    """

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.001,
                 beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7,
                 weight_decay: float | None = None) -> None:
        super().__init__(learning_rate, weight_decay)
        self._moment_config = self._moments(beta_1, beta_2, epsilon)
        self._slot_init = {"momentum": 0.0, "norm": 0.0}

    def _hyper(self) -> dict[str, Any]:
        return dict(self._moment_config)

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        xp = kernels.array_module(var)
        m, u = slots["momentum"], slots["norm"]
        m *= self.beta_1
        m += (1.0 - self.beta_1) * grad
        u *= self.beta_2
        xp.maximum(u, xp.abs(grad), out=u)
        denom = u + self.epsilon
        denom *= 1.0 - self.beta_1 ** step
        var -= lr * m / denom


class Lion(Optimizer):
    """Keras's ``Lion`` (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms")::

        var -= lr * sign(beta_1 * m + (1 - beta_1) * grad);  m = beta_2 * m + (1 - beta_2) * grad

    One slot, ``momentum``, starting at 0.
    """

    def __init__(self, learning_rate: float | LearningRateSchedule | Mapping[str, Any] = 0.001,
                 beta_1: float = 0.9, beta_2: float = 0.99, weight_decay: float | None = None) -> None:
        super().__init__(learning_rate, weight_decay)
        self.beta_1 = check("beta_1", beta_1, number(ge=0, le=1), owner="Lion")
        self.beta_2 = check("beta_2", beta_2, number(ge=0, le=1), owner="Lion")
        self._slot_init = {"momentum": 0.0}

    def _hyper(self) -> dict[str, Any]:
        return {"beta_1": self.beta_1, "beta_2": self.beta_2}

    def _update(self, var: Any, grad: Any, slots: dict[str, Any], lr: float, step: int) -> None:
        xp = kernels.array_module(var)
        m = slots["momentum"]
        var -= lr * xp.sign(self.beta_1 * m + (1.0 - self.beta_1) * grad)
        m *= self.beta_2
        m += (1.0 - self.beta_2) * grad


def _on_host(pairs: list[Any]) -> list[Any]:
    """``(gradient, variable)`` ``pairs`` with every device (CuPy) gradient -- dense arrays, IndexedSlices' values
    and indices -- moved to the host in one transfer (:func:`kernels.to_host`)."""
    slots: list[tuple[int, str]] = []  # (pair, "dense" | "values" | "indices")
    arrays: list[Any] = []
    for i, pair in enumerate(pairs):
        grad = pair[0] if isinstance(pair, (tuple, list)) and len(pair) == 2 else None
        if isinstance(grad, IndexedSlices):
            for part in ("values", "indices"):
                if kernels.array_module(getattr(grad, part)) is not np:
                    slots.append((i, part))
                    arrays.append(getattr(grad, part))
        elif grad is not None and kernels.array_module(grad) is not np:
            slots.append((i, "dense"))
            arrays.append(grad)
    if not arrays:
        return pairs
    moved = kernels.to_host(arrays)
    out = list(pairs)
    sparse: dict[int, dict[str, Any]] = {}
    for (i, part), host in zip(slots, moved):
        if part == "dense":
            out[i] = (host, pairs[i][1])
        else:
            sparse.setdefault(i, {})[part] = host
    for i, parts in sparse.items():
        grad = pairs[i][0]
        out[i] = (IndexedSlices(parts.get("values", grad.values), parts.get("indices", grad.indices),
                                grad.dense_shape), pairs[i][1])
    return out

