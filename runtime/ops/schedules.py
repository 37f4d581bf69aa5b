"""Learning-rate schedules, evaluated on the parameter servers from each variable's update count (TensorFlow's and
Keras's ``ExponentialDecay``, ``InverseTimeDecay``, ``PiecewiseConstantDecay``, ``PolynomialDecay``, ``CosineDecay``,
``CosineDecayRestarts``, the same formulas in float64): a
schedule is evaluated at ``step - 1``, as TF evaluates it at ``optimizer.iterations`` before incrementing. A
schedule that would give a non-finite rate before :data:`MAX_SCHEDULE_STEP` is refused when it is configured.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from kubeps.runtime.checks import Flag, check, integer, number
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.ops.hyperparams import build

__all__ = [
    "MAX_SCHEDULE_STEP",
    "LearningRateSchedule",
    "ExponentialDecay",
    "InverseTimeDecay",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "CosineDecay",
    "CosineDecayRestarts",
    "schedule_from_config",
]


#: the last step a schedule is checked to be finite at, when it is configured (a ps refuses an update whose learning
#: rate is not finite, naming the step, before it changes anything)
MAX_SCHEDULE_STEP = 2**31 - 1
_FLOAT_MAX = float(np.finfo(np.float64).max)

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
    return build("learning-rate schedule", _SCHEDULES, config)


class ExponentialDecay(LearningRateSchedule):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)`` (integer division when ``staircase``)."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, decay_rate: float,
                 staircase: bool = False) -> None:
        o = "ExponentialDecay"
        self.initial_learning_rate = check("initial_learning_rate", initial_learning_rate, number(gt=0), owner=o)
        self.decay_steps = check("decay_steps", decay_steps, integer(ge=1), owner=o)
        self.decay_rate = check("decay_rate", decay_rate, number(gt=0), owner=o)
        self.staircase = check("staircase", staircase, Flag, owner=o)
        if self.decay_rate > 1:  # a growing rate must stay finite over every step a ps can reach
            steps = MAX_SCHEDULE_STEP / self.decay_steps
            top = math.log(self.initial_learning_rate) + steps * math.log(self.decay_rate)
            if top >= math.log(_FLOAT_MAX):
                raise RuntimeConfigError(f"{o}.decay_rate", decay_rate, f"<= 1, or a growth that stays finite up to step "
                                         f"{MAX_SCHEDULE_STEP} (with decay_steps={decay_steps!r} it overflows)")

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
        self.initial_learning_rate = check("initial_learning_rate", initial_learning_rate, number(gt=0), owner=o)
        self.decay_steps = check("decay_steps", decay_steps, integer(ge=1), owner=o)
        self.decay_rate = check("decay_rate", decay_rate, number(ge=0), owner=o)
        self.staircase = check("staircase", staircase, Flag, owner=o)

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
            raise RuntimeConfigError(f"{o}.boundaries", boundaries, "a non-empty list of integers")
        if not isinstance(values, (list, tuple)) or len(values) != len(boundaries) + 1:
            raise RuntimeConfigError(f"{o}.values", values, f"a list of len(boundaries) + 1 = {len(boundaries) + 1} "
                                     "positive numbers")
        self.boundaries = [check(f"boundaries[{i}]", b, integer(ge=0), owner=o) for i, b in enumerate(boundaries)]
        if any(b2 <= b1 for b1, b2 in zip(self.boundaries, self.boundaries[1:])):
            raise RuntimeConfigError(f"{o}.boundaries", boundaries, "strictly increasing integers")
        self.values = [check(f"values[{i}]", v, number(gt=0), owner=o) for i, v in enumerate(values)]

    def __call__(self, step: int) -> float:
        for b, v in zip(self.boundaries, self.values):
            if step <= b:
                return v
        return self.values[-1]

    def _config(self) -> dict[str, Any]:
        return {"boundaries": list(self.boundaries), "values": list(self.values)}


class PolynomialDecay(LearningRateSchedule):
    """``(initial - end) * (1 - step / decay_steps) ** power + end`` with ``step`` capped at ``decay_steps``; with
    ``cycle``, ``decay_steps`` is instead multiplied by ``ceil(step / decay_steps)`` (1 at step 0), TF's rule."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, end_learning_rate: float = 0.0001,
                 power: float = 1.0, cycle: bool = False) -> None:
        o = "PolynomialDecay"
        self.initial_learning_rate = check("initial_learning_rate", initial_learning_rate, number(gt=0), owner=o)
        self.decay_steps = check("decay_steps", decay_steps, integer(ge=1), owner=o)
        self.end_learning_rate = check("end_learning_rate", end_learning_rate, number(ge=0), owner=o)
        self.power = check("power", power, number(gt=0), owner=o)
        self.cycle = check("cycle", cycle, Flag, owner=o)

    def __call__(self, step: int) -> float:
        if self.cycle:
            frac = 1.0 - step / (self.decay_steps * max(1, math.ceil(step / self.decay_steps)))
        else:
            frac = 1.0 - min(step, self.decay_steps) / self.decay_steps
        return (self.initial_learning_rate - self.end_learning_rate) * frac ** self.power + self.end_learning_rate

    def _config(self) -> dict[str, Any]:
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "end_learning_rate": self.end_learning_rate, "power": self.power, "cycle": self.cycle}


class CosineDecay(LearningRateSchedule):
    """Cosine decay with optional linear warmup (TF 2.13+ ``CosineDecay``).

    During ``warmup_steps`` the rate rises linearly from ``initial_learning_rate`` to ``warmup_target``
    (no warmup when ``warmup_target`` is None); then, over ``decay_steps``, it falls as
    ``peak * ((1 - alpha) * 0.5 * (1 + cos(pi * s / decay_steps)) + alpha)`` and stays at ``peak * alpha``.
    """

    def __init__(self, initial_learning_rate: float, decay_steps: int, alpha: float = 0.0,
                 warmup_target: float | None = None, warmup_steps: int = 0) -> None:
        o = "CosineDecay"
        self.initial_learning_rate = check("initial_learning_rate", initial_learning_rate, number(ge=0), owner=o)
        self.decay_steps = check("decay_steps", decay_steps, integer(ge=1), owner=o)
        self.alpha = check("alpha", alpha, number(ge=0, le=1), owner=o)
        self.warmup_target = None if warmup_target is None else check("warmup_target", warmup_target, number(gt=0), owner=o)
        self.warmup_steps = check("warmup_steps", warmup_steps, integer(ge=0), owner=o)
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


class CosineDecayRestarts(LearningRateSchedule):
    """Cosine decay with warm restarts (SGDR, Loshchilov & Hutter 2017; TF's and Keras's ``CosineDecayRestarts``).

    Period ``i`` (from 0) lasts ``first_decay_steps * t_mul ** i`` steps and starts from ``m_mul ** i`` times the
    initial rate; within it, with ``f`` the fraction of the period done, the rate is
    ``initial_learning_rate * ((1 - alpha) * m_mul ** i * 0.5 * (1 + cos(pi * f)) + alpha)``.
    """

    def __init__(self, initial_learning_rate: float, first_decay_steps: int, t_mul: float = 2.0,
                 m_mul: float = 1.0, alpha: float = 0.0) -> None:
        o = "CosineDecayRestarts"
        self.initial_learning_rate = check("initial_learning_rate", initial_learning_rate, number(gt=0), owner=o)
        self.first_decay_steps = check("first_decay_steps", first_decay_steps, integer(ge=1), owner=o)
        self.t_mul = check("t_mul", t_mul, number(ge=1), owner=o)
        self.m_mul = check("m_mul", m_mul, number(ge=0, le=1), owner=o)
        self.alpha = check("alpha", alpha, number(ge=0, le=1), owner=o)

    def __call__(self, step: int) -> float:
        done = step / self.first_decay_steps
        if self.t_mul == 1.0:
            restart = math.floor(done)
            frac = done - restart
        else:
            restart = math.floor(math.log(1.0 - done * (1.0 - self.t_mul)) / math.log(self.t_mul))
            start = (1.0 - self.t_mul ** restart) / (1.0 - self.t_mul)  # periods done, in first periods
            frac = (done - start) / self.t_mul ** restart
        cosine = 0.5 * self.m_mul ** restart * (1.0 + math.cos(math.pi * frac))
        return self.initial_learning_rate * ((1.0 - self.alpha) * cosine + self.alpha)

    def _config(self) -> dict[str, Any]:
        return {"initial_learning_rate": self.initial_learning_rate, "first_decay_steps": self.first_decay_steps,
                "t_mul": self.t_mul, "m_mul": self.m_mul, "alpha": self.alpha}
