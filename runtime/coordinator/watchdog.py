"""A watchdog that dumps every thread's stack when training makes no progress (diagnosis only).

Without fail-fast RPCs a failure shows up as a hang; with them a bug still can. As TensorFlow's coordinator
watchdog does, :class:`Watchdog` notices when no closure finished for ``timeout`` seconds and writes the stack of
every thread of the process to ``output`` (stderr by default), then calls ``on_triggered``. It never stops or
changes the training.

Progress is reported either by calling :meth:`Watchdog.notify` (the coordinator does when a closure finishes) or
by giving ``progress``: a function returning anything that changes when work gets done (a counter of finished
closures), polled every ``poll_interval`` seconds.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Any, Callable, TextIO

from kubeps.runtime.checks import Seconds, check, check_callable

__all__ = ["Watchdog", "format_all_stacks"]


def format_all_stacks() -> str:
    """The current stack of every thread of this process, as text."""
    names = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        thread = names.get(ident)
        label = f"{thread.name} (daemon)" if thread is not None and thread.daemon else (
            thread.name if thread is not None else "unknown thread")
        out.append(f"--- thread {label} id={ident} ---\n")
        out.append("".join(traceback.format_stack(frame)))
    return "".join(out)


class Watchdog:
    """Dump all thread stacks when nothing finished for ``timeout`` seconds; re-arms after each dump."""

    def __init__(self, timeout: float = 300.0, *, progress: Callable[[], Any] | None = None,
                 on_triggered: Callable[[str], None] | None = None, output: TextIO | None = None,
                 poll_interval: float | None = None):
        self.timeout = check("timeout", timeout, Seconds, owner="Watchdog")
        self.progress = progress if progress is None else check_callable("progress", progress, owner="Watchdog")
        self.on_triggered = on_triggered
        self.output = output
        self.poll_interval = poll_interval if poll_interval is not None else min(1.0, self.timeout / 4)
        self.triggered = 0
        self._last = time.monotonic()
        self._seen: Any = progress() if progress is not None else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def notify(self) -> None:
        """Record progress (a closure finished)."""
        self._last = time.monotonic()

    @property
    def running(self) -> bool:
        """Whether :meth:`start` started it (and :meth:`stop` has not stopped it yet)."""
        return self._thread is not None

    def start(self) -> "Watchdog":
        if self._thread is None:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="kubeps-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            if self.progress is not None:
                try:
                    now = self.progress()
                except Exception:  # noqa: BLE001 - a diagnosis aid must not die of its probe
                    now = self._seen
                if now != self._seen:
                    self._seen = now
                    self.notify()
            idle = time.monotonic() - self._last
            if idle >= self.timeout:
                self._dump(idle)
                self._last = time.monotonic()  # re-arm: the next dump after another full timeout

    def _dump(self, idle: float) -> None:
        self.triggered += 1
        text = (f"kubeps watchdog: no closure finished for {idle:.0f} s (timeout {self.timeout:g} s); "
                f"stacks of all threads follow\n{format_all_stacks()}")
        stream = self.output if self.output is not None else sys.stderr
        try:
            stream.write(text)
            stream.flush()
        except Exception:  # noqa: BLE001 - stderr closed
            pass
        if self.on_triggered is not None:
            self.on_triggered(text)
