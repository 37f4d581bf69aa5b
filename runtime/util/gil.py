"""The interpreter's GIL switch interval, raised while a chief's dispatch threads run.

CPython makes the thread that holds the GIL give it up once another has waited ``sys.getswitchinterval()`` seconds
for it (5 ms by default), and the thread that gave it up then waits until another has taken it. A chief has one
dispatch thread per worker; each holds the GIL briefly between blocking gRPC calls, which release it. With hundreds
of them some thread has always waited 5 ms, so the GIL changes hands by force again and again, each time with
context switches on both sides. ``bench/dispatch.py`` at 256 workers (2-core machine): 25-28 switches and 570-700 us
of the chief's CPU per function at 5 ms, 3.7-4.3 switches and 157-169 us at 50 ms, with 3x the functions per second.
Threads still hand the GIL on whenever they block, which is what dispatch threads mostly do; the longer interval only
spares the forced hand-offs (a thread running Python for longer than the interval without blocking keeps the others
waiting up to that long).

:func:`hold_switch_interval` raises the interval (never lowers it) until the last holder lets go, then puts back the
interpreter's own, unless someone changed it meanwhile.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Callable

from kubeps.runtime.checks import Seconds, check

__all__ = ["hold_switch_interval"]

_lock = threading.Lock()
_holders = 0
#: the interval before the first holder raised it, and the one set (None: not raised)
_saved = 0.0
_set: float | None = None


def hold_switch_interval(seconds: float) -> Callable[[], None]:
    """Make the GIL switch interval at least ``seconds`` (> 0) until the returned function is called (once is
    enough; calling it again does nothing). With several holders the longest asked for holds; the interpreter's
    interval comes back when the last is released, if it is still the one set here."""
    global _holders, _saved, _set
    seconds = check("seconds", seconds, Seconds, owner="hold_switch_interval")
    with _lock:
        if _holders == 0:
            _saved, _set = sys.getswitchinterval(), None
        _holders += 1
        if sys.getswitchinterval() < seconds:
            sys.setswitchinterval(seconds)
            _set = sys.getswitchinterval()
    released = False

    def release() -> None:
        global _holders, _set
        nonlocal released
        with _lock:
            if released:
                return
            released = True
            _holders -= 1
            if _holders == 0 and _set is not None:
                if math.isclose(sys.getswitchinterval(), _set):
                    sys.setswitchinterval(_saved)
                _set = None

    return release
