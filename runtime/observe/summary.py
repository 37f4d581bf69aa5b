"""TensorBoard event files without TensorFlow: ``tf.summary``'s writer API, backed by tensorboardX.

As in TensorFlow::

    writer = kp.summary.create_file_writer("/logs/run-1/train")   # or settings=strategy.settings: $KUBEPS_LOGDIR
    writer.scalar("loss", 0.41, step=100)                          # TF: tf.summary.scalar("loss", 0.41, step=100)
    with writer.as_default():
        kp.summary.scalar("loss", 0.40, step=120)                  # the default writer, as tf.summary does
    writer.close()

``tensorboard --logdir /logs/run-1`` then shows the run; the convention (TensorFlow's and Keras's) is one log dir per
job with a ``train`` subdirectory the chief writes and an ``eval`` subdirectory the sidecar evaluator writes, so both
curves share one chart. :func:`resolve_logdir` builds those paths from an argument or ``$KUBEPS_LOGDIR`` of the task's settings
(``strategy.settings`` on the chief, ``resolver.settings`` in the evaluator).

Where event files can go (what tensorboardX writes to): a local path (a mounted volume in a pod) or a ``file://``
URL; ``s3://bucket/dir`` (tensorboardX's own writer, needs ``boto3``; ``S3_ENDPOINT`` selects a non-AWS endpoint)
and ``gs://bucket/dir`` (needs ``google-cloud-storage``); both re-upload the whole file at every flush. Other URL
schemes (those fsspec knows, such as ``abfs://``) are refused with an error naming these.

Needs the ``tensorboard`` extra (``pip install 'kubeps[tensorboard]'``): tensorboardX is imported when a writer is
created, never by ``import kubeps.runtime``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import threading
from typing import Any, Iterator, Mapping

from kubeps.runtime.contract import LOGDIR_ENV
from kubeps.runtime.checks import NonNegativeInt, PositiveInt, RealNumber, Seconds, check
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.settings import TaskSettings

__all__ = ["SummaryWriter", "as_scalar", "as_step", "create_file_writer", "resolve_logdir", "scalar"]

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")
#: URL schemes tensorboardX writes to itself (besides local paths and file://)
WRITER_SCHEMES = ("s3", "gs")
_ALLOWED_LOGDIR = (
    f"a local directory, a file:// URL, or an s3:// or gs:// URL (tensorboardX's writers), given as the argument "
    f"or in ${LOGDIR_ENV} of the task's settings (settings=strategy.settings)"
)

_default_writer: contextvars.ContextVar[SummaryWriter | None] = contextvars.ContextVar(
    "kubeps_default_summary_writer", default=None
)


def as_scalar(name: str, value: Any) -> float:
    """``value`` as a float: an int, a float, a numpy scalar or a one-element array; else a RuntimeConfigError."""
    if hasattr(value, "item") and getattr(value, "size", None) == 1:
        value = value.item()
    real: float = check(f"summary scalar {name!r}", value, RealNumber,
                        allowed="a real number (int, float, numpy scalar or one-element array)")
    return real


def as_step(step: Any, field: str = "step") -> int:
    """``step`` as an int >= 0 (numpy integers too); else a RuntimeConfigError naming ``field``."""
    step_: int = check(field, step, NonNegativeInt, allowed="an int >= 0 (the training step the value belongs to)")
    return step_


def _check_logdir(logdir: Any) -> str:
    if not isinstance(logdir, (str, os.PathLike)) or not os.fspath(logdir):
        raise RuntimeConfigError("logdir", logdir, _ALLOWED_LOGDIR)
    path = os.fspath(logdir)
    if not isinstance(path, str):
        raise RuntimeConfigError("logdir", logdir, _ALLOWED_LOGDIR)
    match = _SCHEME.match(path)
    if match is None:
        return path
    if match.group(1) == "file":
        return path[len("file://"):] or "/"
    if match.group(1) in WRITER_SCHEMES:
        return path.rstrip("/")
    raise RuntimeConfigError("logdir", path, _ALLOWED_LOGDIR + f"; scheme {match.group(1)!r} is not one of these")


def _join(base: str, sub: str) -> str:
    return f"{base}/{sub}" if _SCHEME.match(base) else os.path.join(base, sub)


def resolve_logdir(logdir: str | os.PathLike[str] | None = None, subdir: str | None = None,
                   settings: TaskSettings | None = None) -> str | None:
    """The log dir: ``logdir``, else ``$KUBEPS_LOGDIR`` of the task's ``settings`` (``settings.logdir``: those its
    strategy, server or resolver read), with ``subdir`` (``"train"``, ``"eval"``) appended; None when neither is
    set (then nothing is written). Checked: a local path, ``file://``, ``s3://`` or ``gs://``."""
    chosen: Any = logdir if logdir is not None else (None if settings is None else settings.logdir)
    if chosen is None:
        return None
    path = _check_logdir(chosen)
    return _join(path, subdir) if subdir else path


def _import_tensorboardx() -> Any:
    try:
        import tensorboardX  # noqa: PLC0415 - optional: loads only in a process that writes event files
    except ImportError as err:
        raise ImportError(
            f"TensorBoard event files need tensorboardX ({err}); install it with: pip install 'kubeps[tensorboard]'"
        ) from err
    return tensorboardX


class SummaryWriter:
    """Writes scalars to an event file in ``logdir`` (created if missing), as ``tf.summary``'s writer does.

    ``purge_step``: when a restarted chief resumes from a checkpoint at step S, pass S + 1; TensorBoard then hides
    the events of the earlier run at steps >= S + 1, which the resumed run writes again. ``max_queue`` events are
    buffered, and written at least every ``flush_secs`` seconds (TensorFlow's default is 120 s; 30 s shows a running
    job sooner). Thread-safe. A context manager: closed on exit.
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        *,
        purge_step: int | None = None,
        max_queue: int = 10,
        flush_secs: float = 30.0,
    ):
        self.logdir = _check_logdir(logdir)
        if purge_step is not None:
            purge_step = as_step(purge_step, field="purge_step")
        max_queue = check("max_queue", max_queue, PositiveInt, allowed="an int >= 1 (events buffered before a write)")
        flush_secs = check("flush_secs", flush_secs, Seconds)
        tensorboardx = _import_tensorboardx()
        self._lock = threading.Lock()
        self._closed = False
        self._writer = tensorboardx.SummaryWriter(
            logdir=self.logdir, purge_step=purge_step, max_queue=max_queue, flush_secs=flush_secs
        )

    def _live(self) -> Any:
        if self._closed:
            raise RuntimeError(f"the summary writer of {self.logdir} is closed; create a new one to write again")
        return self._writer

    def scalar(self, name: str, value: Any, step: int) -> None:
        """Write ``value`` (a number) under the tag ``name`` (``"loss"``, ``"eval/auc"``) at ``step``."""
        if not isinstance(name, str) or not name:
            raise RuntimeConfigError("name", name, "a non-empty string (the tag, e.g. 'loss')")
        number, step = as_scalar(name, value), as_step(step)
        with self._lock:
            self._live().add_scalar(name, number, global_step=step)

    def scalars(self, values: Mapping[str, Any], step: int) -> None:
        """Write every ``name: value`` of ``values`` at ``step``."""
        for name, value in values.items():
            self.scalar(name, value, step)

    def flush(self) -> None:
        """Write buffered events to the file now."""
        with self._lock:
            self._live().flush()

    def close(self) -> None:
        """Flush and close the event file; closing twice is a no-op."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._writer.close()

    @contextlib.contextmanager
    def as_default(self) -> Iterator[SummaryWriter]:
        """Make this the writer :func:`scalar` writes to, inside the ``with`` block (as in ``tf.summary``)."""
        token = _default_writer.set(self)
        try:
            yield self
        finally:
            _default_writer.reset(token)

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SummaryWriter({self.logdir!r}{', closed' if self._closed else ''})"


def create_file_writer(
    logdir: str | os.PathLike[str] | None = None,
    *,
    purge_step: int | None = None,
    max_queue: int = 10,
    flush_secs: float = 30.0,
    settings: TaskSettings | None = None,
) -> SummaryWriter:
    """A :class:`SummaryWriter` for ``logdir``, else ``$KUBEPS_LOGDIR`` of ``settings``, the task's (e.g.
    ``strategy.settings``) (``tf.summary.create_file_writer``)."""
    resolved = resolve_logdir(logdir, settings=settings)
    if resolved is None:
        raise RuntimeConfigError("logdir", logdir, _ALLOWED_LOGDIR + "; neither is set")
    return SummaryWriter(resolved, purge_step=purge_step, max_queue=max_queue, flush_secs=flush_secs)


def scalar(name: str, value: Any, step: int) -> bool:
    """Write to the default writer (:meth:`SummaryWriter.as_default`); False, and nothing written, when there is
    none -- as ``tf.summary.scalar`` does."""
    writer = _default_writer.get()
    if writer is None:
        return False
    writer.scalar(name, value, step)
    return True
