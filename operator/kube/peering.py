"""Whether this operator replica may act in a scope, read from kopf's peering object.

kopf pauses its own watches (the jobs) while a live peer has a higher priority; the pods and Services are watched
by :mod:`kubeps.operator.kube.watch`, outside kopf, so their events would still reach a paused replica. A :class:`Gate`
reads the same peering object (``KopfPeering`` NAME in a namespace, ``ClusterKopfPeering`` NAME cluster-wide) by
the same rule, and the reconciler plans nothing in the scope while it is closed:

* open when no live peer has a higher priority and at most one live peer (this replica) has its priority; kopf
  pauses every replica that shares a priority, and so does this;
* closed while the peering object is missing (the operator runs with ``mandatory`` peering: a missing object
  pauses it rather than letting it act alone);
* a peer is live until ``lastseen + lifetime``; the gate looks again when the first blocking peer expires, which
  is how a SIGKILLed leader is taken over.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Callable

from .client import KubeClient
from .watch import Timeouts, Watcher

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

log = logging.getLogger("kubeps.operator.kube.peering")
GROUP_VERSION = "/apis/kopf.dev/v1"


def is_open(body: dict | None, priority: int, now: datetime) -> tuple[bool, float | None]:
    """Whether a replica of ``priority`` may act, and the seconds after which this may change by time alone."""
    if body is None:
        return False, None
    blocking: list[datetime] = []
    same = 0
    for record in (body.get("status") or {}).values():
        if not isinstance(record, dict):
            continue
        try:
            deadline = (datetime.fromisoformat(str(record.get("lastseen")))
                        + timedelta(seconds=int(record.get("lifetime", 60))))
            peer_priority = int(record.get("priority", 0))
        except (TypeError, ValueError):
            continue
        if deadline.tzinfo is None:
            deadline = deadline.replace(tzinfo=timezone.utc)
        if deadline <= now:
            continue  # dead: kopf cleans it up
        if peer_priority > priority:
            blocking.append(deadline)
        elif peer_priority == priority:
            same += 1
            if same > 1:
                blocking.append(deadline)
    if not blocking:
        return True, None
    return False, max(0.0, (min(blocking) - now).total_seconds())


class Gate:
    """The peering object of one scope, watched; :attr:`open` is set while this replica may act there."""

    def __init__(self, kube: KubeClient, namespace: str | None, name: str, priority: int,
                 on_change: Callable[[bool], None], **timeouts: Unpack[Timeouts]):
        self.name, self.priority, self.on_change = name, priority, on_change
        self.open = asyncio.Event()
        self.body: dict | None = None
        self._timer: asyncio.TimerHandle | None = None
        path = (f"{GROUP_VERSION}/clusterkopfpeerings" if namespace is None
                else f"{GROUP_VERSION}/namespaces/{namespace}/kopfpeerings")
        self.watcher = Watcher(kube, path, field_selector=f"metadata.name={name}", on_list=self._listed,
                               on_event=self._changed, **timeouts)

    def start(self) -> "Gate":
        self.watcher.start()
        return self

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        await self.watcher.stop()

    def _listed(self, items: list[dict]) -> None:
        self.body = items[0] if items else None
        self.evaluate()

    def _changed(self, kind: str, obj: dict) -> None:
        self.body = None if kind == "DELETED" else obj
        self.evaluate()

    def evaluate(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now_open, recheck = is_open(self.body, self.priority, datetime.now(timezone.utc))
        if recheck is not None:
            self._timer = asyncio.get_running_loop().call_later(recheck + 0.1, self.evaluate)
        if now_open != self.open.is_set():
            log.info("peering %s: %s", self.watcher.path,
                     "acting" if now_open else "paused" + (" (no peering object)" if self.body is None else ""))
            (self.open.set if now_open else self.open.clear)()
            self.on_change(now_open)
