"""Training rates between two calls: what the chief writes every ``steps_per_execution`` steps.

TensorFlow's training loops write ``loss`` and ``global_step/sec`` (and, on TPUs, ``examples/sec``) to the train
log dir. :class:`TrainMetricsLogger` does the same for any writer with a ``scalar(name, value, step)`` method
(:class:`kubeps.runtime.observe.summary.SummaryWriter`): each :meth:`~TrainMetricsLogger.log` call writes the loss and
any other metrics given, and the steps and examples per second since the previous call (or since the logger was
created, for the first call)::

    logger = TrainMetricsLogger(writer, batch_size=512, start_step=0)
    ...  # schedule and join steps_per_execution steps
    logger.log(step=20, loss=0.41)   # loss, global_step/sec, examples/sec at step 20

Where the task records metrics (:mod:`kubeps.runtime.observe.metrics`), each call also sets ``kubeps_train_step``
and counts the steps and examples since the previous call (``kubeps_train_steps_total``,
``kubeps_train_examples_total``).
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

from kubeps.runtime.checks import PositiveInt, check
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.observe import logs as _logs
from kubeps.runtime.observe import metrics as _metrics
from kubeps.runtime.observe.summary import as_scalar, as_step

__all__ = ["ScalarWriter", "TrainMetricsLogger"]


class ScalarWriter(Protocol):
    """What the logger needs of a writer (:class:`~kubeps.runtime.observe.summary.SummaryWriter` has it)."""

    def scalar(self, name: str, value: float, step: int) -> None: ...


class TrainMetricsLogger:
    """Writes ``loss``, ``global_step/sec`` and ``examples/sec`` (and any other metrics given) at each call.

    ``writer`` None writes no event file: the logger then only keeps the task's Prometheus progress metrics.

    ``batch_size`` is the number of examples in one training step (the global batch: the examples every step
    consumes, whichever worker runs it); without it no ``examples/sec`` is written. ``start_step`` is the step
    training starts (or resumes) from. ``clock`` returns seconds (``time.perf_counter``; tests pass their own).
    """

    def __init__(
        self,
        writer: ScalarWriter | None,
        *,
        batch_size: int | None = None,
        start_step: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if writer is not None and not callable(getattr(writer, "scalar", None)):
            raise RuntimeConfigError(
                "writer", writer, "an object with a scalar(name, value, step) method, e.g. kp.summary.create_file_writer(),"
                " or None (the Prometheus metrics only)"
            )
        self.writer = writer
        self.batch_size = check("batch_size", batch_size, PositiveInt | None,
                                allowed="None or an int >= 1 (examples per training step)")
        self.clock = clock
        self.last_step = as_step(start_step, field="start_step")
        self.last_time = clock()

    def log(self, step: int, loss: float | None = None, **metrics: float) -> dict[str, float]:
        """Write the metrics at ``step`` and the rates since the previous call; returns what was written.

        ``step`` must not go back (a step equal to the previous one writes the metrics but no rates). Values are
        numbers; a non-finite loss is written as is (TensorBoard shows it) so a diverging run is visible.
        """
        step = as_step(step)
        if step < self.last_step:
            raise RuntimeConfigError(
                "step", step, f"an int >= {self.last_step}, the step of the previous call (steps never go back)"
            )
        now = self.clock()
        values: dict[str, float] = {}
        if loss is not None:
            values["loss"] = as_scalar("loss", loss)
        values.update({name: as_scalar(name, value) for name, value in metrics.items()})
        elapsed = now - self.last_time
        if step > self.last_step and elapsed > 0:
            steps_per_s = (step - self.last_step) / elapsed
            values["global_step/sec"] = steps_per_s
            if self.batch_size is not None:
                values["examples/sec"] = steps_per_s * self.batch_size
        if self.writer is not None:
            for name, value in values.items():
                self.writer.scalar(name, value, step)
        if _metrics.ENABLED:  # the same progress in Prometheus: kubeps_train_step, ..._steps_total, ..._examples_total
            _metrics.TRAIN_STEP.set(step)
            _metrics.TRAIN_STEPS.inc(step - self.last_step)
            if self.batch_size is not None:
                _metrics.TRAIN_EXAMPLES.inc((step - self.last_step) * self.batch_size)
        _logs.set_step(step)
        self.last_step, self.last_time = step, now
        return values
