"""Table tests of the pure planner: every lifecycle rule, without an API server."""

from __future__ import annotations

import copy
import itertools
import json
import random
from datetime import datetime, timedelta, timezone

import pytest

from kubeps.operator.api import models
from kubeps.operator.core import actions as A, children, observed
from kubeps.operator.core import planner as P
from kubeps.operator.core.state import Observed, SecretFacts
from kubeps.operator.core.status import HANDLED_LIMIT
from kubeps.runtime import lifecycle
from kubeps.runtime.cluster import TFConfig

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
CONFIG = children.PlanConfig(default_image="example.com/runtime:1", cluster_domain=None)


def observe(job, pods=(), services=(), secret=None, now=NOW, config=CONFIG, **seen) -> Observed:
    """What the shell hands the planner: ``secret`` is the Secret's body (or None: there is none); ``seen``: the
    other facts (network_policy, nodes, pod_group, queue)."""
    return Observed(job, now, list(pods), list(services), None if secret is None else SecretFacts.of(secret),
                    config=config, **seen)


def template(image: str | None = "img:1", port: int | None = None, name: str = "kubeps") -> dict:
    container: dict = {"name": name}
    if image:
        container["image"] = image
    if port:
        container["ports"] = [{"name": "kubeps-port", "containerPort": port}]
    return {"metadata": {"labels": {"team": "ads"}}, "spec": {"containers": [container]}}


def make_job(name="ctr", ps=2, workers=3, evaluator=0, run_policy=None, policies=None, status=None, gen=1):
    policies = policies or {}
    specs = {
        "Chief": {"replicas": 1, "restartPolicy": policies.get("Chief", "OnFailure"), "template": template()},
        "PS": {"replicas": ps, "restartPolicy": policies.get("PS", "OnFailure"), "template": template()},
        "Worker": {"replicas": workers, "restartPolicy": policies.get("Worker", "OnFailure"),
                   "template": template()},
    }
    if evaluator:
        specs["Evaluator"] = {"replicas": evaluator, "restartPolicy": policies.get("Evaluator", "OnFailure"),
                              "template": template()}
    return {
        "apiVersion": "kubeps.dev/v1alpha1",
        "kind": "PSTrainingJob",
        "metadata": {"name": name, "namespace": "ns", "uid": "job-uid", "generation": gen},
        "spec": {"replicaSpecs": specs, "runPolicy": run_policy or {}},
        "status": status or {},
    }


class World:
    """An in-memory cluster: applies plans the way the kopf shell does, pods advance when told."""

    def __init__(self, job: dict):
        self.job = job
        self.pods: dict[str, dict] = {}
        self.services: dict[str, dict] = {}
        self.secret = None
        self.membership = None  # the document of the job's membership ConfigMap
        self.now = NOW
        self.uids = itertools.count(1)
        self.created: list[str] = []
        self.deleted_job = False
        self.events: list[A.Event] = []

    def plan(self) -> A.Plan:
        return P.plan(observe(self.job, self.pods.values(), self.services.values(), self.secret, self.now, CONFIG,
                              membership=self.membership))

    def apply(self, plan: A.Plan, limit: int | None = None) -> None:
        self.job["status"] = plan.status
        for action in plan.actions[:limit]:
            if isinstance(action, A.CreatePod):
                if action.name in self.pods:
                    continue  # 409: already exists
                body = copy.deepcopy(action.body)
                body["metadata"]["uid"] = f"uid-{next(self.uids)}"
                body["status"] = {"phase": "Pending"}
                self.pods[action.name] = body
                self.created.append(action.name)
            elif isinstance(action, A.CreateService):
                self.services.setdefault(action.name, copy.deepcopy(action.body))
            elif isinstance(action, A.CreateSecret):
                self.secret = self.secret or {**action.body, "data": {"token": "c2VjcmV0"}}
            elif isinstance(action, A.ApplyMembership):
                self.membership = children.membership_of(action.body)
            elif isinstance(action, A.AnnotatePod):
                pod = self.pods.get(action.name)
                if pod is not None and pod["metadata"]["uid"] == action.uid:
                    pod["metadata"].setdefault("annotations", {}).update(action.annotations)
            elif isinstance(action, A.DeletePod):
                pod = self.pods.get(action.name)
                if pod is not None and pod["metadata"]["uid"] == action.uid:
                    del self.pods[action.name]
            elif isinstance(action, A.DeleteService):
                self.services.pop(action.name, None)
            elif isinstance(action, A.DeleteJob):
                self.deleted_job = True
            elif isinstance(action, A.Event):
                self.events.append(action)

    def step(self, times: int = 1) -> A.Plan:
        plan = None
        for _ in range(times):
            plan = self.plan()
            self.apply(plan)
        return plan

    def converge(self, limit: int = 20) -> A.Plan:
        for _ in range(limit):
            plan = self.plan()
            self.apply(plan)
            if not [a for a in plan.actions if not isinstance(a, A.Event)]:
                return plan
        raise AssertionError("did not converge")

    def run_all(self) -> None:
        for pod in self.pods.values():
            if pod["status"]["phase"] == "Pending":
                pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                                 "containerStatuses": [{"name": "kubeps", "restartCount": 0,
                                                        "state": {"running": {}}}]}

    def exit(self, name: str, code: int, reason: str | None = None) -> None:
        pod = self.pods[name]
        pod["status"] = {
            "phase": "Succeeded" if code == 0 else "Failed",
            "containerStatuses": [{"name": "kubeps", "restartCount": 0,
                                   "state": {"terminated": {"exitCode": code}}}],
        }
        if reason:
            pod["status"]["reason"] = reason

    def cond(self, ctype: str) -> dict | None:
        for c in self.job["status"].get("conditions", []):
            if c["type"] == ctype:
                return c
        return None

    def is_true(self, ctype: str) -> bool:
        c = self.cond(ctype)
        return bool(c and c["status"] == "True")

    def running_job(self) -> "World":
        self.converge()
        self.run_all()
        self.converge()
        assert self.is_true("Running"), self.job["status"]
        return self


def running(**kw) -> World:
    return World(make_job(**kw)).running_job()


# ----------------------------------------------------------------------------------------------- children
def test_first_plan_creates_secret_services_and_pods_with_deterministic_names():
    world = World(make_job(ps=2, workers=3, evaluator=1))
    plan = world.plan()
    pods = sorted(a.name for a in plan.of(A.CreatePod))
    svcs = sorted(a.name for a in plan.of(A.CreateService))
    expected = sorted(["ctr-chief-0", "ctr-ps-0", "ctr-ps-1", "ctr-worker-0", "ctr-worker-1", "ctr-worker-2",
                       "ctr-evaluator-0"])
    assert pods == expected and svcs == expected
    assert [a.name for a in plan.of(A.CreateSecret)] == ["ctr-kubeps-token"]
    assert world.job["status"] == {} and plan.status["conditions"][0]["type"] == "Created"
    assert plan.status["state"] == "Created"
    assert not plan.all_children_present
    world.apply(plan)
    assert world.plan().all_children_present


def test_pod_body_labels_owner_env_port_and_restart_policy():
    world = World(make_job(ps=2, workers=2, evaluator=1))
    bodies = {a.name: a.body for a in world.plan().of(A.CreatePod)}
    ps1 = bodies["ctr-ps-1"]
    assert ps1["metadata"]["labels"] == {"team": "ads", "kubeps.dev/job-name": "ctr", "kubeps.dev/replica-type": "ps",
                                         "kubeps.dev/replica-index": "1", "kubeps.dev/job-role": "ps"}
    assert bodies["ctr-chief-0"]["metadata"]["labels"]["kubeps.dev/job-role"] == "chief"
    ref = ps1["metadata"]["ownerReferences"][0]
    assert ref["uid"] == "job-uid" and ref["controller"] is True and ref["kind"] == "PSTrainingJob"
    assert ps1["spec"]["restartPolicy"] == "Never"
    container = ps1["spec"]["containers"][0]
    assert container["ports"] == [{"name": "kubeps-port", "containerPort": 2222, "protocol": "TCP"},
                                  {"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    env = {e["name"]: e for e in container["env"]}
    assert env["GRPC_FAIL_FAST"]["value"] == "use_caller"
    assert env["KUBEPS_METRICS_PORT"]["value"] == "9090"
    assert env["KUBEPS_JOB_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "ctr-kubeps-token", "key": "token"}
    tf = TFConfig.parse(env["TF_CONFIG"]["value"])
    assert tf.task_type == "ps" and tf.task_index == 1
    assert tf.cluster == {
        "chief": ["ctr-chief-0.ns.svc:2222"],
        "ps": ["ctr-ps-0.ns.svc:2222", "ctr-ps-1.ns.svc:2222"],
        "worker": ["ctr-worker-0.ns.svc:2222", "ctr-worker-1.ns.svc:2222"],
    }
    ev = TFConfig.parse(next(e["value"] for e in bodies["ctr-evaluator-0"]["spec"]["containers"][0]["env"]
                             if e["name"] == "TF_CONFIG"))
    assert ev.cluster == {"evaluator": ["ctr-evaluator-0.ns.svc:2222"]}


def test_a_template_port_named_metrics_is_the_metrics_port():
    job = make_job(ps=1, workers=1)
    container = job["spec"]["replicaSpecs"]["PS"]["template"]["spec"]["containers"][0]
    container["ports"] = [{"name": "metrics", "containerPort": 9400}]
    body = next(a.body for a in World(job).plan().of(A.CreatePod) if a.name == "ctr-ps-0")
    main = body["spec"]["containers"][0]
    assert [p["name"] for p in main["ports"]] == ["metrics", "kubeps-port"]
    assert {e["name"]: e.get("value") for e in main["env"]}["KUBEPS_METRICS_PORT"] == "9400"


def test_tf_config_lists_exactly_the_pods_the_planner_makes_with_replicas_left_to_their_default():
    """The children's TF_CONFIG takes each role's count from the parsed spec (its defaults), as the planner does:
    a count read from the raw manifest with a default of its own could list tasks no pod serves."""
    job = make_job(ps=2, workers=2)
    for role in ("Chief", "PS"):
        del job["spec"]["replicaSpecs"][role]["replicas"]
    made = sorted(a.name for a in World(job).plan().of(A.CreatePod))
    default = models.PSSpec.model_fields["replicas"].default
    assert made == sorted(["ctr-chief-0", *(f"ctr-ps-{i}" for i in range(default)), "ctr-worker-0", "ctr-worker-1"])
    body = next(a.body for a in World(job).plan().of(A.CreatePod) if a.name == "ctr-worker-1")
    tf = TFConfig.parse(next(e["value"] for e in body["spec"]["containers"][0]["env"] if e["name"] == "TF_CONFIG"))
    listed = sorted(f"ctr-{task_type}-{i}" for task_type, hosts in tf.cluster.items() for i in range(len(hosts)))
    assert listed == made


def test_service_body_is_headless_and_selects_exactly_its_pod():
    plan = World(make_job()).plan()
    svc = next(a.body for a in plan.of(A.CreateService) if a.name == "ctr-worker-2")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"kubeps.dev/job-name": "ctr", "kubeps.dev/replica-type": "worker",
                                       "kubeps.dev/replica-index": "2"}
    assert svc["spec"]["ports"] == [{"name": "kubeps-port", "port": 2222, "targetPort": 2222, "protocol": "TCP"}]


def test_default_image_custom_port_cluster_domain_and_user_tf_config_replaced():
    job = make_job()
    job["spec"]["replicaSpecs"]["PS"]["template"] = template(image=None, port=5000)
    worker_container = job["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    worker_container["env"] = [{"name": "TF_CONFIG", "value": "{}"}, {"name": "KEEP", "value": "1"}]
    job["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"].insert(0, {"name": "sidecar"})
    config = children.PlanConfig(default_image="reg/rt:2", cluster_domain="cluster.local")
    plan = P.plan(observe(job, [], [], None, NOW, config))
    bodies = {a.name: a.body for a in plan.of(A.CreatePod)}
    ps = bodies["ctr-ps-0"]["spec"]["containers"][0]
    assert ps["image"] == "reg/rt:2" and ps["ports"] == [
        {"name": "kubeps-port", "containerPort": 5000}, {"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    worker = bodies["ctr-worker-0"]["spec"]["containers"]
    assert worker[0]["name"] == "sidecar" and worker[0]["image"] == "reg/rt:2" and "env" not in worker[0]
    env = worker[1]["env"]
    assert [e["name"] for e in env] == ["KEEP", "TF_CONFIG", "KUBEPS_JOB_TOKEN", "GRPC_FAIL_FAST",
                                        "KUBEPS_CHECKPOINT_ROOT", "KUBEPS_TLS_CA_FILE", "KUBEPS_TLS_CERT_FILE",
                                        "KUBEPS_TLS_KEY_FILE", "KUBEPS_METRICS_PORT"]
    tf = json.loads(env[1]["value"])
    assert tf["cluster"]["ps"] == ["ctr-ps-0.ns.svc.cluster.local:5000", "ctr-ps-1.ns.svc.cluster.local:5000"]
    svc = next(a.body for a in plan.of(A.CreateService) if a.name == "ctr-ps-1")
    assert svc["spec"]["ports"][0]["port"] == 5000


def test_steady_state_plan_is_empty_and_status_stable():
    world = running()
    plan = world.plan()
    assert plan.actions == [] and plan.status == world.job["status"]
    assert plan.status["ps"] == "2/2" and plan.status["workers"] == "3/3" and plan.status["chief"] == "Running"
    assert plan.status["replicaStatuses"]["Worker"] == {"active": 3, "ready": 3, "succeeded": 0, "failed": 0,
                                                        "restarts": 0}
    assert plan.status["startTime"] == "2025-01-01T12:00:00Z" and plan.status["observedGeneration"] == 1


def test_running_needs_chief_all_ps_and_all_workers():
    world = World(make_job())
    world.converge()
    world.run_all()
    world.pods["ctr-worker-1"]["status"] = {"phase": "Pending"}
    world.converge()
    assert not world.is_true("Running") and world.job["status"]["state"] == "Created"
    world.run_all()
    world.converge()
    assert world.is_true("Running") and world.job["status"]["state"] == "Running"


def test_pods_and_services_of_other_owners_are_ignored():
    world = World(make_job())
    foreign = {"metadata": {"name": "ctr-chief-0", "uid": "x", "labels": {children.LABEL_JOB: "ctr"},
                            "ownerReferences": [{"uid": "old-job", "controller": True}]},
               "status": {"phase": "Succeeded"}}
    plan = P.plan(observe(world.job, [foreign], [], None, NOW, CONFIG))
    assert "ctr-chief-0" in [a.name for a in plan.of(A.CreatePod)]
    assert not plan.terminal


# ----------------------------------------------------------------------------------------------- success
@pytest.mark.parametrize("policy,deleted", [
    # the evaluator is left its grace (below) to evaluate the final checkpoint
    ("Running", ["ctr-ps-0", "ctr-ps-1", "ctr-worker-0", "ctr-worker-2"]),
    ("All", ["ctr-chief-0", "ctr-evaluator-0", "ctr-ps-0", "ctr-ps-1", "ctr-worker-0", "ctr-worker-1",
             "ctr-worker-2"]),
    ("None", []),
])
def test_chief_exit_0_succeeds_and_clean_pod_policy_removes(policy, deleted):
    world = running(evaluator=1, run_policy={"cleanPodPolicy": policy}, policies={"Worker": "Never"})
    world.exit("ctr-worker-1", 0)  # a finished worker is not "running"
    world.step()
    world.exit("ctr-chief-0", 0)
    plan = world.plan()
    assert plan.terminal
    assert sorted(a.name for a in plan.of(A.DeletePod)) == deleted
    assert sorted(a.name for a in plan.of(A.DeleteService)) == deleted
    world.apply(plan)
    status = world.job["status"]
    assert world.is_true("Succeeded") and status["state"] == "Succeeded"
    assert world.cond("Succeeded")["reason"] == "ChiefSucceeded"
    assert world.cond("Running")["status"] == "False"
    assert status["completionTime"] == "2025-01-01T12:00:00Z"
    assert any(e.reason == "ChiefSucceeded" for e in world.events)
    assert world.plan().actions == []


def succeeded_with_evaluator(**run_policy) -> tuple[World, A.Plan]:
    """A job whose chief exited 0 while its evaluator runs: the plan of that success."""
    world = running(evaluator=1, run_policy=run_policy)
    world.exit("ctr-chief-0", 0)
    plan = world.plan()
    world.apply(plan)
    assert world.is_true("Succeeded")
    return world, plan


def test_after_a_success_the_evaluator_is_left_to_finish_the_final_checkpoint():
    world, plan = succeeded_with_evaluator()
    assert "ctr-evaluator-0" not in [a.name for a in plan.of(A.DeletePod)]
    assert "ctr-evaluator-0" not in [a.name for a in plan.of(A.DeleteService)]
    assert {"ctr-ps-0", "ctr-worker-0"} <= {a.name for a in plan.of(A.DeletePod)}
    assert plan.requeue_after == 60
    world.now += timedelta(seconds=20)
    assert world.plan().requeue_after == 40
    # it evaluated the final checkpoint and exited: nothing left to delete, no reconcile due for it
    world.exit("ctr-evaluator-0", 0)
    plan = world.plan()
    assert plan.of(A.DeletePod) == [] and plan.requeue_after is None
    assert world.job["status"]["state"] == "Succeeded"


def test_an_evaluator_still_running_after_its_grace_is_deleted_with_the_reason():
    world, _ = succeeded_with_evaluator(evaluatorGraceSeconds=30)
    world.now += timedelta(seconds=29)
    assert world.plan().of(A.DeletePod) == []
    world.now += timedelta(seconds=1)
    plan = world.plan()
    [delete] = plan.of(A.DeletePod)
    assert delete.name == "ctr-evaluator-0"
    assert "30 s after the job succeeded" in delete.reason and "evaluatorGraceSeconds" in delete.reason
    assert [a.name for a in plan.of(A.DeleteService)] == ["ctr-evaluator-0"]


@pytest.mark.parametrize("run_policy", [{"evaluatorGraceSeconds": 0}, {"cleanPodPolicy": "All"}])
def test_no_grace_deletes_the_evaluator_with_the_rest(run_policy):
    _, plan = succeeded_with_evaluator(**run_policy)
    assert "ctr-evaluator-0" in [a.name for a in plan.of(A.DeletePod)]


def test_a_failed_job_deletes_its_evaluator_at_once():
    world = running(evaluator=1, policies={"Chief": "Never"})
    world.exit("ctr-chief-0", 3)
    plan = world.plan()
    assert plan.terminal and plan.status["state"] == "Failed"
    assert "ctr-evaluator-0" in [a.name for a in plan.of(A.DeletePod)]


def test_terminal_status_is_frozen():
    world = running()
    world.exit("ctr-chief-0", 0)
    world.converge()
    frozen = copy.deepcopy(world.job["status"]["conditions"])
    world.job["spec"]["replicaSpecs"]["Worker"]["replicas"] = 7
    world.job["spec"]["runPolicy"]["suspend"] = True
    world.now += timedelta(hours=1)
    plan = world.converge()
    assert plan.actions == [] and world.job["status"]["conditions"] == frozen
    assert not any(n.startswith("ctr-worker-5") for n in world.pods)


# ----------------------------------------------------------------------------------------------- workers
def test_worker_failure_replaces_the_pod_and_keeps_running_without_backoff():
    world = running(run_policy={"backoffLimit": 0})
    old_uid = world.pods["ctr-worker-1"]["metadata"]["uid"]
    world.exit("ctr-worker-1", 1)
    plan = world.plan()
    assert [(a.name, a.uid) for a in plan.of(A.DeletePod)] == [("ctr-worker-1", old_uid)]
    assert plan.status["replicaStatuses"]["Worker"]["restarts"] == 1
    assert plan.status["replicaStatuses"]["Worker"]["failed"] == 1
    assert plan.status["backoffCount"] == 0
    world.apply(plan)
    assert world.is_true("Running") and not world.is_true("Failed")
    plan = world.step()
    assert [a.name for a in plan.of(A.CreatePod)] == ["ctr-worker-1"]
    assert world.pods["ctr-worker-1"]["metadata"]["uid"] != old_uid
    world.run_all()
    world.converge()
    assert world.job["status"]["restarts"] == 1 and world.is_true("Running")


@pytest.mark.parametrize("policy,code,replaced", [
    ("Never", 1, False), ("Never", 137, False), ("OnFailure", 1, True), ("Always", 1, True),
    ("ExitCode", 1, False), ("ExitCode", 137, True), ("ExitCode", 143, True), ("Always", 0, True),
    ("OnFailure", 0, False),
])
def test_worker_restart_policy_table(policy, code, replaced):
    world = running(policies={"Worker": policy})
    world.exit("ctr-worker-0", code)
    plan = world.plan()
    assert bool(plan.of(A.DeletePod)) is replaced
    assert not plan.terminal


def test_all_workers_failed_for_good_fails_the_job():
    world = running(workers=2, policies={"Worker": "Never"})
    world.exit("ctr-worker-0", 2)
    world.converge()
    assert world.is_true("Running")
    world.exit("ctr-worker-1", 3)
    world.converge()
    assert world.is_true("Failed") and world.cond("Failed")["reason"] == "AllWorkersFailed"


def test_retryable_exit_codes_override_the_default():
    world = running(policies={"Worker": "ExitCode"}, run_policy={"retryableExitCodes": [3]})
    world.exit("ctr-worker-0", 3)
    world.exit("ctr-worker-1", 137)
    plan = world.plan()
    assert [a.name for a in plan.of(A.DeletePod)] == ["ctr-worker-0"]


def test_worker_scale_up_and_down_highest_index_first_and_new_tf_config():
    world = running(workers=3)
    world.job["spec"]["replicaSpecs"]["Worker"]["replicas"] = 5
    world.job["metadata"]["generation"] = 2
    plan = world.plan()
    created = {a.name: a.body for a in plan.of(A.CreatePod)}
    assert sorted(created) == ["ctr-worker-3", "ctr-worker-4"]
    env = {e["name"]: e.get("value") for e in created["ctr-worker-4"]["spec"]["containers"][0]["env"]}
    assert len(json.loads(env["TF_CONFIG"])["cluster"]["worker"]) == 5
    assert plan.status["observedGeneration"] == 2
    world.apply(plan)
    world.run_all()
    world.converge()
    world.job["spec"]["replicaSpecs"]["Worker"]["replicas"] = 2
    plan = world.plan()
    assert [a.name for a in plan.of(A.DeletePod)] == ["ctr-worker-4", "ctr-worker-3", "ctr-worker-2"]
    assert [a.name for a in plan.of(A.DeleteService)] == ["ctr-worker-4", "ctr-worker-3", "ctr-worker-2"]
    world.apply(plan)
    world.converge()
    assert sorted(n for n in world.pods if "worker" in n) == ["ctr-worker-0", "ctr-worker-1"]
    assert world.is_true("Running") and world.job["status"]["workers"] == "2/2"


# ----------------------------------------------------------------------------------------------- ps & chief
def test_ps_failure_restarts_ps_and_chief_with_restarting_condition():
    world = running(ps=2)
    chief_uid = world.pods["ctr-chief-0"]["metadata"]["uid"]
    world.exit("ctr-ps-1", 137)
    plan = world.plan()
    assert [a.name for a in plan.of(A.DeletePod)] == ["ctr-ps-1", "ctr-chief-0"]
    world.apply(plan)
    status = world.job["status"]
    assert world.is_true("Restarting") and not world.is_true("Running")
    cond = world.cond("Restarting")
    assert cond["reason"] == "PSFailed" and "ps 1 (pod ctr-ps-1) failed with exit code 137" in cond["message"]
    assert status["backoffCount"] == 1 and status["chiefEpoch"] == 1 and status["state"] == "Restarting"
    assert status["replicaStatuses"]["PS"]["restarts"] == 1 and status["replicaStatuses"]["Chief"]["restarts"] == 1
    world.converge()
    assert world.pods["ctr-chief-0"]["metadata"]["uid"] != chief_uid
    assert world.pods["ctr-chief-0"]["metadata"]["annotations"][children.ANNOTATION_EPOCH] == "1"
    world.run_all()
    world.converge()
    assert world.is_true("Running") and not world.is_true("Restarting")
    assert world.job["status"]["restarts"] == 2


def test_ps_restart_is_counted_once_even_if_the_operator_dies_before_deleting():
    world = running()
    world.exit("ctr-ps-0", 1)
    plan = world.plan()
    world.apply(plan, limit=0)  # status written, then the operator died: no delete happened
    plan = world.plan()  # a restarted operator sees the same failed pod
    assert plan.status["backoffCount"] == 1 and plan.status["chiefEpoch"] == 1
    assert [a.name for a in plan.of(A.DeletePod)] == ["ctr-ps-0", "ctr-chief-0"]
    # ... and if it died after deleting the PS but before the chief, the chief is still restarted.
    world.apply(plan, limit=1)
    plan = world.plan()
    assert [a.name for a in plan.of(A.DeletePod)] == ["ctr-chief-0"] and plan.status["backoffCount"] == 1


@pytest.mark.parametrize("policy,code,outcome", [
    ("Never", 1, "Failed"), ("Never", 137, "Failed"), ("OnFailure", 1, "Restarting"), ("Always", 2, "Restarting"),
    ("ExitCode", 1, "Failed"), ("ExitCode", 130, "Restarting"), ("ExitCode", 137, "Restarting"),
])
def test_chief_restart_policy_table(policy, code, outcome):
    world = running(policies={"Chief": policy})
    world.exit("ctr-chief-0", code)
    world.step()
    assert world.job["status"]["state"] == outcome
    reason = world.cond(outcome)["reason"]
    assert reason == "ChiefFailed"
    if outcome == "Failed":
        assert f"exit code {code}" in world.cond("Failed")["message"]
        assert policy in world.cond("Failed")["message"]


def test_ps_never_policy_fails_the_job_naming_the_ps():
    world = running(policies={"PS": "Never"})
    world.exit("ctr-ps-1", 1)
    world.step()
    assert world.is_true("Failed") and world.cond("Failed")["reason"] == "PSFailed"
    assert "ctr-ps-1" in world.cond("Failed")["message"]


def test_backoff_limit_counts_chief_and_ps_restarts():
    world = running(run_policy={"backoffLimit": 2})
    for name in ("ctr-chief-0", "ctr-ps-0"):
        world.exit(name, 1)
        world.converge()
        world.run_all()
        world.converge()
        assert world.is_true("Running")
    assert world.job["status"]["backoffCount"] == 2
    world.exit("ctr-ps-1", 1)
    world.converge()
    assert world.is_true("Failed") and world.cond("Failed")["reason"] == "BackoffLimitExceeded"
    assert "backoffLimit is 2" in world.cond("Failed")["message"]


def test_backoff_limit_zero_fails_at_first_chief_failure():
    world = running(run_policy={"backoffLimit": 0})
    world.exit("ctr-chief-0", 1)
    world.step()
    assert world.cond("Failed")["reason"] == "BackoffLimitExceeded"


def test_in_place_container_restarts_count_against_backoff():
    world = running(run_policy={"backoffLimit": 3})
    world.pods["ctr-ps-0"]["status"]["containerStatuses"][0]["restartCount"] = 2
    world.pods["ctr-chief-0"]["status"]["containerStatuses"][0]["restartCount"] = 1
    world.step()
    assert world.is_true("Running")
    world.pods["ctr-chief-0"]["status"]["containerStatuses"][0]["restartCount"] = 2
    world.step()
    assert world.is_true("Failed") and world.cond("Failed")["reason"] == "BackoffLimitExceeded"


def test_evicted_pod_without_exit_code_is_retried_by_exit_code_policy():
    world = running(policies={"Chief": "ExitCode"})
    world.pods["ctr-chief-0"]["status"] = {"phase": "Failed", "reason": "Evicted"}
    world.step()
    assert world.is_true("Restarting") and "Evicted" in world.cond("Restarting")["message"]


def test_evaluator_failure_never_touches_the_job():
    world = running(evaluator=1, policies={"Evaluator": "Never"})
    world.exit("ctr-evaluator-0", 1)
    world.converge()
    assert world.is_true("Running") and "ctr-evaluator-0" in world.pods and world.plan().actions == []
    assert [e.reason for e in world.events][-1] == "EvaluatorFinished"


# ----------------------------------------------------------------------------------------------- policies
def test_active_deadline_fails_and_requeues_before():
    world = World(make_job(run_policy={"activeDeadlineSeconds": 60}))
    world.converge()
    world.run_all()
    world.now += timedelta(seconds=20)
    plan = world.step()
    assert plan.requeue_after == pytest.approx(40)
    world.now += timedelta(seconds=40)
    plan = world.step()
    assert world.cond("Failed")["reason"] == "DeadlineExceeded"
    assert "activeDeadlineSeconds=60" in world.cond("Failed")["message"]
    assert {a.name for a in plan.of(A.DeletePod)} == set(world.created)


@pytest.mark.parametrize("finished_after,state", [(50, "Succeeded"), (59, "Succeeded"), (61, "Failed"),
                                                   (None, "Succeeded")])
def test_chief_success_seen_after_the_deadline_counts_when_it_finished(finished_after, state):
    """The operator may see a chief's exit late (a restart, a slow watch): when it exited decides, not when seen."""
    world = World(make_job(run_policy={"activeDeadlineSeconds": 60}))
    world.converge()
    world.run_all()
    world.exit("ctr-chief-0", 0)
    if finished_after is not None:
        term = world.pods["ctr-chief-0"]["status"]["containerStatuses"][0]["state"]["terminated"]
        term["finishedAt"] = observed.fmt_time(NOW + timedelta(seconds=finished_after))
    world.now += timedelta(seconds=90)
    world.step()
    assert world.job["status"]["state"] == state
    if state == "Failed":
        assert world.cond("Failed")["reason"] == "DeadlineExceeded"


def test_lost_token_secret_restarts_every_pod_with_a_new_one_without_using_backoff():
    world = running(evaluator=1)
    before = {name: pod["metadata"]["uid"] for name, pod in world.pods.items()}
    world.secret = None  # someone ran kubectl delete secret ctr-kubeps-token
    plan = world.step()
    assert plan.of(A.CreateSecret) and not plan.of(A.CreatePod)
    assert {a.name for a in plan.of(A.DeletePod)} == set(before)
    assert world.is_true("Restarting") and world.cond("Restarting")["reason"] == "TokenSecretLost"
    assert "ctr-kubeps-token" in world.cond("Restarting")["message"]
    assert world.job["status"].get("backoffCount", 0) == 0
    world.converge()
    assert set(world.pods) == set(before) and all(world.pods[n]["metadata"]["uid"] != u for n, u in before.items())
    world.run_all()
    world.step()
    assert world.is_true("Running") and not world.is_true("Restarting")
    assert world.job["status"]["replicaStatuses"]["Chief"]["restarts"] == 1
    assert world.job["status"]["replicaStatuses"]["PS"]["restarts"] == 2
    assert world.plan().actions == []


def test_no_secret_and_no_pods_is_just_a_new_job():
    world = World(make_job())
    plan = world.plan()
    assert plan.of(A.CreateSecret) and not plan.of(A.DeletePod) and not world.is_true("Restarting")


def test_ttl_deletes_the_finished_job_when_due():
    world = running(run_policy={"ttlSecondsAfterFinished": 30})
    world.exit("ctr-chief-0", 0)
    plan = world.step()
    assert plan.requeue_after == pytest.approx(30) and not plan.of(A.DeleteJob)
    world.now += timedelta(seconds=30)
    plan = world.step()
    assert plan.of(A.DeleteJob) and world.deleted_job


def test_suspend_deletes_children_and_resume_recreates_and_resets_start_time():
    world = running()
    world.job["spec"]["runPolicy"]["suspend"] = True
    plan = world.step()
    assert len(plan.of(A.DeletePod)) == 6 and len(plan.of(A.DeleteService)) == 6
    assert world.is_true("Suspended") and not world.is_true("Running") and world.job["status"]["state"] == "Suspended"
    assert world.plan().actions == [] and not world.pods
    world.now += timedelta(minutes=5)
    world.job["spec"]["runPolicy"]["suspend"] = False
    plan = world.step()
    assert len(plan.of(A.CreatePod)) == 6 and len(plan.of(A.CreateService)) == 6
    assert world.cond("Suspended")["status"] == "False" and world.cond("Suspended")["reason"] == "Resumed"
    assert world.job["status"]["startTime"] == "2025-01-01T12:05:00Z"


def test_suspended_at_creation_creates_no_pods():
    world = World(make_job(run_policy={"suspend": True}))
    plan = world.step()
    assert not plan.of(A.CreatePod) and world.is_true("Suspended") and plan.of(A.CreateSecret)


def test_deadline_does_not_count_suspended_time():
    world = World(make_job(run_policy={"activeDeadlineSeconds": 60, "suspend": True}))
    world.step()
    world.now += timedelta(minutes=10)
    world.job["spec"]["runPolicy"]["suspend"] = False
    world.step()
    assert not world.is_true("Failed")


# ----------------------------------------------------------------------------------------------- invalid specs
@pytest.mark.parametrize("mutate,field", [
    (lambda s: s["replicaSpecs"].pop("Chief"), "replicaSpecs.Chief"),
    (lambda s: s["replicaSpecs"]["PS"].update(replicas=0), "replicaSpecs.PS.replicas"),
    (lambda s: s["replicaSpecs"]["Worker"].update(restartPolicy="Sometimes"), "replicaSpecs.Worker.restartPolicy"),
    (lambda s: s["replicaSpecs"]["Chief"]["template"]["spec"].update(containers="nope"),
     "replicaSpecs.Chief.template.spec.containers"),
    (lambda s: s["runPolicy"].update(backoffLimit=-1), "runPolicy.backoffLimit"),
])
def test_invalid_spec_fails_the_job_with_the_field_named(mutate, field):
    job = make_job()
    mutate(job["spec"])
    world = World(job)
    plan = world.step()
    assert plan.terminal and not plan.of(A.CreatePod)
    cond = world.cond("Failed")
    assert cond["reason"] == "InvalidSpec" and f"spec.{field}" in cond["message"]
    assert world.plan().actions == []  # no retry loop


def test_invalid_name_fails_the_job():
    world = World(make_job(name="x" * 52))
    world.step()
    assert world.cond("Failed")["reason"] == "InvalidSpec" and "51" in world.cond("Failed")["message"]


def test_fail_status_marks_failed_once():
    job = running().job
    status = P.fail_status(job, "InvalidPodTemplate", "pod rejected", NOW)
    assert status["state"] == "Failed"
    job["status"] = status
    again = P.fail_status(job, "Other", "x", NOW + timedelta(seconds=5))
    assert again == status


# ----------------------------------------------------------------------------------------------- level-based
@pytest.mark.parametrize("seed", range(8))
def test_operator_killed_mid_reconcile_converges_without_duplicates_or_orphans(seed):
    """Apply a random prefix of every plan (the operator died), re-plan from what exists, repeat."""
    rng = random.Random(seed)
    world = World(make_job(ps=2, workers=4, evaluator=1))

    def crashy_converge():
        for _ in range(60):
            plan = world.plan()
            work = [a for a in plan.actions if not isinstance(a, A.Event)]
            if not work and plan.status == world.job["status"]:
                return
            world.apply(plan, limit=rng.randint(0, len(plan.actions)))
        raise AssertionError("no convergence")

    crashy_converge()
    world.run_all()
    crashy_converge()
    world.exit("ctr-ps-0", 137)
    world.exit("ctr-worker-3", 1)
    crashy_converge()
    world.run_all()
    crashy_converge()
    assert world.is_true("Running")
    status = world.job["status"]
    assert status["backoffCount"] == 1 and status["replicaStatuses"]["Worker"]["restarts"] == 1
    expected = {"ctr-chief-0", "ctr-ps-0", "ctr-ps-1", "ctr-evaluator-0"} | {f"ctr-worker-{i}" for i in range(4)}
    assert set(world.pods) == expected and set(world.services) == expected
    assert world.created.count("ctr-ps-1") == 1  # never created twice while it lived


# ----------------------------------------------------------------------------------------------- review findings
def mark_deleted(world: World, name: str) -> None:
    """Someone other than the operator deleted the pod (kubectl delete, a drain, the node lifecycle controller):
    it is terminating, and still running for its grace period."""
    world.pods[name]["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:00Z"


def test_ps_deleted_by_someone_else_restarts_the_chief_too():
    world = running(ps=2)
    chief_uid = world.pods["ctr-chief-0"]["metadata"]["uid"]
    mark_deleted(world, "ctr-ps-1")
    plan = world.step()
    assert [a.name for a in plan.of(A.DeletePod)] == ["ctr-chief-0"]
    assert world.is_true("Restarting") and world.cond("Restarting")["reason"] == "PSFailed"
    assert "ctr-ps-1" in world.cond("Restarting")["message"] and "deleted" in world.cond("Restarting")["message"]
    assert world.job["status"]["backoffCount"] == 1 and world.job["status"]["chiefEpoch"] == 1
    world.step()  # the same terminating pod seen again: counted once
    assert world.job["status"]["backoffCount"] == 1
    del world.pods["ctr-ps-1"]
    world.converge()
    assert world.pods["ctr-chief-0"]["metadata"]["uid"] != chief_uid
    world.run_all()
    world.converge()
    assert world.is_true("Running") and world.job["status"]["replicaStatuses"]["PS"]["restarts"] == 1


def test_chief_deleted_by_someone_else_counts_as_a_chief_restart():
    world = running(run_policy={"backoffLimit": 1})
    mark_deleted(world, "ctr-chief-0")
    world.step()
    assert world.is_true("Restarting") and world.cond("Restarting")["reason"] == "ChiefFailed"
    assert world.job["status"]["backoffCount"] == 1
    assert world.job["status"]["replicaStatuses"]["Chief"]["restarts"] == 1
    del world.pods["ctr-chief-0"]
    world.converge()
    world.run_all()
    world.converge()
    assert world.is_true("Running")
    mark_deleted(world, "ctr-chief-0")
    world.step()
    assert world.cond("Failed")["reason"] == "BackoffLimitExceeded"


def test_pods_still_terminating_after_suspend_are_not_failures_on_resume():
    world = running(ps=2)
    world.job["spec"]["runPolicy"]["suspend"] = True
    plan = world.plan()
    world.apply(plan, limit=0)  # status written; the pods are deleted, but still terminating when resumed
    for name in list(world.pods):
        mark_deleted(world, name)
    world.job["spec"]["runPolicy"]["suspend"] = False
    world.step()
    assert not world.is_true("Restarting") and world.job["status"]["backoffCount"] == 0
    world.pods.clear()
    world.converge()
    world.run_all()
    world.converge()
    assert world.is_true("Running") and world.job["status"]["restarts"] == 0


def test_our_own_chief_restart_is_not_mistaken_for_a_deletion():
    world = running(ps=1)
    world.exit("ctr-ps-0", 137)
    chief = copy.deepcopy(world.pods["ctr-chief-0"])
    world.step()
    # The chief's delete was issued: it is terminating (not yet gone) in the next observation.
    world.pods["ctr-chief-0"] = chief
    mark_deleted(world, "ctr-chief-0")
    world.step()
    status = world.job["status"]
    assert status["backoffCount"] == 1 and status["replicaStatuses"]["Chief"]["restarts"] == 1
    assert world.cond("Restarting")["reason"] == "PSFailed"


def test_in_place_restarts_of_a_recreated_pod_still_count_against_backoff():
    world = running(run_policy={"backoffLimit": 3})
    world.pods["ctr-chief-0"]["status"]["containerStatuses"][0]["restartCount"] = 2
    world.step()
    assert world.is_true("Running")
    world.exit("ctr-ps-0", 137)  # restart 3 of 3: allowed, and the chief (2 in-place restarts) is recreated
    world.converge()
    world.run_all()
    world.converge()
    assert world.is_true("Running") and world.job["status"]["backoffCount"] == 3
    world.exit("ctr-ps-1", 137)  # restart 4 > backoffLimit 3
    world.step()
    assert world.cond("Failed")["reason"] == "BackoffLimitExceeded"


def test_two_ps_failing_together_restart_the_chief_once():
    world = running(ps=2)
    world.exit("ctr-ps-0", 137)
    world.exit("ctr-ps-1", 137)
    world.converge()
    world.run_all()
    world.converge()
    status = world.job["status"]
    assert world.created.count("ctr-chief-0") == 2  # created once, recreated once
    assert status["replicaStatuses"]["Chief"]["restarts"] == 1
    assert status["replicaStatuses"]["PS"]["restarts"] == 2


@pytest.mark.parametrize("mutate", [
    lambda t: t.update(metadata={"labels": "team=ads"}),
    lambda t: t.update(metadata={"annotations": ["a"]}),
    lambda t: t["spec"]["containers"][0].update(env="TF_CONFIG={}"),
    lambda t: t["spec"]["containers"][0].update(env=["A=1"]),
])
def test_template_the_planner_cannot_build_a_pod_from_fails_the_job_instead_of_raising(mutate):
    job = make_job()
    mutate(job["spec"]["replicaSpecs"]["Worker"]["template"])
    world = World(job)
    plan = world.step()
    assert plan.terminal and not plan.of(A.CreatePod)
    cond = world.cond("Failed")
    assert cond["reason"] == "InvalidPodTemplate" and "spec.replicaSpecs.Worker.template" in cond["message"]
    assert world.plan().actions == []


@pytest.mark.parametrize("run_policy", [
    {"ttlSecondsAfterFinished": "soon", "backoffLimit": -1},
    {"ttlSecondsAfterFinished": "soon", "cleanPodPolicy": "Sometimes"},
])
def test_invalid_run_policy_fails_the_job_instead_of_raising(run_policy):
    world = World(make_job(run_policy=run_policy))
    world.step()
    assert world.cond("Failed")["reason"] == "InvalidSpec"
    job = make_job()
    job["spec"]["runPolicy"] = ["suspend"]
    world = World(job)
    world.step()
    assert world.cond("Failed")["reason"] == "InvalidSpec" and "runPolicy" in world.cond("Failed")["message"]


def test_job_being_deleted_in_the_foreground_recreates_nothing():
    """kubectl delete --cascade=foreground: the job stays (deletionTimestamp set) while the garbage collector deletes
    its children; recreating them would fight the collector and count restarts that never happened."""
    world = running(ps=2)
    status = copy.deepcopy(world.job["status"])
    world.job["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:00Z"
    mark_deleted(world, "ctr-ps-0")
    mark_deleted(world, "ctr-chief-0")
    del world.pods["ctr-worker-0"]
    plan = world.plan()
    assert not plan.of(A.CreatePod) and not plan.of(A.CreateService) and not plan.of(A.DeletePod)
    assert plan.status["backoffCount"] == status["backoffCount"] and plan.status["conditions"] == status["conditions"]


def test_many_workers_failed_for_good_are_counted_once():
    """More finished pods than handledPods used to keep (256): the oldest UIDs were dropped, counted again at the
    next reconcile, and so on forever (a status write per reconcile, each triggering the next)."""
    world = running(workers=300, policies={"Worker": "Never"})
    for i in range(280):
        world.exit(f"ctr-worker-{i}", 1)
    world.step()
    plan = world.converge()
    assert world.job["status"]["replicaStatuses"]["Worker"]["failed"] == 280
    assert plan.status == world.job["status"] and not plan.of(A.Event)


def test_handled_pods_limit_covers_every_pod_a_job_can_have():
    most = 1 + models.MAX_PS + models.MAX_WORKERS + 1
    assert HANDLED_LIMIT >= 2 * most  # each name may have a terminating pod and its replacement
    assert models.PSTrainingJobStatus.model_fields["handledPods"].metadata[0].max_length >= HANDLED_LIMIT


def _waiting(world: World, name: str, reason: str, message: str | None = None) -> None:
    state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
    world.pods[name]["status"] = {"phase": "Pending",
                                  "containerStatuses": [{"name": "kubeps", "restartCount": 0, "state": state}]}


def test_pods_that_cannot_start_are_named_in_the_running_condition_until_they_start():
    """A missing image leaves a TFJob in Created with no word of why; here Running is False with the reason."""
    world = World(make_job())
    world.converge()
    _waiting(world, "ctr-worker-0", "ContainerCreating")  # the usual wait: nothing to say
    world.step()
    assert world.cond("Running") is None

    _waiting(world, "ctr-worker-1", "ErrImagePull", "pull access denied for img")
    world.step()
    cond = world.cond("Running")
    assert (cond["status"], cond["reason"]) == ("False", "PodsCannotStart")
    assert cond["message"] == "1 pod(s) cannot start; ctr-worker-1: container kubeps: ErrImagePull: pull access denied for img"
    assert world.job["status"]["state"] == "Created"
    assert [e.type for e in world.events if e.reason == "PodsCannotStart"] == ["Warning"]

    _waiting(world, "ctr-worker-1", "ImagePullBackOff", "Back-off pulling image")  # the kubelet's next word
    _waiting(world, "ctr-chief-0", "ErrImageNeverPull")
    world.step()
    assert world.cond("Running")["message"] == "2 pod(s) cannot start; ctr-chief-0: container kubeps: ErrImageNeverPull"
    assert len([e for e in world.events if e.reason == "PodsCannotStart"]) == 1  # one Event when it began

    _waiting(world, "ctr-chief-0", "ContainerCreating")
    _waiting(world, "ctr-worker-1", "ContainerCreating")  # the image came: gone again
    world.step()
    assert world.cond("Running") is None
    world.run_all()
    world.converge()
    assert world.is_true("Running")


def test_a_stuck_pod_does_not_hide_why_a_job_restarts():
    world = running()
    world.exit("ctr-ps-0", 1)
    world.converge()
    assert world.is_true("Restarting")
    reason = world.cond("Running")["reason"]
    _waiting(world, "ctr-ps-0", "ErrImagePull")
    world.step()
    assert world.cond("Running")["reason"] == reason


def test_the_default_retry_rule_is_the_pod_contracts():
    """ExitCode without retryableExitCodes retries what the runtime's own supervisor retries (one rule, in
    kubeps.runtime.contract); an unknown code (an evicted or lost pod) is retried."""
    from kubeps.runtime.contract import is_retryable_exit

    policy = models.RunPolicy()
    assert [c for c in range(1, 256) if policy.retryable(c)] == [c for c in range(1, 256) if is_retryable_exit(c)]
    assert policy.retryable(None)


@pytest.mark.parametrize("exit", lifecycle.EXIT_CLASSES)
@pytest.mark.parametrize("policy", list(lifecycle.POLICIES))
@pytest.mark.parametrize("rt", list(models.REPLICA_TYPES))
def test_the_planner_follows_the_lifecycle_table(rt, policy, exit):
    """Every role x restart policy x class of exit: the pods the planner restarts, what it counts against
    backoffLimit and how the job ends are the runtime's lifecycle table's (kubeps.runtime.lifecycle), which
    ``kubeps local --restart`` reads too (tests/fault_tolerance/test_lifecycle_table.py)."""
    world = running(ps=1, workers=2, evaluator=1, policies={rt.value: policy})
    name = children.child_name("ctr", rt, 0)
    world.exit(name, {lifecycle.SUCCESS: 0, lifecycle.RETRYABLE: 137, lifecycle.PERMANENT: 1}[exit])
    plan = world.step()
    decision = lifecycle.decide(rt.task_type, exit, policy)
    assert world.is_true("Succeeded") == (decision.outcome == lifecycle.SUCCEEDED)
    assert world.is_true("Failed") == (decision.outcome == lifecycle.FAILED)
    assert world.job["status"].get("backoffCount", 0) == (1 if decision.counted else 0)
    if decision.outcome is None:  # (a finished job's pods go per cleanPodPolicy)
        assert {a.name for a in plan.of(A.DeletePod)} == {f"ctr-{role}-0" for role in decision.restarts}
        assert world.job["status"].get("chiefEpoch", 0) == (1 if "chief" in decision.restarts[1:] else 0)


def test_a_1000_worker_job_formats_its_cluster_once_and_every_pod_gets_it():
    """Every pod's TF_CONFIG lists all 1,051 tasks; the addresses are formatted once per job shape, not once per pod
    (that was O(pods^2): 5.4 ms per pod body at this size), and a new shape (scaled workers) gets a new list."""
    job = make_job(name="big", ps=50, workers=1000)
    spec = models.parse_spec(job["spec"])
    config = children.PlanConfig()
    children._formatted_cluster.cache_clear()
    bodies = [children.pod_body(job, spec, models.ReplicaType.WORKER, i, 0, config) for i in (0, 999)]
    bodies.append(children.pod_body(job, spec, models.ReplicaType.PS, 49, 0, config))
    assert children._formatted_cluster.cache_info().misses == 1
    for body, (task_type, index) in zip(bodies, [("worker", 0), ("worker", 999), ("ps", 49)]):
        env = {e["name"]: e.get("value") for e in body["spec"]["containers"][0]["env"]}
        config_of_pod = TFConfig.parse(env["TF_CONFIG"])
        assert (config_of_pod.task_type, config_of_pod.task_index) == (task_type, index)
        assert [len(config_of_pod.cluster[t]) for t in ("chief", "ps", "worker")] == [1, 50, 1000]
        assert config_of_pod.cluster["worker"][999] == "big-worker-999.ns.svc:2222"
    scaled = copy.deepcopy(job)
    scaled["spec"]["replicaSpecs"]["Worker"]["replicas"] = 999
    body = children.pod_body(scaled, models.parse_spec(scaled["spec"]), models.ReplicaType.WORKER, 998, 0, config)
    env = {e["name"]: e.get("value") for e in body["spec"]["containers"][0]["env"]}
    assert len(TFConfig.parse(env["TF_CONFIG"]).cluster["worker"]) == 999
