"""The sidecar evaluator: evaluates every new checkpoint the training writes, without the parameter servers.

It runs as the ``evaluator`` task (outside the training cluster, as in TensorFlow). It polls the checkpoint
directory, reads each new checkpoint directly from its files (whatever the number of shards it was saved with,
see :class:`~kubeps.runtime.checkpoint.CheckpointReader`), calls the evaluation function on its dataset and
appends one JSON line per checkpoint to the metrics file::

    {"checkpoint": ".../ckpt-7", "checkpoint_number": 7, "step": 700, "metrics": {"log_loss": 0.43},
     "time": 1718000000.0, "eval_seconds": 0.8}

With a log dir (the ``logdir`` argument, else ``$KUBEPS_LOGDIR`` of the evaluator's ``settings``) every numeric metric is also written as a
TensorBoard scalar to ``<logdir>/eval`` -- beside the chief's ``<logdir>/train`` -- at the checkpoint's step (its
number when it was saved without a step), so ``tensorboard --logdir <logdir>`` shows the eval curve with the train
curve. Needs the ``tensorboard`` extra (tensorboardX); without a log dir nothing of it is loaded.

It stops after the final checkpoint (the one saved with ``CheckpointManager.save(final=True)``), after
``max_evaluations`` evaluations, or when no new checkpoint appeared for ``timeout`` seconds. A restarted evaluator
reads its metrics file and carries on after the last checkpoint it evaluated. When it falls behind it evaluates
the newest checkpoint and skips the ones in between (as TensorFlow's ``SidecarEvaluator`` does).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from kubeps.runtime.checkpoint import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointReader,
    list_checkpoints,
)
from kubeps.runtime.checkpoint.reader import CheckpointTable
from kubeps.runtime.checks import PositiveInt, Seconds, check, check_callable
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.variables.context import frozen_lookups
from kubeps.runtime.observe.summary import SummaryWriter, resolve_logdir
from kubeps.runtime.util.storage import normalize_path, storage_for

__all__ = ["CheckpointValues", "SidecarEvaluator", "read_metrics"]

log = logging.getLogger(__name__)


class CheckpointValues(Mapping):
    """Variables of one checkpoint by name, read from the files on first access (and cached); a dynamic embedding
    table's name gives a :class:`~kubeps.runtime.checkpoint.reader.CheckpointTable` (``lookup(ids)``: its rows,
    the default row for ids it does not hold)."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self._cache: dict[str, Any] = {}

    @property
    def step(self) -> int | None:
        return self.reader.step

    @property
    def path(self) -> str:
        return self.reader.path

    @property
    def objects(self) -> dict[str, Any]:
        return self.reader.objects()

    def __getitem__(self, name: str) -> np.ndarray | CheckpointTable:
        if name not in self._cache:
            if name in self.reader.manifest.dynamic:
                self._cache[name] = self.reader.table(name)
            elif name in self.reader.manifest.variables:
                self._cache[name] = self.reader.get(name)
            else:
                raise KeyError(name)
        return self._cache[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.reader.names() + self.reader.tables())

    def __len__(self) -> int:
        return len(self.reader.manifest.variables) + len(self.reader.manifest.dynamic)

    def slot(self, name: str, slot: str) -> np.ndarray:
        return self.reader.get(name, slot=slot)


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics file (JSON lines); ``[]`` when it does not exist."""
    storage = storage_for(path)
    try:
        raw = storage.read_bytes(path).decode()
    except FileNotFoundError:
        return []
    records = []
    for i, line in enumerate(raw.splitlines()):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"metrics file {path} line {i + 1} is not JSON: {err}") from None
    return records


def _json_metric(name: str, value: Any) -> float | int | str | bool | None:
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(()).item()
    if isinstance(value, (np.generic,)):
        value = value.item()
    if isinstance(value, (int, float)):
        return value if not (isinstance(value, float) and not math.isfinite(value)) else str(value)
    raise TypeError(f"metric {name!r} has value {value!r} of type {type(value).__name__}; metrics must be numbers")


_REITERABLE = ("re-iterable (a list, a kubeps Dataset) or a function returning an iterable: every checkpoint is "
               "evaluated on a fresh pass")


class SidecarEvaluator:
    """Evaluate checkpoints as they appear.

    ``eval_fn(values, batches) -> {metric: number}`` gets a :class:`CheckpointValues` (variables by name, plus
    ``.step``) and an iterable of ``steps`` batches of ``data`` (all of it when ``steps`` is None). ``eval_fn`` may
    also be an object with an ``evaluate(values, batches)`` method. ``data`` is re-iterable (a list, a kubeps
    ``Dataset``) or a function returning a fresh iterable. ``logdir``: the job's TensorBoard log dir (default
    ``$KUBEPS_LOGDIR`` of ``settings``, the evaluator task's, e.g. ``TFConfigClusterResolver().settings``; unset:
    no event files); the metrics go to its ``eval`` subdirectory.
    """

    def __init__(
        self,
        eval_fn: Callable[[CheckpointValues, Iterable[Any]], Mapping[str, Any]] | Any,
        data: Iterable[Any] | Callable[[], Iterable[Any]],
        checkpoint_dir: str,
        *,
        steps: int | None = None,
        max_evaluations: int | None = None,
        metrics_path: str | None = None,
        poll_interval: float = 1.0,
        timeout: float | None = None,
        logdir: str | None = None,
        settings: TaskSettings | None = None,
    ):
        evaluate = getattr(eval_fn, "evaluate", None)
        if callable(evaluate):
            eval_fn = evaluate
        self.eval_fn = check_callable("eval_fn", eval_fn, owner="SidecarEvaluator",
                                      allowed="a callable eval_fn(values, batches), or an object with an evaluate method")
        if not callable(data) and (not isinstance(data, Iterable) or iter(data) is data):
            raise RuntimeConfigError("SidecarEvaluator.data", type(data).__name__, _REITERABLE)
        self.steps = check("steps", steps, PositiveInt | None, owner="SidecarEvaluator")
        self.max_evaluations = check("max_evaluations", max_evaluations, PositiveInt | None, owner="SidecarEvaluator")
        poll_interval = check("poll_interval", poll_interval, Seconds, owner="SidecarEvaluator")
        timeout = check("timeout", timeout, Seconds | None, owner="SidecarEvaluator")
        self.data = data
        self.checkpoint_dir = normalize_path(checkpoint_dir)
        storage = storage_for(self.checkpoint_dir)
        self.metrics_path = metrics_path or storage.join(self.checkpoint_dir, "eval", "metrics.jsonl")
        self.poll_interval = float(poll_interval)
        self.timeout = timeout
        self.records: list[dict[str, Any]] = []
        #: where the eval scalars go (``<logdir>/eval``), None when no log dir is set
        self.event_dir = resolve_logdir(logdir, "eval", settings)
        self._events = SummaryWriter(self.event_dir) if self.event_dir else None

    def _batches(self) -> Iterable[Any]:
        source = self.data() if callable(self.data) else self.data
        return source if self.steps is None else itertools.islice(iter(source), self.steps)

    def _append(self, record: dict[str, Any]) -> None:
        storage = storage_for(self.metrics_path)
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        if "://" not in self.metrics_path:
            os.makedirs(os.path.dirname(self.metrics_path) or ".", exist_ok=True)
            with open(self.metrics_path, "ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        else:  # object stores cannot append: rewrite the whole (small) file atomically
            try:
                old = storage.read_bytes(self.metrics_path)
            except FileNotFoundError:
                old = b""
            storage.write_bytes_atomic(self.metrics_path, old + line)

    def _write_events(self, record: dict[str, Any], metrics: Mapping[str, Any]) -> None:
        if self._events is None:
            return
        step = record["step"] if record["step"] is not None else record["checkpoint_number"]
        for name, value in metrics.items():
            if isinstance(value, (bool, str)) or value is None:
                continue  # kept in the metrics file; TensorBoard scalars are numbers
            self._events.scalar(str(name), value, step)
        self._events.flush()  # evaluations are rare: each one is on disk before the next checkpoint

    def close(self) -> None:
        """Flush and close the event file (``start`` does it when it returns)."""
        if self._events is not None:
            self._events.close()

    def evaluate(self, path: str) -> dict[str, Any]:
        """Evaluate one checkpoint and record the result; returns the record."""
        reader = CheckpointReader(path)
        values = CheckpointValues(reader)
        start = time.monotonic()
        with frozen_lookups():  # a table restored into this process reads as in evaluation: nothing is admitted
            metrics = self.eval_fn(values, self._batches())
        if not isinstance(metrics, Mapping):
            raise TypeError(f"eval_fn returned {type(metrics).__name__}; it must return a dict of metric -> number")
        number = int(re.search(r"(\d+)$", reader.path).group(1))  # type: ignore[union-attr]  # ckpt-N always matches
        record = {
            "checkpoint": reader.path,
            "checkpoint_number": number,
            "step": reader.step,
            "final": reader.final,
            "metrics": {str(k): _json_metric(str(k), v) for k, v in metrics.items()},
            "time": time.time(),
            "eval_seconds": round(time.monotonic() - start, 4),
        }
        self._append(record)
        self._write_events(record, metrics)
        self.records.append(record)
        log.info("evaluated %s (step %s): %s", reader.path, reader.step, record["metrics"])
        return record

    def start(self) -> list[dict[str, Any]]:
        """Poll and evaluate until the final checkpoint, ``max_evaluations`` or ``timeout``; returns the records."""
        try:
            return self._poll()
        finally:
            self.close()

    def _poll(self) -> list[dict[str, Any]]:
        done = read_metrics(self.metrics_path)
        last = max((r.get("checkpoint_number", -1) for r in done), default=-1)
        if any(r.get("final") for r in done):
            log.info("the metrics file %s already holds the final checkpoint", self.metrics_path)
            return []
        evaluations = 0
        idle_since = time.monotonic()
        while True:
            fresh = [(n, p) for n, p in list_checkpoints(self.checkpoint_dir) if n > last]
            if fresh:
                number, path = fresh[-1]
                try:
                    record = self.evaluate(path)
                except CheckpointNotFoundError as err:  # deleted by max_to_keep while we read it
                    log.warning("checkpoint %s went away while being evaluated (%s); trying the next", path, err)
                    last = number
                    continue
                except CheckpointCorruptError as err:
                    log.error("skipping corrupt checkpoint %s: %s", path, err)
                    last = number
                    continue
                last = number
                evaluations += 1
                idle_since = time.monotonic()
                if record["final"]:
                    return self.records
                if self.max_evaluations is not None and evaluations >= self.max_evaluations:
                    return self.records
                continue
            if self.timeout is not None and time.monotonic() - idle_since > self.timeout:
                log.warning("no new checkpoint in %s for %.0f s; stopping", self.checkpoint_dir, self.timeout)
                return self.records
            time.sleep(self.poll_interval)

    run = start

