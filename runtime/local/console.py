"""What a local job writes: each task's lines with a ``[type-index]`` prefix on the output stream (stdout by
default), the launcher's own messages as ``[kubeps] ...`` on the log stream (stderr by default), a line at a time
from whichever thread has one."""

from __future__ import annotations

import sys
import threading
from typing import IO

__all__ = ["Console"]


class Console:
    """The two streams of a local job (``output``, ``log``; None: this process's stdout and stderr as they are when
    a line is written) and the lock that keeps their lines whole."""

    def __init__(self, output: IO[str] | None = None, log: IO[str] | None = None):
        self._output = output
        self._log = log
        self._lock = threading.Lock()

    def report(self, message: str) -> None:
        """A launcher message, ``[kubeps] ...``, on the log stream."""
        with self._lock:
            stream = self._log if self._log is not None else sys.stderr
            stream.write(f"[kubeps] {message}\n")
            stream.flush()

    def pump(self, name: str, stream: IO[bytes]) -> None:
        """Copy the lines of ``stream`` (a task's stdout and stderr) to the output stream, each prefixed with
        ``[name]``, until it ends; then close it. A closed output stream is no reason to stop: the task must never
        block on a full pipe."""
        prefix = f"[{name}] "
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                with self._lock:
                    try:
                        out = self._output if self._output is not None else sys.stdout
                        out.write(prefix + line + "\n")
                        out.flush()
                    except (OSError, ValueError):
                        pass  # our own stdout is gone (a closed pipe): keep draining so the task never blocks
        except (OSError, ValueError):  # the task's pipe was closed under us during shutdown
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass
