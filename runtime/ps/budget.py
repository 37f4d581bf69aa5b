"""``AnswerBudget``: how many bytes of answers one client may have a parameter server build at once.

A read's answer can be far bigger than its request (a few KB of row ids name hundreds of MB of rows), so the
per-call bound (``KUBEPS_MAX_ANSWER_BYTES``) alone lets a client with several concurrent calls multiply it. The
server opens a :class:`Ledger` per call for the call's client (its job identity, :mod:`kubeps.runtime.server`)
and makes it current while the method runs (:meth:`AnswerBudget.charging`); the state's checks
(:meth:`~kubeps.runtime.ps.state.ParameterServerState.check_reads`, the table lookups, an export) charge what the
answer will hold to it before the answer is built, and the server releases it once the answer was handed to gRPC.
A charge that would take the client past ``max_bytes`` is refused (``LimitExceededError``: ``RESOURCE_EXHAUSTED``,
reason ``limit``; nothing of the call has changed anything yet) unless the client has nothing else charged: one call alone may build
up to the per-call bound. Outside a server call (a state used in-process) nothing is charged.

Pure bookkeeping: a lock, a dict and a context variable; no I/O.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any, Iterator

from kubeps.runtime.contract import MAX_CLIENT_ANSWER_BYTES_ENV
from kubeps.runtime.errors import LimitExceededError

__all__ = ["AnswerBudget", "Ledger"]

_CURRENT: contextvars.ContextVar["Ledger | None"] = contextvars.ContextVar("kubeps_answer_ledger", default=None)


class Ledger:
    """What one call charged to its client's budget; :meth:`release` gives it back (once)."""

    def __init__(self, budget: "AnswerBudget", client: str):
        self.budget, self.client, self.nbytes = budget, client, 0

    def release(self) -> None:
        self.budget._give_back(self.client, self.nbytes)
        self.nbytes = 0


class AnswerBudget:
    """The bytes of answers in flight per client, at most ``max_bytes`` each (see the module docstring)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def ledger(self, client: str) -> Ledger:
        return Ledger(self, client)

    @contextlib.contextmanager
    def charging(self, ledger: Ledger) -> Iterator[None]:
        """Make ``ledger`` the one :meth:`charge` charges while the block runs (in this thread)."""
        token = _CURRENT.set(ledger)
        try:
            yield
        finally:
            _CURRENT.reset(token)

    def charge(self, nbytes: int, field: str, value: Any) -> None:
        """Charge ``nbytes`` of answer to the current call's client, or refuse naming ``field`` and ``value``."""
        ledger = _CURRENT.get()
        if ledger is None or ledger.budget is not self or nbytes <= 0:
            return
        with self._lock:
            held = self._held.get(ledger.client, 0)
            if held and held + nbytes > self.max_bytes:
                raise LimitExceededError(field, value, f"the answer would hold {nbytes} bytes while this client's "
                                         f"other calls hold {held}; a client may have at most {self.max_bytes} "
                                         f"bytes of answers built at once ({MAX_CLIENT_ANSWER_BYTES_ENV}): retry later")
            self._held[ledger.client] = held + nbytes
        ledger.nbytes += nbytes

    def held(self, client: str) -> int:
        with self._lock:
            return self._held.get(client, 0)

    def _give_back(self, client: str, nbytes: int) -> None:
        if not nbytes:
            return
        with self._lock:
            left = self._held.get(client, 0) - nbytes
            if left > 0:
                self._held[client] = left
            else:
                self._held.pop(client, None)
