"""Table tests of gang scheduling (kubeps.operator.core.gang) and successPolicy in the pure planner, without an API
server: which PodGroup each backend gets, how pods join it, and when it is made and removed."""

from __future__ import annotations

import copy
from dataclasses import replace
from fractions import Fraction

import pytest

from kubeps.operator.api import models
from kubeps.operator.api.models import GangScheduler
from kubeps.operator.core import actions as A, gang
from kubeps.operator.core import planner as P

from .test_planner import CONFIG, World, make_job, observe

GANG_ROLES = ("chief", "ps", "worker")


class GangWorld(World):
    """The planner's in-memory cluster, with the operator's gang backend and the job's PodGroup."""

    def __init__(self, job: dict, backend: GangScheduler = GangScheduler.NATIVE, **config):
        super().__init__(job)
        self.config = replace(CONFIG, gang_scheduler=backend, **config)
        self.pod_group: dict | None = None
        self.pod_group_log: list[str] = []

    def plan(self) -> A.Plan:
        return P.plan(observe(self.job, self.pods.values(), self.services.values(), self.secret, self.now, self.config,
                      pod_group=self.pod_group, membership=self.membership))

    def apply(self, plan: A.Plan, limit: int | None = None) -> None:
        for action in plan.actions[:limit]:
            if isinstance(action, A.CreatePodGroup):
                self.pod_group = self.pod_group or copy.deepcopy(action.body)
                self.pod_group_log.append("create")
            elif isinstance(action, A.DeletePodGroup):
                self.pod_group = None
                self.pod_group_log.append(f"delete ({action.reason})")
        super().apply(plan, limit)


def with_resources(job: dict, role: str, requests: dict | None = None, limits: dict | None = None) -> dict:
    container = job["spec"]["replicaSpecs"][role]["template"]["spec"]["containers"][0]
    container["resources"] = {k: v for k, v in (("requests", requests), ("limits", limits)) if v}
    return job


def pod_bodies(plan: A.Plan) -> dict[str, dict]:
    return {a.name: a.body for a in plan.of(A.CreatePod)}


# ----------------------------------------------------------------------------------------------- the PodGroup
def test_native_pod_group_is_made_with_the_pods_and_counts_chief_ps_and_workers_not_the_evaluator():
    world = GangWorld(make_job(ps=2, workers=3, evaluator=1))
    plan = world.plan()
    [create] = plan.of(A.CreatePodGroup)
    body = create.body
    assert create.name == "ctr"
    assert (body["apiVersion"], body["kind"]) == ("scheduling.k8s.io/v1alpha2", "PodGroup")
    assert body["metadata"]["name"] == "ctr" and body["metadata"]["namespace"] == "ns"
    owner = body["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("PSTrainingJob", "job-uid", True)
    assert body["spec"] == {"schedulingPolicy": {"gang": {"minCount": 6}}}
    pods = pod_bodies(plan)
    for name, pod in pods.items():
        if name == "ctr-evaluator-0":
            assert "schedulingGroup" not in pod["spec"]
        else:
            assert pod["spec"]["schedulingGroup"] == {"podGroupName": "ctr"}
            assert "schedulerName" not in pod["spec"]  # the default scheduler's own GangScheduling plugin
    world.apply(plan)
    assert world.plan().of(A.CreatePodGroup) == []  # seen: not asked again


def test_min_available_sets_the_gang_count():
    world = GangWorld(make_job(ps=2, workers=3, run_policy={"schedulingPolicy": {"minAvailable": 4}}))
    [create] = world.plan().of(A.CreatePodGroup)
    assert create.body["spec"]["schedulingPolicy"]["gang"]["minCount"] == 4


def test_no_backend_no_pod_group_and_pods_as_before():
    job = make_job(run_policy={"schedulingPolicy": {"minAvailable": 2, "queue": "q", "priorityClass": "high"}})
    plan = GangWorld(job, GangScheduler.NONE).plan()
    assert plan.of(A.CreatePodGroup) == [] and plan.of(A.DeletePodGroup) == []
    plain = P.plan(observe(make_job(), [], [], None, GangWorld(job).now, CONFIG))
    assert {a.name: a.body for a in plain.of(A.CreatePod)} == pod_bodies(plan)


def test_volcano_pod_group_queue_priority_min_resources_and_pod_annotations():
    job = make_job(ps=2, workers=3, evaluator=1,
                   run_policy={"schedulingPolicy": {"queue": "research", "priorityClass": "high", "minAvailable": 4}})
    with_resources(job, "Chief", {"cpu": "1", "memory": "1Gi"})
    with_resources(job, "PS", {"cpu": "500m"}, {"memory": "512Mi"})
    with_resources(job, "Worker", None, {"cpu": "2", "nvidia.com/gpu": 1})
    job["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["schedulerName"] = "volcano-gpu"
    plan = GangWorld(job, GangScheduler.VOLCANO).plan()
    [create] = plan.of(A.CreatePodGroup)
    assert create.body["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    # the first 4 pods of the gang: the chief, both PS and one worker
    assert create.body["spec"] == {
        "minMember": 4, "queue": "research", "priorityClassName": "high",
        "minResources": {"cpu": "4", "memory": str(2**30 + 2 * 512 * 2**20), "nvidia.com/gpu": "1"},
    }
    pods = pod_bodies(plan)
    for role in GANG_ROLES:
        pod = pods[f"ctr-{role}-0"]
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "ctr"
        assert pod["metadata"]["annotations"]["volcano.sh/task-spec"] == role
        assert "priorityClassName" not in pod["spec"]  # Volcano reads it from the PodGroup
    assert pods["ctr-chief-0"]["spec"]["schedulerName"] == "volcano"
    assert pods["ctr-worker-0"]["spec"]["schedulerName"] == "volcano-gpu"  # the template's own is kept
    evaluator = pods["ctr-evaluator-0"]
    assert "schedulerName" not in evaluator["spec"]
    assert "scheduling.k8s.io/group-name" not in (evaluator["metadata"].get("annotations") or {})


def test_scheduler_plugins_pod_group_label_scheduler_name_timeout_and_given_min_resources():
    job = make_job(ps=1, workers=2, run_policy={"schedulingPolicy": {
        "scheduleTimeoutSeconds": 120, "minResources": {"cpu": "10", "memory": "8Gi"}, "priorityClass": "high",
        "queue": "ignored"}})
    plan = GangWorld(job, GangScheduler.SCHEDULER_PLUGINS).plan()
    [create] = plan.of(A.CreatePodGroup)
    assert create.body["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert create.body["spec"] == {"minMember": 4, "minResources": {"cpu": "10", "memory": "8Gi"},
                                   "scheduleTimeoutSeconds": 120}
    for name, pod in pod_bodies(plan).items():
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "ctr", name
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
        assert pod["spec"]["priorityClassName"] == "high"
    renamed = GangWorld(job, GangScheduler.SCHEDULER_PLUGINS, gang_scheduler_name="coscheduler").plan()
    assert {p["spec"]["schedulerName"] for p in pod_bodies(renamed).values()} == {"coscheduler"}


def test_pods_that_ask_for_nothing_give_no_min_resources():
    plan = GangWorld(make_job(), GangScheduler.SCHEDULER_PLUGINS).plan()
    assert "minResources" not in plan.of(A.CreatePodGroup)[0].body["spec"]


@pytest.mark.parametrize("text, value", [
    ("2", Fraction(2)), ("500m", Fraction(1, 2)), ("1.5Gi", Fraction(3 * 2**29)), ("1e3", Fraction(1000)),
    ("2k", Fraction(2000)), (3, Fraction(3)), ("100n", Fraction(1, 10**7)),
])
def test_quantities_are_read_exactly(text, value):
    assert gang.parse_quantity(text) == value


@pytest.mark.parametrize("value, text", [(Fraction(3), "3"), (Fraction(3, 2), "1500m"), (Fraction(1, 3), "333333334n")])
def test_quantities_are_written_as_the_api_server_reads_them(value, text):
    assert gang.format_quantity(value) == text


# ----------------------------------------------------------------------------------------------- when
def test_suspended_job_gets_no_pod_group_until_resumed_and_loses_it_when_suspended():
    job = make_job(run_policy={"suspend": True})
    world = GangWorld(job)
    world.converge()
    assert world.pod_group is None and world.pods == {}  # admission first (e.g. Kueue), gang after
    job["spec"]["runPolicy"]["suspend"] = False
    plan = world.step()
    assert plan.of(A.CreatePodGroup) and plan.of(A.CreatePod)
    assert world.pod_group is not None
    job["spec"]["runPolicy"]["suspend"] = True
    world.converge()
    assert world.pod_group is None and world.pods == {}
    assert world.pod_group_log == ["create", "delete (suspended)"]


def test_pod_group_is_deleted_when_the_job_finishes_whatever_the_clean_pod_policy():
    world = GangWorld(make_job(ps=1, workers=1, run_policy={"cleanPodPolicy": "None"})).running_job()
    assert world.pod_group is not None
    world.exit("ctr-chief-0", 0)
    world.converge()
    assert world.is_true("Succeeded") and world.pod_group is None
    assert world.pod_group_log == ["create", "delete (job finished)"]
    assert len(world.pods) == 3  # cleanPodPolicy None keeps the pods


def test_restarted_pods_do_not_ask_for_the_pod_group_again():
    world = GangWorld(make_job(ps=1, workers=2)).running_job()
    world.exit("ctr-worker-1", 1)
    plans = [world.step() for _ in range(3)]
    assert any(p.of(A.CreatePod) for p in plans)
    assert not any(p.of(A.CreatePodGroup) for p in plans)


def test_invalid_spec_fails_and_removes_a_pod_group_it_had():
    world = GangWorld(make_job()).running_job()
    world.job["spec"]["replicaSpecs"]["PS"]["replicas"] = 0
    world.converge()
    assert world.is_true("Failed") and world.pod_group is None


# ----------------------------------------------------------------------------------------------- validation
def test_min_available_beyond_the_gang_is_refused_with_the_counts():
    job = make_job(ps=1, workers=2, evaluator=1, run_policy={"schedulingPolicy": {"minAvailable": 5}})
    with pytest.raises(models.SpecError) as err:
        models.parse_spec(job["spec"])
    assert err.value.field == "runPolicy.schedulingPolicy.minAvailable"
    assert "5 is more than the gang's 4 pods (Chief 1 + PS 1 + Worker 2" in str(err.value)
    assert "allowed 1..4" in str(err.value)


def test_all_workers_with_worker_restart_policy_always_is_refused():
    job = make_job(policies={"Worker": "Always"})
    job["spec"]["successPolicy"] = "AllWorkers"
    with pytest.raises(models.SpecError) as err:
        models.parse_spec(job["spec"])
    assert err.value.field == "successPolicy" and "restartPolicy is Always" in str(err.value)


@pytest.mark.parametrize("bad, field", [
    ({"minResources": {"cpu": "two"}}, "runPolicy.schedulingPolicy.minResources.cpu"),
    ({"minAvailable": 0}, "runPolicy.schedulingPolicy.minAvailable"),
    ({"scheduleTimeoutSeconds": 0}, "runPolicy.schedulingPolicy.scheduleTimeoutSeconds"),
])
def test_bad_scheduling_policy_fields_are_named(bad, field):
    with pytest.raises(models.SpecError) as err:
        models.parse_spec(make_job(run_policy={"schedulingPolicy": bad})["spec"])
    assert err.value.field.startswith(field), err.value


# ----------------------------------------------------------------------------------------------- successPolicy
def all_workers_job(workers: int = 2, **kw) -> dict:
    job = make_job(ps=1, workers=workers, **kw)
    job["spec"]["successPolicy"] = "AllWorkers"
    return job


def test_chief_only_is_the_default():
    assert models.parse_spec(make_job()["spec"]).successPolicy is models.SuccessPolicy.CHIEF_ONLY


def test_all_workers_waits_for_every_worker_after_the_chief():
    world = World(all_workers_job()).running_job()
    world.exit("ctr-chief-0", 0)
    world.converge()
    assert not world.is_true("Succeeded") and world.is_true("Running")
    assert world.pods["ctr-chief-0"]["status"]["phase"] == "Succeeded"  # kept, not recreated
    world.exit("ctr-worker-0", 0)
    world.converge()
    assert not world.is_true("Succeeded")
    world.exit("ctr-worker-1", 0)
    world.converge()
    cond = world.cond("Succeeded")
    assert cond["status"] == "True" and cond["reason"] == "AllWorkersSucceeded"
    assert "all 2 worker(s)" in cond["message"]
    assert "ctr-ps-0" not in world.pods  # cleanPodPolicy Running: the PS went


def test_all_workers_needs_the_chief_too():
    world = World(all_workers_job()).running_job()
    for name in ("ctr-worker-0", "ctr-worker-1"):
        world.exit(name, 0)
    world.converge()
    assert not world.is_true("Succeeded") and world.pods["ctr-worker-0"]["status"]["phase"] == "Succeeded"
    world.exit("ctr-chief-0", 0)
    world.converge()
    assert world.is_true("Succeeded")


def test_all_workers_fails_when_a_worker_fails_for_good():
    world = World(all_workers_job(policies={"Worker": "Never"})).running_job()
    world.exit("ctr-worker-1", 3)
    world.converge()
    cond = world.cond("Failed")
    assert cond["status"] == "True" and cond["reason"] == "WorkerFailed"


def test_all_workers_retries_a_worker_its_policy_retries():
    world = World(all_workers_job()).running_job()
    world.exit("ctr-worker-1", 1)  # OnFailure: replaced
    world.converge()
    assert not world.is_true("Failed")
    assert world.pods["ctr-worker-1"]["status"]["phase"] == "Pending"
