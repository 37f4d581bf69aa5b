"""The job's children as the spec sizes them: templates that can be made into pods, pods and Services beyond the
spec's replicas, a Service per replica, pods that cannot start, and the counts the status shows.

Rules (documented for users in docs/operator.md):

* Per replica one pod and one headless Service named ``<job>-<type>-<index>``. Every pod is created with
  ``restartPolicy: Never``: the operator itself recreates pods to implement the replica's restart policy
  (:mod:`.restarts`), so it sees every failure.
* A template that cannot be made into a pod fails the job (InvalidPodTemplate), once, instead of raising at every
  reconcile.
* Pods and Services beyond the spec's replicas (Worker scale-down) or of no known replica are deleted; a worker's
  pod once the chief acknowledges (its membership ack, read into ``status.membershipAck``) that it applied the
  new membership and drained that worker, or after the Draining wait's deadline (:data:`.flow.WAITS`).
* The job's membership ConfigMap names the Workers of the spec (index order), and its generation grows at each
  change: the chief watches the document and dispatches to exactly those, without a restart (docs/elastic.md).
  Once written, the running chief pod is annotated with the generation, so that the kubelet refreshes the mounted
  file at once.
* PS replicas changed on a running job: first the chief is asked for a checkpoint (the membership document's
  ``checkpoint`` request, an Event CheckpointRequested); once its ack says it served the request, or after the
  Checkpointing wait's deadline (:data:`.flow.WAITS`; shorter for a chief that acknowledges no membership: a
  TensorFlow program), the chief restarts into the new count and restores its latest checkpoint (Restarting, reason
  PSReplicasChanged; not counted against backoffLimit). The ps beyond the new count stay until then: they hold the
  variables being saved.
* Pods whose containers cannot start (:data:`~.observed.STUCK_REASONS`) are named in a ``Running: False``
  condition (reason PodsCannotStart) while the job has not run yet.

Functions of a :class:`~.draft.Draft`; pure: no I/O.
"""

from __future__ import annotations

from kubeps.runtime.cluster import Membership

from kubeps.operator.api import models
from kubeps.operator.api.models import ConditionType, PSTrainingJobSpec, ReplicaStatus, ReplicaType

from .actions import AnnotatePod, ApplyMembership, CreateService, DeletePod, DeleteService
from .children import (ANNOTATION_MEMBERSHIP, child_name, cluster_addresses, membership_body, membership_name,
                       pod_body, service_body, worker_selector)
from .draft import Draft
from .flow import WAITS, On, State
from .observed import fmt_time, parse_time
from .status import R_PODS_WAITING


def check_templates(d: Draft) -> None:
    """Fail the job when a template cannot be made into a pod (the CRD preserves unknown fields, so e.g.
    ``metadata.labels: "a=b"`` or ``env: "X=1"`` reach the planner) instead of raising on every reconcile."""
    spec = d.valid_spec
    for rt in models.REPLICA_TYPES:
        if spec.replicaSpecs.get(rt) is None:
            continue
        try:
            pod_body(d.job, spec, rt, 0, d.status.chiefEpoch, d.config)
            service_body(d.job, rt, 0)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as err:
            d.move(On.INVALID_TEMPLATE, f"spec.replicaSpecs.{rt.value}.template cannot be made into a pod: "
                                        f"{type(err).__name__}: {err}")
            return


def delete_beyond_spec(d: Draft, desired: dict[ReplicaType, int]) -> None:
    """Pods that should not exist: replica types or indices beyond the spec (Worker scale-down). A scaled-away
    worker is Draining (:mod:`.flow`) while the chief drains it (:func:`draining`)."""
    hold = draining(d)
    # while the chief saves the checkpoint asked for before a ps count change, every ps of its count holds shards
    ps_held = (d.status.psReplicas or 0) if d.status.checkpointRequest is not None else 0
    for pod in sorted(d.pods, key=lambda p: (p.replica_type is None, str(p.replica_type), -(p.index or 0))):
        if pod.terminating:
            continue
        if pod.replica_type is ReplicaType.PS and pod.index is not None and pod.index < ps_held:
            continue
        if pod.replica_type is None or pod.index is None or pod.index >= desired[pod.replica_type]:
            if pod.replica_type is ReplicaType.WORKER and not pod.finished:
                if hold is not None and pod.index in hold:
                    continue  # Draining
                d.move(On.WORKER_DRAINED if hold is not None else On.DRAIN_GIVEN_UP, "", current=State.DRAINING)
            d.delete_pod(pod, "scaled down")
            d.event("Normal", "ScaledDown", f"Deleting pod {pod.name}: beyond the spec's replicas")


def draining(d: Draft) -> frozenset[int] | None:
    """The indexes of the workers the chief may still be draining: its ack (``status.membershipAck``) is of an
    older generation than the latest (every worker it knew may still run a function), or names them ``draining``.
    None once the Draining wait is over (its deadline, :data:`.flow.WAITS`, from ``status.membershipTime``; at once
    for a chief that acknowledges no membership, a TensorFlow program, or one that is gone). Asks for a reconcile
    at the deadline."""
    seen, ack = d.observed.membership, d.status.membershipAck
    chief = d.by_key.get((ReplicaType.CHIEF, 0))
    changed = parse_time(d.status.membershipTime)
    if seen is None or chief is None or chief.terminating or chief.finished or changed is None:
        return None
    left = WAITS[State.DRAINING].left((d.observed.now - changed).total_seconds(), acked=ack is not None)
    if ack is None or left <= 0:
        return None
    planned = [a.generation for a in d.plan.of(ApplyMembership)]  # written by this plan: not seen by the chief yet
    if ack.generation >= max([seen.generation, *planned]):
        held = frozenset(ack.draining)
    else:
        held = frozenset(p.index for p in d.pods if p.replica_type is ReplicaType.WORKER and p.index is not None)
    if held:
        d.requeue(left)
    return held


def plan_membership(d: Draft, spec: PSTrainingJobSpec, ps_count: int) -> None:
    """Keep the membership ConfigMap's workers those of the spec: written when missing or different, with the
    next generation (an Event says what changed once it existed). A ps count change of a running kubeps chief adds
    a checkpoint request (:func:`restart_for_ps_count` waits for it)."""
    workers = cluster_addresses(d.job, spec, d.config).get(ReplicaType.WORKER.task_type, [])
    seen = d.observed.membership
    if not workers:
        return
    generation = seen.generation + 1 if seen is not None else 1
    checkpoint = seen.checkpoint if seen is not None else 0
    if _ask_for_checkpoint(d, ps_count):
        checkpoint = generation
        d.move(On.PS_COUNT_CHANGED, f"PS replicas {d.status.psReplicas} -> {ps_count}: the chief is asked for a "
                                    f"checkpoint (request {generation}) before it restarts into the new count",
               current=_checkpoint_state(d))
        d.status.checkpointRequest, d.status.checkpointRequestTime = generation, fmt_time(d.observed.now)
    if seen is not None and seen.workers == workers and seen.checkpoint == checkpoint:
        _tell_chief(d, seen.generation)
        return
    membership = Membership(generation=generation, workers=workers, checkpoint=checkpoint)
    d.plan.actions.append(ApplyMembership(membership_name(d.name), membership_body(d.job, membership), generation,
                                          len(workers)))
    d.status.membershipTime = fmt_time(d.observed.now)
    _tell_chief(d, generation)
    if seen is not None and seen.workers != workers:
        d.event("Normal", "WorkersChanged", f"Workers {len(seen.workers)} -> {len(workers)}: membership generation "
                                            f"{generation} for the chief, which applies it without a restart")


def _ask_for_checkpoint(d: Draft, ps_count: int) -> bool:
    """Whether to ask the chief for a checkpoint now: the ps count changed, nothing was asked for it yet, and the
    chief runs (whether it serves requests, a kubeps chief, shows in its membership ack:
    :func:`_waiting_for_checkpoint`)."""
    chief = d.by_key.get((ReplicaType.CHIEF, 0))
    return (d.status.psReplicas is not None and d.status.psReplicas != ps_count and d.status.checkpointRequest is None
            and chief is not None and chief.phase == "Running" and not chief.terminating)


def _checkpoint_state(d: Draft) -> State:
    """Checkpointing while a checkpoint request is outstanding (``status.checkpointRequest``), else Settled."""
    return State.CHECKPOINTING if d.status.checkpointRequest is not None else State.SETTLED


def _waiting_for_checkpoint(d: Draft) -> bool:
    """Whether the restart for a ps count change still waits for the chief's checkpoint: asked for, not reported
    served, the chief still there, and the Checkpointing wait's deadline (:data:`.flow.WAITS`, shorter for a chief
    that has acknowledged no membership: not read yet, or a TensorFlow program; the progress reader reads an asked
    chief every second) not passed since the request. Asks for a reconcile at the deadline."""
    request = d.status.checkpointRequest
    chief = d.by_key.get((ReplicaType.CHIEF, 0))
    if request is None or _served(d) or chief is None or chief.terminating or chief.finished:
        return False
    asked = parse_time(d.status.checkpointRequestTime)
    if asked is None:
        return False
    left = WAITS[State.CHECKPOINTING].left((d.observed.now - asked).total_seconds(),
                                           acked=d.status.membershipAck is not None)
    if left <= 0:
        return False
    d.requeue(left)
    return True


def _served(d: Draft) -> bool:
    """Whether the chief's membership ack says it served the checkpoint request the job waits for."""
    request, ack = d.status.checkpointRequest, d.status.membershipAck
    return request is not None and ack is not None and ack.checkpoint >= request


def restart_for_ps_count(d: Draft, count: int) -> None:
    """PS replicas changed on a running job: the chief restarts into the new count (a new epoch: its TF_CONFIG names
    the new ps, and it restores its latest checkpoint, which re-partitions the variables into any number of ps);
    Restarting with reason PSReplicasChanged and an Event say so. Not a failure: nothing counts against
    backoffLimit. The ps that stay keep running; those beyond the spec are deleted; the workers are made again,
    their TF_CONFIG naming the new ps."""
    before = d.status.psReplicas
    chief = d.by_key.get((ReplicaType.CHIEF, 0))
    if before is not None and before != count and chief is not None and _waiting_for_checkpoint(d):
        return
    request, served = d.status.checkpointRequest, _served(d)
    if request is not None:  # the Checkpointing wait ends
        d.move(On.CHECKPOINT_SERVED if served else On.CHECKPOINT_GIVEN_UP, "", current=State.CHECKPOINTING)
    d.status.psReplicas = count
    if before is None or before == count or chief is None:
        return
    if request is None:
        saved = "its latest checkpoint"
    elif served:
        saved = f"the checkpoint it saved at the request ({request})"
    else:
        saved = f"its latest checkpoint (it did not report checkpoint request {request} served)"
    d.status.chiefEpoch += 1  # the chief of an older epoch is restarted (restarts.reconcile_chief)
    d.move(On.PS_SCALED, f"PS replicas {before} -> {count}: the chief and the workers restart with the new "
                         f"parameter servers; the chief restores {saved} into them")
    # a worker's TF_CONFIG names the ps it reads and pushes to: the running ones would not know the new ps (nor
    # miss the removed ones), so they are made again with the new TF_CONFIG; nothing of theirs is counted
    for pod in sorted((p for p in d.pods if p.replica_type is ReplicaType.WORKER and not p.terminating),
                      key=lambda p: p.name):
        d.book.mark_handled(pod)
        d.delete_pod(pod, f"PS replicas {before} -> {count}")


def _tell_chief(d: Draft, generation: int) -> None:
    """Annotate the running chief pod with the membership generation it should see, once per generation: the
    kubelet syncs a pod whose object changed, and refreshes its ConfigMap volumes then (seconds), instead of at its
    periodic sync (``syncFrequency``, a minute by default, plus its cache's TTL)."""
    chief = d.by_key.get((ReplicaType.CHIEF, 0))
    if chief is None or chief.terminating or chief.finished or chief.membership == generation or generation <= 1:
        return  # generation 1 is in the ConfigMap before the chief starts: nothing to refresh
    d.plan.actions.append(AnnotatePod(chief.name, chief.uid, {ANNOTATION_MEMBERSHIP: str(generation)}))


def reconcile_services(d: Draft, desired: dict[ReplicaType, int]) -> None:
    """One headless Service per replica; those beyond the spec deleted."""
    wanted: dict[str, tuple[ReplicaType, int]] = {}
    for rt in models.REPLICA_TYPES:
        for index in range(desired[rt]):
            wanted[child_name(d.name, rt, index)] = (rt, index)
    for svc_name, (rt, index) in wanted.items():
        if svc_name not in d.services:
            d.plan.actions.append(CreateService(svc_name, service_body(d.job, rt, index)))
    for svc_name in sorted(d.services, reverse=True):
        if svc_name not in wanted and not (d.services[svc_name].get("metadata") or {}).get("deletionTimestamp"):
            d.plan.actions.append(DeleteService(svc_name, "scaled down"))


def report_stuck_pods(d: Draft) -> None:
    """Pods whose containers cannot start (STUCK_REASONS) are named in a ``Running: False`` condition, with a
    Warning Event when that begins: a TFJob in the same state just stays Created. Only while the job has not run
    yet (or this condition is the one that says why); it goes away when the pods start."""
    cond = d.book.condition(ConditionType.RUNNING)
    if cond is not None and cond.reason != R_PODS_WAITING:
        return  # running, or not running for a reason of its own (restarting, suspended)
    stuck = sorted((p for p in d.pods if p.live and p.waiting), key=lambda p: p.name)
    if not stuck:
        if cond is not None:
            d.status.conditions.remove(cond)
        return
    message = f"{len(stuck)} pod(s) cannot start; {stuck[0].name}: {stuck[0].waiting}"
    if cond is None:
        d.status.conditions.append(models.Condition(
            type=ConditionType.RUNNING, status="False", reason=R_PODS_WAITING, message=message,
            lastTransitionTime=d.book.now_text, lastUpdateTime=d.book.now_text))
        d.event("Warning", R_PODS_WAITING, message)
    elif cond.message != message:
        cond.message, cond.lastUpdateTime = message, d.book.now_text


def summarise(d: Draft) -> None:
    """The status's counts and columns (active, ready, succeeded per type; chief, ps, workers, restarts, state),
    the handled pods still observed, and whether every child is there; the plan's status is written from it."""
    desired = d.desired_counts()
    live_pods = [p for p in d.pods if not p.terminating]
    deleted = {a.name for a in d.plan.actions if isinstance(a, DeletePod)}
    for rt in models.REPLICA_TYPES:
        mine = [p for p in live_pods if p.replica_type is rt and p.name not in deleted]
        if not mine and desired[rt] == 0 and rt.value not in d.status.replicaStatuses:
            continue
        rs = d.book.replica_status(rt)
        rs.active = sum(1 for p in mine if p.phase in ("Pending", "Running"))
        rs.ready = sum(1 for p in mine if p.ready)
        rs.succeeded = sum(1 for p in mine if p.phase == "Succeeded")
    chief = d.by_key.get((ReplicaType.CHIEF, 0))
    d.status.chief = chief.phase if chief is not None and chief.name not in deleted else "-"
    ps = d.status.replicaStatuses.get(ReplicaType.PS.value, ReplicaStatus())
    workers = d.status.replicaStatuses.get(ReplicaType.WORKER.value, ReplicaStatus())
    d.status.ps = f"{ps.ready}/{desired[ReplicaType.PS]}"
    d.status.workers = f"{workers.ready}/{desired[ReplicaType.WORKER]}"
    d.status.restarts = sum(rs.restarts for rs in d.status.replicaStatuses.values())
    if desired[ReplicaType.WORKER] or ReplicaType.WORKER.value in d.status.replicaStatuses:
        d.status.workerSelector = worker_selector(d.name)  # the scale subresource's labelSelectorPath
    d.status.state = d.book.state()
    d.book.forget_unobserved({p.uid for p in d.pods})
    d.plan.status = d.book.to_json()
    if not d.book.terminal and d.spec is not None and not d.spec.runPolicy.suspend:
        have_pods = all((rt, i) in d.by_key for rt in models.REPLICA_TYPES for i in range(desired[rt]))
        have_svcs = all(child_name(d.name, rt, i) in d.services for rt in models.REPLICA_TYPES for i in range(desired[rt]))
        d.plan.all_children_present = have_pods and have_svcs and d.observed.secret is not None
