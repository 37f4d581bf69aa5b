"""The reconcile planner: ``plan(observed) -> Plan(actions, status)``, the state machine of a job's lifecycle.

Pure: no I/O, no clock, no randomness. Everything it decides follows from the one :class:`~.state.Observed` value
it is given, so an operator restarted at any moment recomputes the same plan from what it observes, and a repeated
action is a no-op (children have deterministic names; deletes carry the pod's UID as a precondition).

One reconcile, in order (docs/operator.md documents the rules for users):

1. The lost-node rules (:mod:`.nodes`): pods on lost nodes are shown to the rules as deleted, and force-deleted.
2. A job being deleted is left to the garbage collector; a spec that does not parse, or a template that cannot be
   made into a pod (:mod:`.scale`), fails the job.
3. The security objects (:mod:`.security`): the token Secret, its certificate, the NetworkPolicy.
4. Suspension and Kueue's admission (:mod:`.timeline`): a held job's pods and Services are deleted.
5. Success, then the deadline (:mod:`.restarts`, :mod:`.timeline`), then a lost token Secret (:mod:`.security`).
6. The replicas (:mod:`.scale` deletes what is beyond the spec and keeps the membership ConfigMap the chief
   watches on the spec's Workers; :mod:`.restarts` creates, restarts and fails the
   PS, the chief, the workers and the evaluator), their Services, the Running condition, pods that cannot start.
7. Once Succeeded or Failed, conditions are frozen; only Kueue's Finished, cleanup, counts and TTL go on
   (:mod:`.timeline`). The gang's PodGroup follows the job (:mod:`.timeline`), and the status is summed up
   (:mod:`.scale`).

The working state the steps share is a :class:`~.draft.Draft`; each step is a function of its concern's module.
"""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any, Mapping

from kubeps.operator.api import models
from kubeps.operator.api.models import ReplicaType, SpecError

from . import nodes, restarts, scale, security, timeline
from .actions import CreatePod, Plan
from .draft import Draft
from .flow import On, State
from .state import Observed


def plan(observed: Observed) -> Plan:
    """Decide what to do for one job from what is observed; see the module docstring for the steps."""
    seen = observed.nodes
    loss = nodes.replace_lost_pods(observed.pods, seen.states, observed.now, seen.lost_after, seen.leases_until)
    made = _run(Draft(observed, loss.pods))
    if made.of(CreatePod):
        # New pods stay off lost nodes: the scheduler takes one for Ready until the node controller marks it.
        lost = nodes.lost_nodes(seen.states, observed.now, seen.lost_after, seen.leases_until)
        made.actions = nodes.keep_off(made.actions, lost)
    made.actions.extend(e for uid, e in loss.events.items() if uid not in seen.force_deleted)
    made.force_deletes = loss.deletes
    return made


def fail_status(job: Mapping[str, Any], reason: str, message: str, now: datetime) -> dict[str, Any]:
    """The job's status once failed for a reason found while applying a plan (e.g. the API server refused a pod
    built from the template)."""
    d = Draft(Observed(job, now))
    if not d.book.terminal:
        d.fail(reason, message)
    d.status.state = d.book.state()
    return d.book.to_json()


def _run(d: Draft) -> Plan:
    if d.meta.get("deletionTimestamp"):
        # Being deleted (foreground cascade, or a finalizer of someone else's): the garbage collector removes
        # the children; recreating them would fight it. Nothing to do, nothing to write.
        d.plan.status = copy.deepcopy(dict(d.job.get("status") or {}))
        return d.plan
    if not d.book.terminal:
        try:
            models.check_name(d.name)
            d.spec = models.parse_spec(d.job.get("spec"))
        except SpecError as err:
            d.move(On.INVALID_SPEC, str(err))
    else:
        try:
            d.spec = models.parse_spec(d.job.get("spec"))
        except SpecError:
            d.spec = None
    if not d.book.terminal:
        scale.check_templates(d)
    if not d.book.terminal:
        _reconcile(d)
        timeline.report_pods_ready(d)
    if d.book.terminal:
        timeline.finish_workload(d)
        timeline.cleanup(d)
        timeline.ttl(d)
        d.plan.terminal = True
    timeline.plan_pod_group(d)
    scale.summarise(d)
    return d.plan


def _reconcile(d: Draft) -> None:
    """A job that runs (or is to): steps 3 to 6 of the module docstring."""
    spec = d.valid_spec
    run_policy = spec.runPolicy
    d.status.observedGeneration = d.meta.get("generation")
    if d.phase is State.NEW:
        d.move(On.CREATE, f"PSTrainingJob {d.meta.get('namespace')}/{d.name} is created.",
               event_message=f"PSTrainingJob {d.name} is created")
    desired = d.desired_counts()
    security.plan_objects(d, spec)
    if timeline.hold(d, spec):
        return
    timeline.start(d)
    due = timeline.deadline(d, run_policy)
    if restarts.succeeded(d, spec, due):
        return
    if timeline.past_deadline(d, run_policy, due):
        return
    if security.restart_for_lost_secret(d):
        return
    scale.plan_membership(d, spec, desired[ReplicaType.PS])
    scale.delete_beyond_spec(d, desired)
    scale.restart_for_ps_count(d, desired[ReplicaType.PS])
    if restarts.reconcile_ps(d, desired[ReplicaType.PS], spec):
        return
    if restarts.reconcile_chief(d, spec):
        return
    if restarts.reconcile_replicas(d, ReplicaType.WORKER, desired[ReplicaType.WORKER], spec):
        return
    restarts.reconcile_replicas(d, ReplicaType.EVALUATOR, desired[ReplicaType.EVALUATOR], spec)
    scale.reconcile_services(d, desired)
    restarts.update_running(d, desired)
    scale.report_stuck_pods(d)
