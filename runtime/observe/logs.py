"""A task's log lines, as text (the default) or as JSON objects (``KUBEPS_LOG_FORMAT=json``): :func:`configure`.

A JSON line is one object with ``time`` (RFC 3339, UTC), ``level``, ``logger``, ``message``, the task's ``job``,
``role`` and ``index``, and ``step`` (the training step last reported through
:class:`~kubeps.runtime.observe.train_metrics.TrainMetricsLogger` or :func:`set_step`; absent before), plus
``exception`` with the traceback when there is one. ``job`` is read from the task's own address in TF_CONFIG
(the operator names a task's host ``<job>-<role>-<index>.<namespace>.svc``); a task whose address says nothing of
it (``kubeps local``'s loopback ports) logs ``job`` as ``local``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from kubeps.runtime.settings import TaskSettings

__all__ = ["JsonFormatter", "configure", "identity_of", "set_step"]

_TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_step: int | None = None


def set_step(step: int) -> None:
    """The training step the next log lines carry (``step`` field of JSON lines)."""
    global _step
    _step = int(step)


def identity_of(settings: TaskSettings) -> dict[str, Any]:
    """The job, role and index of the task the settings' TF_CONFIG names (``local``, ``""``, -1 when it names none)."""
    try:
        config = json.loads(settings.tf_config or "{}")
        task = config.get("task") or {}
        role, index = str(task.get("type", "")), int(task.get("index", -1))
        address = str(((config.get("cluster") or {}).get(role) or [""])[index]) if role and index >= 0 else ""
    except (ValueError, TypeError, IndexError, AttributeError):
        role, index, address = "", -1, ""
    found = re.match(rf"^(?P<job>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-{re.escape(role)}-{index}\.", address) if role else None
    return {"job": found["job"] if found else "local", "role": role, "index": index}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the task's identity, the step, any exception."""

    def __init__(self, identity: dict[str, Any]):
        super().__init__()
        self.identity = dict(identity)

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self.identity,
        }
        if _step is not None:
            line["step"] = _step
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(settings: TaskSettings) -> None:
    """Set up the root logger at the settings' level, as text or JSON lines (``log_format``), replacing handlers
    a previous call installed (``logging.basicConfig`` does nothing once the root logger has one)."""
    root = logging.getLogger()
    handler = logging.StreamHandler()
    if settings.log_format == "json":
        handler.setFormatter(JsonFormatter(identity_of(settings)))
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level)
