"""What the planner reads of an observed pod (:class:`ObservedPod`), and the helpers it reads objects with.

The pods arrive as the API server (or the shell's slim copies of them) gives them: nested dicts in which any field
may be missing. :func:`observe_pod` projects one into the few facts the state machine decides from (its replica,
phase, exit code, restarts, epoch, why it cannot start); the planner reads nothing else of a pod. Pure: no I/O, no
clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping

from kubeps.operator.api import models
from kubeps.operator.api.models import ReplicaType

from .children import ANNOTATION_EPOCH, ANNOTATION_MEMBERSHIP, LABEL_INDEX, LABEL_TYPE, MAIN_CONTAINER_NAMES

#: Container waiting reasons that no wait fixes (a missing or unpullable image, a bad container config): they are
#: named in the Running condition and a Warning Event. Plain ContainerCreating and PodInitializing are not.
STUCK_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
                           "CreateContainerConfigError", "CreateContainerError"})


def fmt_time(moment: datetime) -> str:
    """A time as Kubernetes writes it (RFC 3339, UTC, whole seconds)."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    """A Kubernetes time (``2025-01-01T12:00:00Z``), or None for none."""
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class ObservedPod:
    """One pod of the job, as the planner reads it."""

    name: str
    uid: str | None
    replica_type: ReplicaType | None
    index: int | None
    phase: str
    terminating: bool
    ready: bool
    exit_code: int | None
    restart_count: int
    epoch: int
    reason: str | None
    #: The membership generation the chief pod was last told of (its annotation), None if never.
    membership: int | None = None
    #: When the main container (else the last container) terminated, if the kubelet said.
    finished_at: datetime | None = None
    #: Why a container of the pod cannot start ("container c: ErrImagePull: ..."), for STUCK_REASONS only.
    waiting: str | None = None

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def live(self) -> bool:
        return not self.terminating and not self.finished


def observe_pod(pod: Mapping[str, Any]) -> ObservedPod:
    """The facts the planner decides from, read from a pod (any field may be missing)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    rt = models.BY_TASK_TYPE.get(labels.get(LABEL_TYPE, ""))
    try:
        index = int(labels.get(LABEL_INDEX, ""))
    except ValueError:
        index = None
    statuses = list(status.get("containerStatuses") or [])
    restart_count = sum(int(s.get("restartCount") or 0) for s in statuses)
    restart_count += sum(int(s.get("restartCount") or 0) for s in status.get("initContainerStatuses") or [])
    exit_code = None
    finished_at = None
    ordered = sorted(statuses, key=lambda s: s.get("name") not in MAIN_CONTAINER_NAMES)
    for s in ordered:  # the main container's code first, else the first non-zero one, else any
        term = (s.get("state") or {}).get("terminated")
        if term is not None and (exit_code is None or (exit_code == 0 and term.get("exitCode"))):
            exit_code = int(term.get("exitCode", 0))
            try:
                finished_at = parse_time(term.get("finishedAt"))
            except (TypeError, ValueError):
                finished_at = None
            if s.get("name") in MAIN_CONTAINER_NAMES and exit_code:
                break
    waiting = None
    for s in [*(status.get("initContainerStatuses") or []), *statuses]:
        w = (s.get("state") or {}).get("waiting") or {}
        if w.get("reason") in STUCK_REASONS:
            detail = str(w.get("message") or "")[:200]
            waiting = f"container {s.get('name')}: {w['reason']}" + (f": {detail}" if detail else "")
            break
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    annotations = meta.get("annotations") or {}
    try:
        epoch = int(annotations.get(ANNOTATION_EPOCH, "0"))
    except ValueError:
        epoch = 0
    try:
        membership = int(annotations[ANNOTATION_MEMBERSHIP]) if ANNOTATION_MEMBERSHIP in annotations else None
    except ValueError:
        membership = None
    return ObservedPod(
        name=meta.get("name", ""),
        uid=meta.get("uid"),
        replica_type=rt,
        index=index,
        phase=status.get("phase") or "Pending",
        terminating=bool(meta.get("deletionTimestamp")),
        ready=ready and status.get("phase") == "Running",
        exit_code=exit_code,
        restart_count=restart_count,
        epoch=epoch,
        reason=status.get("reason"),
        membership=membership,
        finished_at=finished_at,
        waiting=waiting,
    )


#: what :func:`owned` and :func:`observe_pods` read from each version of a child, by the version's key: a version's
#: content never changes, so a job's reconciles read it once, not once each (at 1,000 workers, reading every pod again
#: took a quarter of the operator's CPU in a burst of creates). Objects not from the API server (no uid or
#: resourceVersion) are read every time.
_CONTROLLERS: dict[tuple[Any, ...], tuple[Any, ...]] = {}  #: (uid, resourceVersion) -> the uids of its controllers
#: (uid, resourceVersion, deletionTimestamp) -> what observe_pod made of it (the lost-node rules mark a copy of a pod
#: deleted: the deletion time is part of the key)
_OBSERVED: dict[tuple[Any, ...], ObservedPod] = {}
_KEPT_MAX = 50_000  # versions kept per cache; past it, it starts again empty


def _kept(cache: dict[tuple[Any, ...], Any], key: tuple[Any, ...], read: Callable[[], Any]) -> Any:
    if not key[0] or not key[1]:
        return read()
    value = cache.get(key)
    if value is None:
        if len(cache) >= _KEPT_MAX:
            cache.clear()
        value = cache[key] = read()
    return value


def _controllers(meta: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(ref.get("uid") for ref in meta.get("ownerReferences") or [] if ref.get("controller"))


def owned(objs: Iterable[Mapping[str, Any]], controller: str | None) -> list[Mapping[str, Any]]:
    """The objects of ``objs`` that ``controller`` controls (as :func:`controlled_by`), each version's owner
    references read once."""
    out = []
    for obj in objs:
        meta = obj.get("metadata") or {}
        if controller in _kept(_CONTROLLERS, (meta.get("uid"), meta.get("resourceVersion")),
                               lambda: _controllers(meta)):
            out.append(obj)
    return out


def observe_pods(pods: Iterable[Mapping[str, Any]], controller: str | None) -> list[ObservedPod]:
    """:func:`observe_pod` of each of ``pods`` that ``controller`` (a job's uid) controls, in their order, each
    version read once."""
    out = []
    for pod in owned(pods, controller):
        meta = pod.get("metadata") or {}
        key = (meta.get("uid"), meta.get("resourceVersion"), meta.get("deletionTimestamp"))
        out.append(_kept(_OBSERVED, key, lambda: observe_pod(pod)))
    return out


def controlled_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    """Whether ``obj`` names the job with ``uid`` as its controller (an owner reference with controller true)."""
    return uid in _controllers(obj.get("metadata") or {})
