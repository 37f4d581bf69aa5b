"""The chief's membership watcher: it reads the membership document (:class:`~kubeps.runtime.cluster.Membership`)
every ``interval`` seconds and hands a new one to the chief's
:class:`~kubeps.runtime.coordinator.membership_controller.MembershipController` (what
:meth:`ClusterCoordinator.apply_membership <kubeps.runtime.ClusterCoordinator.apply_membership>` calls too).

The document is a file (``KUBEPS_MEMBERSHIP_FILE``): the operator mounts the job's membership ConfigMap there
(kubelet swaps the mounted files atomically when the ConfigMap changes), ``kubeps local`` writes it with an atomic
rename. No pod needs credentials for the Kubernetes API. The watcher looks at the file's ``stat`` each time and
parses it only when that changed; a document it cannot parse is logged once and skipped (the previous one stays
in force). With an ack file (``KUBEPS_MEMBERSHIP_ACK_FILE``) it writes a
:class:`~kubeps.runtime.cluster.MembershipAck` there whenever the coordinator's membership state changed (a
generation applied, a leaving worker drained), by atomic rename: ``kubeps local`` stops a drained worker on it.

I/O stays here; what a change does to the dispatch threads and the closure queue is the controller's.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Protocol

from kubeps.runtime.cluster import Membership, MembershipAck, TFConfigError
from kubeps.runtime.util.files import write_atomically

__all__ = ["DEFAULT_INTERVAL_S", "MembershipTarget", "MembershipWatcher", "read_membership"]

log = logging.getLogger("kubeps.runtime.coordinator.membership")

#: seconds between two looks at the membership file (a stat; the file is parsed only when it changed)
DEFAULT_INTERVAL_S = 0.25


class MembershipTarget(Protocol):
    """What the watcher needs of the membership controller."""

    def apply_membership(self, membership: Membership) -> MembershipAck: ...

    def membership_status(self) -> MembershipAck: ...


def read_membership(path: str) -> Membership:
    """The membership document at ``path``; raises ``OSError`` or :class:`~kubeps.runtime.cluster.TFConfigError`."""
    with open(path, "rb") as fh:
        return Membership.parse(fh.read())


class MembershipWatcher:
    """Polls ``path`` in a daemon thread and applies every new generation to ``target``; :meth:`stop` ends it."""

    def __init__(self, target: MembershipTarget, path: str, *, ack_path: str | None = None,
                 interval: float = DEFAULT_INTERVAL_S):
        self.target = target
        self.path = path
        self.ack_path = ack_path
        self.interval = interval
        self._signature: Any = None
        self._applied: int | None = None
        self._acked: MembershipAck | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kubeps-membership")

    def start(self) -> "MembershipWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - logged; the watcher goes on
                log.exception("membership watcher: polling %s failed", self.path)
            self._stopping.wait(self.interval)

    def poll(self) -> MembershipAck | None:
        """One look: apply the document if it is new, write the ack if the state changed; returns the state
        written (None when nothing was)."""
        try:
            st = os.stat(self.path)
            signature: Any = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            signature = None
        if signature is not None and signature != self._signature:
            self._signature = signature
            try:
                membership = read_membership(self.path)
            except (OSError, TFConfigError) as err:
                log.error("membership document %s skipped (the workers stay as they are): %s", self.path, err)
                membership = None
            if membership is not None and membership.generation != self._applied:
                self._applied = membership.generation
                self.target.apply_membership(membership)
        status = self.target.membership_status()
        if self.ack_path is None or status == self._acked:
            return None
        write_atomically(self.ack_path, status.to_json())
        self._acked = status
        return status
