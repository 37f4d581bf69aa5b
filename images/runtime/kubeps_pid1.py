"""Imported at interpreter start-up in the kubeps runtime images (``kubeps_pid1.pth`` in the venv's site-packages;
not a ``sitecustomize``, which Debian's Python already has): SIGTERM keeps its ordinary meaning for a program that
runs as PID 1 of its container (a pod's main process, e.g. ``python examples/ctr/train.py``).

The kernel delivers no signal to a PID namespace's init for which that process has no handler, so a Python
program as PID 1 ignored SIGTERM and every pod delete waited out the whole grace period before SIGKILL. Here,
only when this process is PID 1 and SIGTERM still has its default disposition, a handler exits at once with
status 143 (128 + SIGTERM), as the default action does for any other process. A program that installs its own
handler (``python -m kubeps.runtime.server`` does, to stop its server) replaces this one.
"""

import os
import signal
import sys


def _exit_on_sigterm(signum, frame):  # noqa: ARG001
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(128 + signum)


if os.getpid() == 1 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
