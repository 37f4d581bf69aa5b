"""The chief's side of the exit-status contract (:mod:`kubeps.runtime.contract`): a chief that lost a parameter
server exits with :data:`EXIT_PS_UNAVAILABLE` so that it is restarted and restores its latest checkpoint.

The contract (the same in Kubernetes and locally):

- A worker that fails is restarted at the same address; the coordinator re-queues its closures and rebuilds its
  datasets when it comes back. Training goes on.
- A parameter server that fails loses its variables. The chief cannot recover in place: schedule/join/done raise
  :class:`~kubeps.runtime.errors.PSUnavailableError` and the chief exits with :data:`EXIT_PS_UNAVAILABLE` (133).
  Exit codes >= 128 are *retryable* for the operator's default ``ExitCode`` restart policy (as for Kubeflow's
  training operators: 1-127 permanent, 128-255 retryable), so the chief is restarted, re-creates its variables and
  restores the latest checkpoint; at most the steps since that checkpoint are lost.
- The chief exiting 0 ends the job; 1-127 fails it.

:func:`run_coordinator` gives a training program that behaviour: it runs ``main_fn`` and turns a
``PSUnavailableError`` into exit status 133. :func:`install_excepthook` does the same for programs that do not wrap
their main function.

The restart policy of ``kubeps local`` is :class:`~kubeps.runtime.local.policy.RestartPolicy`.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from types import TracebackType
from typing import Any, Callable

from kubeps.runtime.contract import EXIT_PS_UNAVAILABLE
from kubeps.runtime.errors import PSUnavailableError

__all__ = [
    "EXIT_PS_UNAVAILABLE",
    "install_excepthook",
    "ps_unavailable_cause",
    "run_coordinator",
]

log = logging.getLogger(__name__)

def ps_unavailable_cause(exc: BaseException | None) -> PSUnavailableError | None:
    """The :class:`PSUnavailableError` in ``exc``'s cause/context chain, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, PSUnavailableError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _exit_for_ps_loss(err: PSUnavailableError, exit: Callable[[int], Any]) -> Any:
    sys.stderr.write(
        f"kubeps: {err}\nkubeps: the chief exits with status {EXIT_PS_UNAVAILABLE} (retryable): restart it after the "
        "parameter server is back, and it resumes from the latest checkpoint\n"
    )
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream
            pass
    return exit(EXIT_PS_UNAVAILABLE)


def run_coordinator(main_fn: Callable[[], Any], *, hard_exit: bool = True) -> Any:
    """Run the chief's ``main_fn``; a lost parameter server ends the process with :data:`EXIT_PS_UNAVAILABLE`.

    With ``hard_exit`` (default) the process ends at once with ``os._exit`` after printing the error and flushing
    stdout/stderr: coordinator threads blocked on a dead parameter server cannot delay it past the detection
    budget. Other exceptions propagate unchanged (exit status 1: permanent).
    """
    try:
        return main_fn()
    except BaseException as exc:  # noqa: BLE001 - inspected, re-raised unless it is a PS loss
        err = ps_unavailable_cause(exc)
        if err is None:
            raise
        traceback.print_exc()
        if hard_exit:
            return _exit_for_ps_loss(err, os._exit)
        return _exit_for_ps_loss(err, sys.exit)


def install_excepthook() -> None:
    """Make an uncaught :class:`PSUnavailableError` (in the main thread) exit with :data:`EXIT_PS_UNAVAILABLE`."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(exc_type, exc, tb)
        err = ps_unavailable_cause(exc)
        if err is not None:
            _exit_for_ps_loss(err, os._exit)

    sys.excepthook = hook
