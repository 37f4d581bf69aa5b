"""The Kueue rules of the pure planner (:mod:`kubeps.operator.core.kueue`): a queued job's Workload, admission,
PodsReady, eviction and Finished, with a Workload kept in memory the way Kueue and the API server would."""

from __future__ import annotations

import copy
import dataclasses
from datetime import timedelta

import pytest

from kubeps.operator.core import actions as A, kueue
from kubeps.operator.core import planner as P

from .test_planner import CONFIG, World, make_job, observe

KUEUE = dataclasses.replace(CONFIG, kueue=True)
FLAVOR = {"nodeLabels": {"pool": "spot"}, "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}


class QueueWorld(World):
    """A World whose job waits in LocalQueue ``team``; the Workload lives here and Kueue is played by the test."""

    def __init__(self, job: dict, queue: str = "team"):
        job["metadata"].setdefault("labels", {})[kueue.LABEL_QUEUE] = queue
        super().__init__(job)
        self.workload: dict | None = None
        self.applied: list[dict] = []

    def plan(self) -> A.Plan:
        view = kueue.QueueView(workload=copy.deepcopy(self.workload), flavors={"spot": FLAVOR})
        return P.plan(observe(self.job, self.pods.values(), self.services.values(), self.secret, self.now, KUEUE, queue=view,
                              membership=self.membership))

    def apply(self, plan: A.Plan, limit: int | None = None) -> None:
        super().apply(plan, limit)
        for action in plan.actions:
            if isinstance(action, A.CreateWorkload):
                if self.workload is None:
                    self.workload = {**copy.deepcopy(action.body), "status": {}}
                    self.workload["metadata"].update(uid="wl-uid", generation=1)
            elif isinstance(action, A.PatchWorkload):
                self.workload["spec"].update(copy.deepcopy(action.patch["spec"]))
            elif isinstance(action, A.ApplyWorkloadStatus):
                self.applied.append(action.status)
                self.workload["status"] = copy.deepcopy(action.status)
            elif isinstance(action, A.DeleteWorkload):
                self.workload = None

    def admitted_and_running(self) -> None:
        """Queued, admitted by Kueue, every pod running."""
        self.converge()
        self.admit()
        self.converge()
        self.run_all()
        self.converge()

    # -- Kueue's side ----------------------------------------------------------------------------------------
    def admit(self, checks: list | None = None) -> None:
        sets = self.workload["spec"]["podSets"]
        self.workload["status"] = {
            "admission": {"clusterQueue": "cq", "podSetAssignments": [
                {"name": s["name"], "flavors": {"cpu": "spot"}, "count": s["count"]} for s in sets]},
            "conditions": [_cond("QuotaReserved", True, "QuotaReserved"), _cond("Admitted", True, "Admitted")],
        }
        if checks:
            self.workload["status"]["admissionChecks"] = checks

    def evict(self, reason: str = "Preempted") -> None:
        conds = [c for c in self.workload["status"]["conditions"] if c["type"] not in ("Evicted", "Admitted")]
        conds += [_cond("Evicted", True, reason, "Preempted to accommodate a workload (UID: x)"),
                  _cond("Admitted", False, "NoReservation")]
        self.workload["status"]["conditions"] = conds

    def wl_cond(self, ctype: str) -> dict | None:
        for c in self.workload["status"].get("conditions", []):
            if c["type"] == ctype:
                return c
        return None


def _cond(ctype: str, status: bool, reason: str, message: str = "") -> dict:
    return {"type": ctype, "status": "True" if status else "False", "reason": reason, "message": message,
            "lastTransitionTime": "2025-01-01T11:00:00Z"}


def test_a_queued_job_makes_one_owned_workload_with_a_pod_set_per_role_and_no_pod():
    world = QueueWorld(make_job(ps=2, workers=3, evaluator=1))
    plan = world.step()
    assert not plan.of(A.CreatePod) and not plan.of(A.CreateService)
    [create] = plan.of(A.CreateWorkload)
    body = create.body
    assert body["apiVersion"] == "kueue.x-k8s.io/v1beta2" and body["kind"] == "Workload"
    assert create.name == kueue.workload_name(world.job) and create.name.startswith("pstrainingjob-ctr-")
    owner = body["metadata"]["ownerReferences"][0]
    assert owner["controller"] is True and owner["uid"] == "job-uid" and owner["kind"] == "PSTrainingJob"
    assert body["metadata"]["labels"][kueue.LABEL_JOB_UID] == "job-uid"
    assert body["spec"]["queueName"] == "team" and body["spec"]["active"] is True
    assert [(s["name"], s["count"]) for s in body["spec"]["podSets"]] == [
        ("chief", 1), ("ps", 2), ("worker", 3), ("evaluator", 1)]
    container = body["spec"]["podSets"][0]["template"]["spec"]["containers"][0]
    assert container["image"] == "img:1"
    assert world.is_true("Suspended") and world.cond("Suspended")["reason"] == "Queued"
    assert world.job["status"]["state"] == "Suspended" and "startTime" not in world.job["status"]
    # Nothing more happens until Kueue admits it.
    assert [a for a in world.step().actions if not isinstance(a, A.Event)] == []
    assert not world.pods


def test_admission_starts_the_pods_with_flavor_and_admission_check_updates():
    world = QueueWorld(make_job(ps=1, workers=2))
    world.converge()
    world.admit(checks=[{"name": "prov", "state": "Ready", "podSetUpdates": [
        {"name": "worker", "labels": {"extra": "yes"}, "annotations": {"a": "b"}, "nodeSelector": {"zone": "z1"},
         "tolerations": [{"key": "gpu", "operator": "Exists"}]}]}])
    plan = world.step()
    pods = {a.name: a.body for a in plan.of(A.CreatePod)}
    assert sorted(pods) == ["ctr-chief-0", "ctr-ps-0", "ctr-worker-0", "ctr-worker-1"]
    chief = pods["ctr-chief-0"]
    assert chief["spec"]["nodeSelector"] == {"pool": "spot"}
    assert chief["spec"]["tolerations"] == FLAVOR["tolerations"]
    assert chief["metadata"]["labels"][kueue.LABEL_PODSET] == "chief"
    worker = pods["ctr-worker-1"]
    assert worker["spec"]["nodeSelector"] == {"pool": "spot", "zone": "z1"}
    assert worker["metadata"]["labels"]["extra"] == "yes" and worker["metadata"]["annotations"]["a"] == "b"
    assert {"key": "gpu", "operator": "Exists"} in worker["spec"]["tolerations"]
    assert world.cond("Suspended")["status"] == "False" and world.job["status"].get("startTime")


def test_pods_ready_is_reported_started_then_recovery():
    world = QueueWorld(make_job(ps=1, workers=1))
    world.converge()
    world.admit()
    world.converge()
    assert world.wl_cond("PodsReady")["reason"] == "WaitForStart"
    world.run_all()
    world.converge()
    ready = world.wl_cond("PodsReady")
    assert ready["status"] == "True" and ready["reason"] == "Started"
    # What Kueue owns of the status is carried over unchanged in the apply.
    assert world.applied[-1]["admission"]["clusterQueue"] == "cq"
    assert world.wl_cond("Admitted")["status"] == "True"
    world.exit("ctr-worker-0", 1)
    world.converge()
    assert world.wl_cond("PodsReady")["reason"] in ("WaitForRecovery", "Recovered")


def test_eviction_stops_the_pods_then_clears_the_admission_and_requeues():
    world = QueueWorld(make_job(ps=1, workers=1))
    world.admitted_and_running()
    world.evict("Preempted")
    plan = world.step()
    assert len(plan.of(A.DeletePod)) == 3 and not plan.of(A.ApplyWorkloadStatus)  # pods first
    assert world.cond("Suspended")["reason"] == "Evicted" and "Preempted" in world.cond("Suspended")["message"]
    world.step()  # no pod left: the admission is given back
    status = world.workload["status"]
    assert "admission" not in status
    assert world.wl_cond("QuotaReserved")["status"] == "False"
    assert world.wl_cond("QuotaReserved")["reason"] == "PendingEvaluation"
    assert world.wl_cond("Requeued")["status"] == "True" and world.wl_cond("Requeued")["reason"] == "Preempted"
    assert not world.pods
    # Kueue admits it again: the pods come back, the chief of a new pod resumes from its checkpoint.
    world.workload["status"]["conditions"] = [c for c in status["conditions"] if c["type"] != "Evicted"]
    world.admit()
    plan = world.step()
    assert sorted(a.name for a in plan.of(A.CreatePod)) == ["ctr-chief-0", "ctr-ps-0", "ctr-worker-0"]
    assert not world.is_true("Failed") and world.job["status"]["backoffCount"] == 0


@pytest.mark.parametrize("reason, requeued", [("PodsReadyTimeout", False), ("ClusterQueueStopped", False),
                                              ("NodeFailures", True)])
def test_requeued_is_true_only_after_preemption_or_node_failures(reason, requeued):
    world = QueueWorld(make_job(ps=1, workers=1))
    world.converge()
    world.admit()
    world.converge()
    world.evict(reason)
    world.converge()
    assert world.wl_cond("Requeued")["status"] == ("True" if requeued else "False")


def test_finished_is_written_once_when_the_chief_succeeds():
    world = QueueWorld(make_job(ps=1, workers=1))
    world.admitted_and_running()
    world.exit("ctr-chief-0", 0)
    plan = world.step()
    [apply] = plan.of(A.ApplyWorkloadStatus)
    assert world.is_true("Succeeded")
    finished = world.wl_cond("Finished")
    assert finished["status"] == "True" and finished["reason"] == "Succeeded"
    assert not world.step().of(A.ApplyWorkloadStatus)


def test_failed_job_finishes_its_workload_failed():
    world = QueueWorld(make_job(ps=1, workers=1, policies={"Chief": "Never"}))
    world.converge()
    world.admit()
    world.converge()
    world.exit("ctr-chief-0", 3)
    world.converge()
    assert world.is_true("Failed") and world.wl_cond("Finished")["reason"] == "Failed"


def test_suspend_deactivates_the_workload_and_resume_activates_it():
    world = QueueWorld(make_job(ps=1, workers=1))
    world.converge()
    world.job["spec"]["runPolicy"]["suspend"] = True
    world.step()
    assert world.workload["spec"]["active"] is False and world.cond("Suspended")["reason"] == "Suspended"
    world.job["spec"]["runPolicy"]["suspend"] = False
    world.step()
    assert world.workload["spec"]["active"] is True and world.cond("Suspended")["reason"] == "Queued"


def test_queue_change_before_admission_moves_the_workload_and_not_after():
    world = QueueWorld(make_job(ps=1, workers=1))
    world.converge()
    world.job["metadata"]["labels"][kueue.LABEL_QUEUE] = "other"
    world.step()
    assert world.workload["spec"]["queueName"] == "other"
    world.admit()
    world.job["metadata"]["labels"][kueue.LABEL_QUEUE] = "third"
    plan = world.step()
    assert not plan.of(A.PatchWorkload) and world.workload["spec"]["queueName"] == "other"


def test_worker_scale_while_admitted_replaces_the_workload():
    world = QueueWorld(make_job(ps=1, workers=1))
    world.converge()
    world.admit()
    world.converge()
    world.job["spec"]["replicaSpecs"]["Worker"]["replicas"] = 3
    plan = world.step()
    assert plan.of(A.DeleteWorkload) and not plan.of(A.CreatePod)
    assert world.is_true("Suspended") and world.pods == {}
    plan = world.step()
    [create] = plan.of(A.CreateWorkload)
    assert [s["count"] for s in create.body["spec"]["podSets"] if s["name"] == "worker"] == [3]


def test_without_the_label_or_with_kueue_off_the_job_runs_as_today():
    plain = World(make_job(ps=1, workers=1))
    plan = P.plan(observe(plain.job, [], [], None, plain.now, KUEUE, queue=kueue.QueueView()))
    assert plan.of(A.CreatePod) and not plan.of(A.CreateWorkload)
    labelled = make_job(ps=1, workers=1)
    labelled["metadata"]["labels"] = {kueue.LABEL_QUEUE: "team"}
    plan = P.plan(observe(labelled, [], [], None, plain.now, CONFIG))
    assert plan.of(A.CreatePod) and not plan.of(A.CreateWorkload)


def test_priority_goes_into_the_workload():
    job = make_job(ps=1, workers=1)
    job["metadata"]["labels"] = {kueue.LABEL_QUEUE: "team"}
    view = kueue.QueueView(priority=kueue.Priority("kueue.x-k8s.io", "WorkloadPriorityClass", "high", 1000))
    [create] = P.plan(observe(job, [], [], None, World(job).now, KUEUE, queue=view)).of(A.CreateWorkload)
    assert create.body["spec"]["priority"] == 1000
    assert create.body["spec"]["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                                       "name": "high"}


def test_deadline_counts_from_admission_not_from_queueing():
    world = QueueWorld(make_job(ps=1, workers=1, run_policy={"activeDeadlineSeconds": 60}))
    world.converge()
    world.now += timedelta(minutes=30)
    world.admit()
    world.converge()
    assert not world.is_true("Failed") and world.pods


def test_workload_name_depends_on_the_job_uid():
    a = make_job()
    b = make_job()
    b["metadata"]["uid"] = "other-uid"
    assert kueue.workload_name(a) != kueue.workload_name(b)
    assert len(kueue.workload_name(make_job(name="x" * 253))) <= 253


def test_gang_after_admission_no_pod_group_while_queued_or_evicted():
    """Kueue and a gang backend together: the PodGroup is made with the pods once Kueue admits the job, and
    deleted when Kueue evicts it (no gang holds nodes for a job that waits in a queue)."""
    from kubeps.operator.api.models import GangScheduler

    config = dataclasses.replace(KUEUE, gang_scheduler=GangScheduler.NATIVE)
    world = QueueWorld(make_job(ps=1, workers=1))
    group: dict = {}

    def plan() -> A.Plan:
        view = kueue.QueueView(workload=copy.deepcopy(world.workload), flavors={"spot": FLAVOR})
        made = P.plan(observe(world.job, world.pods.values(), world.services.values(), world.secret, world.now, config,
                      pod_group=group.get("body"), queue=view, membership=world.membership))
        for action in made.actions:
            if isinstance(action, A.CreatePodGroup):
                group["body"] = action.body
            elif isinstance(action, A.DeletePodGroup):
                group.pop("body", None)
        return made

    world.plan = plan  # type: ignore[method-assign]
    world.converge()
    assert "body" not in group and not world.pods
    world.admit()
    created = world.step()
    assert created.of(A.CreatePodGroup) and created.of(A.CreatePod)
    world.run_all()
    world.converge()
    world.evict("Preempted")
    evicted = world.step()
    assert evicted.of(A.DeletePodGroup) and evicted.of(A.DeletePod)
    assert "body" not in group
