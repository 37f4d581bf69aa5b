"""Preemption: on SIGTERM (a pod's termination grace, Kueue preemption, a node drain) the chief saves a checkpoint
with the newest :class:`~kubeps.runtime.checkpoint.manager.CheckpointManager` of its program, then ends as SIGTERM
would have ended it (status 143, retryable: the operator and ``kubeps local --restart`` start it again, and
``restore_or_initialize`` resumes from that checkpoint). With ``incremental=True`` the save writes only the rows
changed since the last checkpoint, which is what fits in a grace period.

:func:`install` puts the handler in place when a manager is made in the main thread and SIGTERM has its default
action (a program's own handler is left alone). The handler runs in the main thread between two of its bytecodes:
a save the main thread itself was making is finished first (the manager ends the process once it is committed); a
background save (``save(wait=False)``) is waited for, then the handler saves what changed since. A step the handler
interrupts may be half done (its push applied, its step not yet counted): :func:`deferred` around a step makes the
signal wait for the step's end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

__all__ = ["deferred", "install", "terminate"]

_installed = False


def terminate() -> None:
    """End this process as SIGTERM's default action does (status 143)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


#: how deep the main thread is in :func:`deferred` blocks, and whether a SIGTERM waits for the outermost one's end
_deferral = {"depth": 0, "pending": False}
_handler: Callable[[], None] | None = None


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A SIGTERM that arrives inside the block is handled when it ends: wrap one training step (its push and its
    step count) so that the checkpoint the handler saves holds whole steps only (none half counted)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferral["depth"] += 1
    try:
        yield
    finally:
        _deferral["depth"] -= 1
        if not _deferral["depth"] and _deferral["pending"] and _handler is not None:
            _deferral["pending"] = False
            _handler()


def install(newest: Callable[[], Any]) -> bool:
    """Save with ``newest()`` (the newest manager, or None) on SIGTERM, then exit as SIGTERM would; returns whether
    the handler is in place (only the main thread can install one, and only over the default action)."""
    global _installed, _handler
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False

    def on_sigterm(signum: int, frame: Any) -> None:  # noqa: ARG001 - the signal module's signature
        if _deferral["depth"]:  # inside a step: handled at its end
            _deferral["pending"] = True
            return
        preempted()

    def preempted() -> None:
        manager = newest()
        if manager is None:
            terminate()
            return
        if manager.saving_in_this_thread():
            log.warning("SIGTERM during a checkpoint save: the process ends once it is committed")
            manager.exit_after_save = True
            return
        log.warning("SIGTERM: saving a checkpoint of the steps since the last one before the process ends")
        try:
            manager.save()
        except Exception:  # noqa: BLE001 - the process ends either way; the previous checkpoint stays
            log.exception("the checkpoint save on SIGTERM failed; the previous checkpoint is the newest")
        terminate()

    _handler = preempted
    signal.signal(signal.SIGTERM, on_sigterm)
    _installed = True
    return True
