"""Watchdog: dumps every thread's stack when no progress happens within the timeout, never otherwise."""

from __future__ import annotations

import io
import threading
import time

import pytest

from kubeps.runtime.coordinator.watchdog import Watchdog


def _stuck_here(event: threading.Event) -> None:
    event.wait(10)


def test_dumps_stacks_of_all_threads_when_idle():
    release = threading.Event()
    t = threading.Thread(target=_stuck_here, args=(release,), name="stuck-worker")
    t.start()
    out = io.StringIO()
    dumps: list[str] = []
    try:
        with Watchdog(0.3, output=out, on_triggered=dumps.append, poll_interval=0.05):
            deadline = time.monotonic() + 5
            while not dumps and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        release.set()
        t.join()
    assert dumps, "the watchdog did not fire"
    text = out.getvalue()
    assert "no closure finished for" in text
    assert "stuck-worker" in text and "_stuck_here" in text


def test_progress_keeps_it_quiet():
    counter = [0]
    out = io.StringIO()
    wd = Watchdog(1.0, progress=lambda: counter[0], output=out, poll_interval=0.05).start()
    try:
        for _ in range(60):  # 3 s of steady progress, three timeouts' worth (a stall under 0.9 s is tolerated)
            counter[0] += 1
            time.sleep(0.05)
        assert wd.triggered == 0 and out.getvalue() == ""
        for _ in range(30):
            wd.notify()
            time.sleep(0.05)
        assert wd.triggered == 0
    finally:
        wd.stop()


def test_bad_timeout():
    with pytest.raises(ValueError, match=r"'Watchdog.timeout' has invalid value 0: a number of seconds > 0"):
        Watchdog(0)
