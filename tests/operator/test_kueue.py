"""Kueue admission with real Kueue v0.19.2 (its manager, CRDs and webhooks; tests/operator/kueue_cluster.py) and
the operator with ``--kueue on``, on the loopback control plane with kwok nodes and the real kube-scheduler.

A ClusterQueue with quota for one job (3 CPUs: chief, ps and worker of 1 CPU each), preemption of lower priority
within it; each test its own LocalQueue ``team`` in a fresh namespace.
"""

from __future__ import annotations

import threading
import time

import pytest

from .conftest import GROUP, PLURAL, VERSION

pytestmark = pytest.mark.slow

KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
FLAVOR = "kwok-nodes"
CQ = "kubeps-cq"


@pytest.fixture(scope="module")
def cluster_queue(kube, kueue):
    """A ResourceFlavor of the kwok nodes, a ClusterQueue with quota for one job, two WorkloadPriorityClasses."""
    kube.apply({"apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "ResourceFlavor",
                "metadata": {"name": FLAVOR}, "spec": {"nodeLabels": {"type": "kwok"}}})
    kube.apply({"apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "ClusterQueue", "metadata": {"name": CQ},
                "spec": {"namespaceSelector": {},
                         "preemption": {"withinClusterQueue": "LowerPriority"},
                         "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [
                             {"name": FLAVOR, "resources": [{"name": "cpu", "nominalQuota": "3"},
                                                            {"name": "memory", "nominalQuota": "3Gi"}]}]}]}})
    for name, value in (("low", 10), ("high", 1000)):
        kube.apply({"apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "WorkloadPriorityClass",
                    "metadata": {"name": f"kubeps-{name}"}, "value": value, "description": f"{name} priority"})
    kube.wait_for(lambda: _cq_active(kube), timeout=60, what=f"ClusterQueue {CQ} to be Active")
    yield CQ
    kube.kubectl("delete", f"clusterqueues.{KUEUE_GROUP}", CQ, "--ignore-not-found", "--wait=false", check=False)


def _cq_status(kube) -> dict:
    return kube.custom().get_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, "clusterqueues", CQ).get("status", {})


def _cq_active(kube) -> bool:
    return any(c["type"] == "Active" and c["status"] == "True" for c in _cq_status(kube).get("conditions", []))


@pytest.fixture
def queue(kube, kq_ns, cluster_queue):
    # The quota held by an earlier test's jobs is given back once its namespace is gone: start from an empty queue.
    kube.wait_for(lambda: _cq_status(kube).get("reservingWorkloads", 0) == 0, timeout=120,
                  what=f"ClusterQueue {CQ} to hold no workload of an earlier test")
    kube.apply({"apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "LocalQueue",
                "metadata": {"name": "team", "namespace": kq_ns}, "spec": {"clusterQueue": cluster_queue}})
    return kq_ns


def job_body(name: str, queue: str | None = "team", priority: str | None = None, workers: int = 1,
             template_labels: dict | None = None) -> dict:
    def replica(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {
            "metadata": {"labels": dict(template_labels or {})},
            "spec": {"containers": [{"name": "kubeps", "image": "registry.test/kubeps-runtime:test",
                                     "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]}}}

    labels = {}
    if queue:
        labels["kueue.x-k8s.io/queue-name"] = queue
    if priority:
        labels["kueue.x-k8s.io/priority-class"] = priority
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PSTrainingJob",
            "metadata": {"name": name, "labels": labels},
            "spec": {"replicaSpecs": {"Chief": replica(1), "PS": replica(1), "Worker": replica(workers)},
                     "security": {"tls": {"mode": "Disabled"}}}}


def create_job(kube, namespace: str, body: dict) -> dict:
    return kube.custom().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def get_job(kube, namespace: str, name: str) -> dict:
    return kube.custom().get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def condition(obj: dict, ctype: str) -> dict | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return cond
    return None


def is_true(obj: dict, ctype: str) -> bool:
    cond = condition(obj, ctype)
    return bool(cond and cond["status"] == "True")


def workload_of(kube, namespace: str, job: str) -> dict | None:
    items = kube.custom().list_namespaced_custom_object(
        KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", label_selector=f"kubeps.dev/job-name={job}")["items"]
    return items[0] if items else None


def pods_of(kube, namespace: str, job: str) -> list:
    return kube.core().list_namespaced_pod(namespace, label_selector=f"kubeps.dev/job-name={job}").items


def running_pods(kube, namespace: str, job: str, count: int) -> bool:
    pods = pods_of(kube, namespace, job)
    return len(pods) == count and all(p.status.phase == "Running" and not p.metadata.deletion_timestamp
                                      for p in pods)


class PodWatch:
    """Every pod ever seen (ADDED) per job in a namespace, from a watch running for the whole test."""

    def __init__(self, kube, namespace: str):
        from kubernetes import watch

        self.seen: dict[str, set[str]] = {}
        self.error: Exception | None = None
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(kube, namespace), daemon=True)
        self._thread.start()

    def _run(self, kube, namespace: str) -> None:
        try:
            for event in self._watch.stream(kube.core().list_namespaced_pod, namespace,
                                            label_selector="kubeps.dev/job-name", timeout_seconds=600):
                pod = event["object"]
                self.seen.setdefault(pod.metadata.labels["kubeps.dev/job-name"], set()).add(pod.metadata.uid)
        except Exception as err:  # noqa: BLE001 - the namespace goes at the end of the test; say why it stopped
            self.error = err

    def stop(self) -> None:
        self._watch.stop()


def test_second_job_waits_with_no_pod_until_the_first_finishes(kube, queue):
    namespace = queue
    pods = PodWatch(kube, namespace)
    try:
        # The queue label copied onto the pods too: Kueue's pod webhook leaves them alone, because their owner's kind
        # is registered in integrations.externalFrameworks (without that it would gate them forever).
        create_job(kube, namespace, job_body("first", template_labels={"kueue.x-k8s.io/queue-name": "team"}))
        kube.wait_for(lambda: running_pods(kube, namespace, "first", 3), timeout=60, what="first job's 3 pods Running")
        workload = workload_of(kube, namespace, "first")
        assert workload["metadata"]["ownerReferences"][0]["kind"] == "PSTrainingJob"
        assert [(s["name"], s["count"]) for s in workload["spec"]["podSets"]] == [("chief", 1), ("ps", 1),
                                                                                    ("worker", 1)]
        assert is_true(workload, "Admitted")
        for pod in pods_of(kube, namespace, "first"):
            assert pod.spec.node_selector == {"type": "kwok"}, pod.spec.node_selector
            assert pod.metadata.labels["kueue.x-k8s.io/podset"] == pod.metadata.labels["kubeps.dev/replica-type"]
            assert not pod.spec.scheduling_gates
        kube.wait_for(lambda: is_true(workload_of(kube, namespace, "first"), "PodsReady"), timeout=30,
                      what="PodsReady on the first Workload")

        create_job(kube, namespace, job_body("second"))
        kube.wait_for(lambda: workload_of(kube, namespace, "second") is not None, timeout=30,
                      what="the second job's Workload")
        kube.wait_for(lambda: condition(workload_of(kube, namespace, "second"), "QuotaReserved") is not None,
                      timeout=30, what="Kueue to consider the second Workload")
        time.sleep(5)  # long enough for a wrongly started pod to show up in the watch
        second = get_job(kube, namespace, "second")
        assert is_true(second, "Suspended") and condition(second, "Suspended")["reason"] == "Queued", second["status"]
        assert second["status"]["state"] == "Suspended"
        assert not is_true(workload_of(kube, namespace, "second"), "QuotaReserved")
        assert pods.error is None and "first" in pods.seen, f"the pod watch failed: {pods.error}"
        assert "second" not in pods.seen, "a pod of a job Kueue has not admitted was created"

        kube.terminate_pod(namespace, "first-chief-0", 0, wait=False)
        kube.wait_for(lambda: is_true(get_job(kube, namespace, "first"), "Succeeded"), timeout=60,
                      what="the first job to succeed")
        kube.wait_for(lambda: is_true(workload_of(kube, namespace, "first"), "Finished"), timeout=30,
                      what="Finished on the first Workload")
        assert condition(workload_of(kube, namespace, "first"), "Finished")["reason"] == "Succeeded"
        kube.wait_for(lambda: running_pods(kube, namespace, "second", 3), timeout=90,
                      what="second job's pods Running once the first finished")
        assert condition(get_job(kube, namespace, "second"), "Suspended")["status"] == "False"
    finally:
        pods.stop()


def test_higher_priority_job_preempts_and_the_preempted_one_is_requeued_and_runs_again(kube, queue):
    namespace = queue
    create_job(kube, namespace, job_body("low", priority="kubeps-low"))
    kube.wait_for(lambda: running_pods(kube, namespace, "low", 3), timeout=60, what="low job's pods Running")
    first_uids = {p.metadata.uid for p in pods_of(kube, namespace, "low")}
    assert workload_of(kube, namespace, "low")["spec"]["priority"] == 10

    create_job(kube, namespace, job_body("high", priority="kubeps-high"))

    def low_evicted() -> bool:
        job = get_job(kube, namespace, "low")
        return condition(job, "Suspended") is not None and condition(job, "Suspended")["reason"] == "Evicted"

    kube.wait_for(low_evicted, timeout=60, what="the low job to be evicted")
    kube.wait_for(lambda: running_pods(kube, namespace, "high", 3), timeout=90, what="high job's pods Running")
    assert not (first_uids & {p.metadata.uid for p in pods_of(kube, namespace, "low")})
    low_wl = workload_of(kube, namespace, "low")
    assert condition(low_wl, "Requeued")["status"] == "True" and condition(low_wl, "Requeued")["reason"] == "Preempted"
    assert condition(low_wl, "QuotaReserved")["status"] == "False" and not low_wl["status"].get("admission")

    kube.terminate_pod(namespace, "high-chief-0", 0, wait=False)
    kube.wait_for(lambda: running_pods(kube, namespace, "low", 3), timeout=120,
                  what="the low job re-admitted and running again")
    again = {p.metadata.uid for p in pods_of(kube, namespace, "low")}
    assert not (again & first_uids), "the re-admitted job runs new pods"
    low = get_job(kube, namespace, "low")
    assert not is_true(low, "Failed") and condition(low, "Suspended")["status"] == "False"


def test_a_job_without_the_label_runs_at_once_and_an_unknown_queue_keeps_it_queued(kube, queue):
    namespace = queue
    create_job(kube, namespace, job_body("free", queue=None))
    kube.wait_for(lambda: running_pods(kube, namespace, "free", 3), timeout=60, what="unqueued job running")
    assert workload_of(kube, namespace, "free") is None
    create_job(kube, namespace, job_body("lost", queue="no-such-queue"))
    kube.wait_for(lambda: workload_of(kube, namespace, "lost") is not None, timeout=30, what="its Workload")
    time.sleep(3)
    job = get_job(kube, namespace, "lost")
    assert condition(job, "Suspended")["reason"] == "Queued" and "no-such-queue" in condition(job, "Suspended")["message"]
    assert pods_of(kube, namespace, "lost") == []


def test_suspend_gives_the_quota_back_and_resume_queues_again(kube, queue):
    namespace = queue
    create_job(kube, namespace, job_body("pausable"))
    kube.wait_for(lambda: running_pods(kube, namespace, "pausable", 3), timeout=60, what="pods Running")
    kube.custom().patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "pausable",
                                                 {"spec": {"runPolicy": {"suspend": True}}})
    kube.wait_for(lambda: pods_of(kube, namespace, "pausable") == [], timeout=60, what="pods gone")
    kube.wait_for(lambda: not workload_of(kube, namespace, "pausable")["status"].get("admission"), timeout=60,
                  what="the admission given back")
    assert workload_of(kube, namespace, "pausable")["spec"]["active"] is False
    kube.custom().patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "pausable",
                                                 {"spec": {"runPolicy": {"suspend": False}}})
    kube.wait_for(lambda: running_pods(kube, namespace, "pausable", 3), timeout=90, what="pods Running again")


def doc_blocks() -> list[list[dict]]:
    """The YAML blocks of docs/kueue.md, each as its documents."""
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[2] / "docs" / "kueue.md").read_text()
    return [[d for d in yaml.safe_load_all(block) if d] for block in re.findall(r"```yaml\n(.*?)```", text, re.S)]


def test_the_documented_queue_and_job_run_as_written(kube, kq_ns):
    """docs/kueue.md's queues and job, applied as a user would (kubectl apply -n <namespace>)."""
    _config, queues, [job] = doc_blocks()
    for obj in queues:
        kube.apply(obj, namespace=kq_ns if obj["kind"] == "LocalQueue" else None)
    try:
        kube.apply(job, namespace=kq_ns)
        name = job["metadata"]["name"]
        kube.wait_for(lambda: running_pods(kube, kq_ns, name, 5), timeout=90, what="the documented job's 5 pods")
        workload = workload_of(kube, kq_ns, name)
        assert workload["spec"]["queueName"] == "team-a" and is_true(workload, "Admitted")
        usage = {a["name"]: a["resourceUsage"]["cpu"] for a in workload["status"]["admission"]["podSetAssignments"]}
        assert usage == {"chief": "1", "ps": "2", "worker": "4"}, usage
        kube.terminate_pod(kq_ns, f"{name}-chief-0", 0, wait=False)
        kube.wait_for(lambda: is_true(workload_of(kube, kq_ns, name), "Finished"), timeout=60,
                      what="the documented job's Workload Finished")
    finally:
        kube.kubectl("delete", "-n", kq_ns, "pstrainingjobs", "--all", "--wait=false", check=False)
        for obj in queues:
            if obj["kind"] != "LocalQueue":
                kube.kubectl("delete", f"{obj['kind'].lower()}s.kueue.x-k8s.io", obj["metadata"]["name"],
                             "--ignore-not-found", "--wait=false", check=False)
