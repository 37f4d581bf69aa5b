"""The operator against the real control plane: children, TF_CONFIG and the PS-aware lifecycle."""

from __future__ import annotations

import base64
import json

import pytest

from kubeps.runtime.cluster import TFConfig

from .conftest import (
    condition,
    create_job,
    get_job,
    job_manifest,
    patch_job,
    pods_of,
    services_of,
    wait_state,
)


def env_of(pod) -> dict:
    main = next(c for c in pod.spec.containers if c.name == "kubeps")
    return {e.name: e for e in main.env or []}


def uids(pods: dict) -> dict:
    return {name: p.metadata.uid for name, p in pods.items()}


def test_job_yields_pods_services_secret_and_tf_config(kube, ns, operator):
    create_job(kube, ns, job_manifest("ctr", ps=2, workers=2, evaluator=1))
    job = wait_state(kube, ns, "ctr", "Running")
    uid = job["metadata"]["uid"]
    pods = pods_of(kube, ns, "ctr")
    names = ["ctr-chief-0", "ctr-evaluator-0", "ctr-ps-0", "ctr-ps-1", "ctr-worker-0", "ctr-worker-1"]
    assert sorted(pods) == names
    svcs = services_of(kube, ns, "ctr")
    assert sorted(svcs) == names
    cluster = {
        "chief": [f"ctr-chief-0.{ns}.svc:2222"],
        "ps": [f"ctr-ps-0.{ns}.svc:2222", f"ctr-ps-1.{ns}.svc:2222"],
        "worker": [f"ctr-worker-0.{ns}.svc:2222", f"ctr-worker-1.{ns}.svc:2222"],
    }
    for name, pod in pods.items():
        _, task_type, index = name.rsplit("-", 2)
        owner = pod.metadata.owner_references[0]
        assert (owner.kind, owner.uid, owner.controller) == ("PSTrainingJob", uid, True)
        assert pod.metadata.labels["kubeps.dev/job-name"] == "ctr"
        assert pod.metadata.labels["kubeps.dev/replica-type"] == task_type
        assert pod.metadata.labels["kubeps.dev/replica-index"] == index
        assert pod.metadata.labels["kubeps.dev/job-role"] == task_type
        assert pod.spec.restart_policy == "Never"
        env = env_of(pod)
        tf = TFConfig.parse(env["TF_CONFIG"].value)
        assert (tf.task_type, tf.task_index) == (task_type, int(index))
        if task_type == "evaluator":
            assert tf.cluster == {"evaluator": [f"ctr-evaluator-0.{ns}.svc:2222"]}
        else:
            assert tf.cluster == cluster
        assert env["GRPC_FAIL_FAST"].value == "use_caller"
        assert env["KUBEPS_JOB_TOKEN"].value_from.secret_key_ref.name == "ctr-kubeps-token"
        ports = [(p.name, p.container_port) for p in pod.spec.containers[0].ports]
        assert ports == [("kubeps-port", 2222), ("metrics", 9090)]
        svc = svcs[name]
        assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses is True
        assert svc.spec.selector == {"kubeps.dev/job-name": "ctr", "kubeps.dev/replica-type": task_type,
                                     "kubeps.dev/replica-index": index}
        assert svc.metadata.owner_references[0].uid == uid
    # Each Service selects exactly its pod.
    endpoints = kube.core().list_namespaced_pod(ns, label_selector=",".join(
        f"{k}={v}" for k, v in svcs["ctr-ps-1"].spec.selector.items())).items
    assert [p.metadata.name for p in endpoints] == ["ctr-ps-1"]
    secret = kube.core().read_namespaced_secret("ctr-kubeps-token", ns)
    assert secret.metadata.owner_references[0].uid == uid
    assert len(base64.b64decode(secret.data["token"])) >= 32
    status = job["status"]
    assert status["ps"] == "2/2" and status["workers"] == "2/2" and status["chief"] == "Running"
    assert status["observedGeneration"] == 1 and status["startTime"]
    assert condition(job, "Created")["status"] == "True"
    table = kube.kubectl("get", "psjob", "ctr", "-n", ns).stdout
    assert table.split("\n")[0].split() == ["NAME", "STATE", "CHIEF", "PS", "WORKERS", "RESTARTS", "STEP",
                                                "EXAMPLES/S", "AGE"]
    assert table.split("\n")[1].split()[:6] == ["ctr", "Running", "Running", "2/2", "2/2", "0"]
    events = kube.core().list_namespaced_event(ns, field_selector="involvedObject.name=ctr").items
    reasons = {e.reason for e in events}
    assert {"PSTrainingJobCreated", "PodCreated", "ServiceCreated", "SecretCreated"} <= reasons
    metrics = operator.metrics()
    assert "kubeps_pods_created_total" in metrics and "kubeps_reconcile_duration_seconds_count" in metrics


def test_chief_exit_0_succeeds_and_cleans_up_running_pods(kube, ns):
    create_job(kube, ns, job_manifest("done", ps=1, workers=2, evaluator=1, run_policy={"evaluatorGraceSeconds": 4}))
    wait_state(kube, ns, "done", "Running")
    kube.terminate_pod(ns, "done-chief-0", 0)
    job = wait_state(kube, ns, "done", "Succeeded")
    assert condition(job, "Succeeded")["reason"] == "ChiefSucceeded"
    assert job["status"]["completionTime"]
    # pods and Services are deleted concurrently: wait for both. The evaluator is left its grace to evaluate the
    # final checkpoint, then deleted (a reconcile scheduled for then: nothing about the job changes meanwhile).
    kept = ["done-chief-0", "done-evaluator-0"]
    kube.wait_for(lambda: sorted(pods_of(kube, ns, "done")) == sorted(services_of(kube, ns, "done")) == kept,
                  timeout=20, what="ps and workers deleted with their Services (cleanPodPolicy Running)")
    kube.wait_for(lambda: sorted(pods_of(kube, ns, "done")) == sorted(services_of(kube, ns, "done"))
                  == ["done-chief-0"], timeout=20, what="the evaluator deleted after evaluatorGraceSeconds")


def test_worker_failure_replaces_the_worker_and_keeps_running(kube, ns):
    create_job(kube, ns, job_manifest("wf", ps=1, workers=2, run_policy={"backoffLimit": 0}))
    wait_state(kube, ns, "wf", "Running")
    before = uids(pods_of(kube, ns, "wf"))
    kube.terminate_pod(ns, "wf-worker-1", 1, wait=False)

    def replaced():
        now = uids(pods_of(kube, ns, "wf"))
        return now if now.get("wf-worker-1") not in (None, before["wf-worker-1"]) else None

    after = kube.wait_for(replaced, timeout=20, what="wf-worker-1 recreated")
    assert {k: v for k, v in after.items() if k != "wf-worker-1"} == {
        k: v for k, v in before.items() if k != "wf-worker-1"}
    job = kube.wait_for(lambda: (j := get_job(kube, ns, "wf"))["status"]["workers"] == "2/2" and j,
                        timeout=20, what="2/2 workers")
    assert job["status"]["state"] == "Running"
    assert job["status"]["replicaStatuses"]["Worker"]["restarts"] == 1
    assert job["status"]["backoffCount"] == 0


def test_ps_failure_restarts_ps_and_chief(kube, ns):
    create_job(kube, ns, job_manifest("psf", ps=2, workers=1))
    wait_state(kube, ns, "psf", "Running")
    before = uids(pods_of(kube, ns, "psf"))
    kube.terminate_pod(ns, "psf-ps-1", 137, wait=False)

    def restarted():
        now = uids(pods_of(kube, ns, "psf"))
        return now if all(now.get(n) not in (None, before[n]) for n in ("psf-ps-1", "psf-chief-0")) else None

    after = kube.wait_for(restarted, timeout=20, what="ps-1 and the chief recreated")
    assert after["psf-ps-0"] == before["psf-ps-0"] and after["psf-worker-0"] == before["psf-worker-0"]
    job = kube.wait_for(lambda: (j := get_job(kube, ns, "psf"))["status"].get("state") == "Running"
                        and j["status"]["backoffCount"] == 1 and j, timeout=20, what="Running again")
    restarting = condition(job, "Restarting")
    assert restarting["status"] == "False" and restarting["lastTransitionTime"]
    assert job["status"]["replicaStatuses"]["PS"]["restarts"] == 1
    assert job["status"]["replicaStatuses"]["Chief"]["restarts"] == 1
    events = kube.core().list_namespaced_event(ns, field_selector="involvedObject.name=psf").items
    ps_event = [e for e in events if e.reason == "PSRestarting"]
    assert ps_event and "psf-ps-1" in ps_event[0].message and "137" in ps_event[0].message


def test_permanent_chief_failure_fails_the_job(kube, ns):
    create_job(kube, ns, job_manifest("cf", policies={"Chief": "ExitCode"}))
    wait_state(kube, ns, "cf", "Running")
    kube.terminate_pod(ns, "cf-chief-0", 1)
    job = wait_state(kube, ns, "cf", "Failed")
    cond = condition(job, "Failed")
    assert cond["reason"] == "ChiefFailed" and "exit code 1" in cond["message"] and "ExitCode" in cond["message"]
    kube.wait_for(lambda: sorted(pods_of(kube, ns, "cf")) == ["cf-chief-0"], timeout=20, what="cleanup")


def test_backoff_limit_fails_after_chief_restarts(kube, ns):
    create_job(kube, ns, job_manifest("bo", run_policy={"backoffLimit": 1}))
    wait_state(kube, ns, "bo", "Running")
    first = pods_of(kube, ns, "bo")["bo-chief-0"].metadata.uid
    kube.terminate_pod(ns, "bo-chief-0", 2, wait=False)
    kube.wait_for(lambda: (p := pods_of(kube, ns, "bo").get("bo-chief-0")) is not None and p.metadata.uid != first
                  and p.status.phase == "Running", timeout=20, what="chief recreated")
    wait_state(kube, ns, "bo", "Running")
    kube.terminate_pod(ns, "bo-chief-0", 2, wait=False)
    job = wait_state(kube, ns, "bo", "Failed")
    assert condition(job, "Failed")["reason"] == "BackoffLimitExceeded"
    assert job["status"]["backoffCount"] == 1


def test_active_deadline_fails_the_job(kube, ns):
    create_job(kube, ns, job_manifest("dl", run_policy={"activeDeadlineSeconds": 2}))
    job = wait_state(kube, ns, "dl", "Failed", timeout=15)
    assert condition(job, "Failed")["reason"] == "DeadlineExceeded"
    kube.wait_for(lambda: not pods_of(kube, ns, "dl"), timeout=20, what="pods deleted after the deadline")


def test_ttl_deletes_the_finished_job(kube, ns):
    create_job(kube, ns, job_manifest("ttl", run_policy={"ttlSecondsAfterFinished": 1}))
    wait_state(kube, ns, "ttl", "Running")
    # not waiting for the pod to report its exit: one second after the job finishes, the TTL deletes the job and
    # its pods, which a loaded machine's wait could see only as gone (seen in CI)
    kube.terminate_pod(ns, "ttl-chief-0", 0, wait=False)
    kube.wait_for_deleted(lambda: get_job(kube, ns, "ttl"), timeout=20, what="job ttl")


def test_suspend_deletes_children_and_resume_recreates_them(kube, ns):
    create_job(kube, ns, job_manifest("sus", ps=1, workers=2))
    running = wait_state(kube, ns, "sus", "Running")
    patch_job(kube, ns, "sus", {"spec": {"runPolicy": {"suspend": True}}})
    job = wait_state(kube, ns, "sus", "Suspended")
    kube.wait_for(lambda: not pods_of(kube, ns, "sus") and not services_of(kube, ns, "sus"), timeout=20,
                  what="pods and Services deleted while suspended")
    assert condition(job, "Running")["status"] == "False"
    patch_job(kube, ns, "sus", {"spec": {"runPolicy": {"suspend": False}}})
    job = wait_state(kube, ns, "sus", "Running")
    assert condition(job, "Suspended")["status"] == "False" and condition(job, "Suspended")["reason"] == "Resumed"
    assert job["status"]["startTime"] >= running["status"]["startTime"]
    assert sorted(pods_of(kube, ns, "sus")) == ["sus-chief-0", "sus-ps-0", "sus-worker-0", "sus-worker-1"]


def test_worker_scale_up_and_down(kube, ns):
    create_job(kube, ns, job_manifest("sc", ps=1, workers=2))
    wait_state(kube, ns, "sc", "Running")
    patch_job(kube, ns, "sc", {"spec": {"replicaSpecs": {"Worker": {"replicas": 4}}}})
    kube.wait_for(lambda: get_job(kube, ns, "sc")["status"]["workers"] == "4/4", timeout=20, what="4 workers")
    new = pods_of(kube, ns, "sc")["sc-worker-3"]
    tf = TFConfig.parse(env_of(new)["TF_CONFIG"].value)
    assert len(tf.cluster["worker"]) == 4
    patch_job(kube, ns, "sc", {"spec": {"replicaSpecs": {"Worker": {"replicas": 1}}}})
    kube.wait_for(lambda: sorted(n for n in pods_of(kube, ns, "sc") if "worker" in n) == ["sc-worker-0"],
                  timeout=20, what="workers 1..3 removed")
    job = kube.wait_for(lambda: (j := get_job(kube, ns, "sc"))["status"]["workers"] == "1/1" and j, timeout=20,
                        what="1/1 workers")
    assert job["status"]["state"] == "Running" and job["status"]["observedGeneration"] == 3
    kube.wait_for(lambda: sorted(n for n in services_of(kube, ns, "sc") if "worker" in n) == ["sc-worker-0"],
                  timeout=20, what="the Services of workers 1..3 removed")


def test_deleting_the_job_garbage_collects_children(kube, ns):
    create_job(kube, ns, job_manifest("gc", ps=1, workers=1))
    wait_state(kube, ns, "gc", "Running")
    kube.custom().delete_namespaced_custom_object("kubeps.dev", "v1alpha1", ns, "pstrainingjobs", "gc",
                                                  propagation_policy="Background")
    kube.wait_for(lambda: not pods_of(kube, ns, "gc") and not services_of(kube, ns, "gc")
                  and not kube.core().list_namespaced_secret(ns, label_selector="kubeps.dev/job-name=gc").items,
                  timeout=40, what="children garbage-collected")


def test_template_the_api_server_rejects_fails_the_job_without_a_crash_loop(kube, ns, operator):
    bad = {"spec": {"containers": [{"name": "kubeps", "image": "x",
                                    "resources": {"limits": {"cpu": "lots"}}}]}}
    create_job(kube, ns, job_manifest("badpod", templates={"Worker": bad}))
    job = wait_state(kube, ns, "badpod", "Failed")
    cond = condition(job, "Failed")
    assert cond["reason"] == "InvalidPodTemplate" and "badpod-worker" in cond["message"]
    assert "quantities must match" in cond["message"]
    frozen = json.dumps(job["status"]["conditions"], sort_keys=True)
    kube.wait_for(lambda: not pods_of(kube, ns, "badpod"), timeout=20, what="cleanup of the pods that were made")
    assert json.dumps(get_job(kube, ns, "badpod")["status"]["conditions"], sort_keys=True) == frozen


@pytest.mark.parametrize("name", ["ctr-job"])
def test_example_manifest_runs(kube, ns, name):
    import yaml

    from .conftest import REPO

    manifest = yaml.safe_load((REPO / "examples" / "jobs" / "ctr-job.yaml").read_text())
    assert manifest["metadata"]["name"] == name
    manifest["metadata"].pop("namespace", None)
    create_job(kube, ns, manifest)
    job = wait_state(kube, ns, name, "Running", timeout=30)
    assert job["status"]["ps"].endswith("/2")


def test_secret_left_by_another_owner_is_replaced_before_any_pod_is_made(kube, ns):
    """A job re-created under the name of one just deleted finds the old job's Secret until the garbage collector
    removes it. The operator must not take it for its own: pods started with the old token would disagree with
    pods started after, and once the old Secret is gone no new one would ever be made."""
    core = kube.core()
    owner = core.create_namespaced_config_map(ns, {"metadata": {"name": "old-owner"}})
    core.create_namespaced_secret(ns, {
        "metadata": {"name": "re-kubeps-token", "labels": {"kubeps.dev/job-name": "re"},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "old-owner",
                                          "uid": owner.metadata.uid, "controller": True}]},
        "data": {"token": base64.b64encode(b"old-token").decode()}})
    job = create_job(kube, ns, job_manifest("re", ps=1, workers=1))
    import time

    time.sleep(2.0)
    assert not pods_of(kube, ns, "re"), "pods made while the Secret is someone else's"
    core.delete_namespaced_config_map("old-owner", ns, propagation_policy="Background")

    def own_secret():
        secret = core.read_namespaced_secret("re-kubeps-token", ns)
        refs = secret.metadata.owner_references or []
        return secret if any(r.uid == job["metadata"]["uid"] and r.controller for r in refs) else None

    secret = kube.wait_for(own_secret, timeout=30, what="the job's own Secret")
    assert base64.b64decode(secret.data["token"]) != b"old-token"
    wait_state(kube, ns, "re", "Running", timeout=30)


def test_deleted_token_secret_is_remade_and_pods_holding_the_old_token_restart(kube, ns, operator):
    """kubectl delete secret on a running job: the next pod the operator makes would find no token (or, once a
    new Secret exists, a token the running pods refuse). So the Secret is made again and every pod restarts."""
    core = kube.core()
    create_job(kube, ns, job_manifest("tok", ps=1, workers=2, run_policy={"backoffLimit": 0}))
    wait_state(kube, ns, "tok", "Running", timeout=30)
    old_token = core.read_namespaced_secret("tok-kubeps-token", ns).data["token"]
    before = uids(pods_of(kube, ns, "tok"))
    core.delete_namespaced_secret("tok-kubeps-token", ns)
    kube.terminate_pod(ns, "tok-worker-1", 1, wait=False)  # the operator must make a pod: it looks again

    def all_restarted():
        now = uids(pods_of(kube, ns, "tok"))
        return now if set(now) == set(before) and all(now[n] != before[n] for n in before) else None

    kube.wait_for(all_restarted, timeout=40, what="every pod of tok recreated")
    secret = core.read_namespaced_secret("tok-kubeps-token", ns)
    assert secret.data["token"] != old_token
    job = wait_state(kube, ns, "tok", "Running", timeout=30)
    assert job["status"]["backoffCount"] == 0
    reasons = {e.reason for e in core.list_namespaced_event(ns).items if e.involved_object.name == "tok"}
    assert "TokenSecretLost" in reasons


def test_template_the_planner_cannot_use_fails_the_job_without_a_crash_loop(kube, ns, operator):
    # The CRD preserves a template's unknown fields as written, so the API server accepts an env that is not a list.
    bad = {"spec": {"containers": [{"name": "kubeps", "image": "x", "env": "MODE=train"}]}}
    create_job(kube, ns, job_manifest("badenv", templates={"PS": bad}))
    job = wait_state(kube, ns, "badenv", "Failed")
    cond = condition(job, "Failed")
    assert cond["reason"] == "InvalidPodTemplate" and "spec.replicaSpecs.PS.template" in cond["message"]
    assert not pods_of(kube, ns, "badenv")
