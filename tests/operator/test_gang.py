"""Gang scheduling against the real control plane (docs/scheduling.md):

* native: Kubernetes' own gang scheduling with the real kube-scheduler (feature gates GenericWorkload and
  GangScheduling, turned on by hack/controlplane.sh) and kwok nodes this test adds: a job whose gang does not fit
  stays Pending as a whole, and starts whole when a node with room appears;
* volcano and scheduler-plugins: their real PodGroup CRDs (hack/gang-crds.sh) accept the operator's PodGroups as
  written; owned by the job, deleted on suspend and at the job's end. No such scheduler runs here.

Each test runs its own operator (``--gang-scheduler ...``) on namespaces outside the session operator's ``kop-*``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from .conftest import (
    REPO,
    OperatorProcess,
    condition,
    container,
    create_job,
    delete_namespace,
    get_job,
    job_manifest,
    make_namespace,
    patch_job,
    pods_of,
    wait_state,
)

GANG_LABEL = "kubeps.dev/gang-test"
PRIORITY_CLASS = "kubeps-gang-test"
API = {"native": ("scheduling.k8s.io", "v1alpha2"), "volcano": ("scheduling.volcano.sh", "v1beta1"),
       "scheduler-plugins": ("scheduling.x-k8s.io", "v1alpha1")}


def _unavailable(reason: str):
    if os.environ.get("KUBEPS_REQUIRE_CONTROL_PLANE") == "1":
        pytest.fail(f"KUBEPS_REQUIRE_CONTROL_PLANE=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def read_pod_group(kube, backend: str, namespace: str, name: str) -> dict | None:
    from kubernetes.client.exceptions import ApiException

    group, version = API[backend]
    try:
        return kube.custom().get_namespaced_custom_object(group, version, namespace, "podgroups", name)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def raw_pods(kube, namespace: str, job: str) -> dict[str, dict]:
    """The job's pods as the API server returns them (the Python client's models drop fields they do not know,
    such as spec.schedulingGroup)."""
    out = kube.kubectl("get", "pods", "-n", namespace, "-l", f"kubeps.dev/job-name={job}", "-o", "json").stdout
    return {p["metadata"]["name"]: p for p in json.loads(out)["items"]}


def assert_owned_by(obj: dict, job: dict) -> None:
    [owner] = obj["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "PSTrainingJob", job["metadata"]["name"], job["metadata"]["uid"], True)


@pytest.fixture
def gang_operator(kube, crd, tmp_path):
    """``start(backend)`` -> a fresh namespace watched by an operator of that gang backend."""
    started: list[tuple[OperatorProcess, str]] = []

    def start(backend: str) -> str:
        namespace = make_namespace(kube, prefix="gang-")
        proc = OperatorProcess(kube, [namespace], tmp_path / f"operator-{backend}.log",
                               ["--gang-scheduler", backend]).start()
        started.append((proc, namespace))
        return namespace

    yield start
    for proc, namespace in started:
        proc.stop()
        delete_namespace(kube, namespace)


# ------------------------------------------------------------------------------------------------ native
@pytest.fixture
def kwok_nodes(kube):
    """``add(name, cpu, tag)``: a kwok Node of ``cpu`` CPUs labelled and tainted ``GANG_LABEL=tag``, so that only
    the pods of this test (which select and tolerate it) land there; deleted afterwards."""
    added: list[str] = []

    def add(name: str, cpu: int, tag: str) -> None:
        resources = {"cpu": str(cpu), "memory": "64Gi", "pods": "110"}
        kube.core().create_node({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                         "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                    "kubernetes.io/arch": "amd64", "type": "kwok-gang", GANG_LABEL: tag}},
            "spec": {"taints": [{"key": GANG_LABEL, "value": tag, "effect": "NoSchedule"}]},
            "status": {"allocatable": resources, "capacity": resources},
        })
        added.append(name)

        def ready():
            node = kube.core().read_node(name)
            return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or ())

        kube.wait_for(ready, timeout=30, what=f"kwok node {name} Ready")

    yield add
    for name in added:
        kube.core().delete_node(name)


def pinned(tag: str, cpu: str) -> dict:
    """A template whose pod asks for ``cpu`` and runs only on the test's nodes."""
    return {"spec": {"containers": [container(resources={"requests": {"cpu": cpu}})],
                     "nodeSelector": {GANG_LABEL: tag},
                     "tolerations": [{"key": GANG_LABEL, "operator": "Equal", "value": tag, "effect": "NoSchedule"}]}}


def test_native_gang_that_does_not_fit_stays_pending_whole_then_starts_whole(kube, gang_operator, kwok_nodes):
    ns = gang_operator("native")
    tag = ns
    kwok_nodes(f"{ns}-a", 8, tag)  # room for two of the gang's four 3-CPU pods, and the 1-CPU evaluator
    manifest = job_manifest("gang", ps=1, workers=2, evaluator=1, templates={
        "Chief": pinned(tag, "3"), "PS": pinned(tag, "3"), "Worker": pinned(tag, "3"), "Evaluator": pinned(tag, "1")})
    job = create_job(kube, ns, manifest)
    gang_pods = ["gang-chief-0", "gang-ps-0", "gang-worker-0", "gang-worker-1"]
    pods = kube.wait_for(lambda: len(p := raw_pods(kube, ns, "gang")) == 5 and p, timeout=30, what="5 pods made")
    for name, pod in pods.items():
        if name == "gang-evaluator-0":
            assert "schedulingGroup" not in pod["spec"]
        else:
            assert pod["spec"]["schedulingGroup"] == {"podGroupName": "gang"}, name
    group = read_pod_group(kube, "native", ns, "gang")
    assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 4}}
    assert_owned_by(group, job)

    # The evaluator, outside the gang, is bound: the scheduler works and there is room for single pods.
    kube.wait_for(lambda: raw_pods(kube, ns, "gang")["gang-evaluator-0"]["spec"].get("nodeName"), timeout=60,
                  what="the evaluator (outside the gang) bound")

    def unschedulable():
        conditions = (read_pod_group(kube, "native", ns, "gang").get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "PodGroupScheduled" and c["status"] == "False"), None)

    cond = kube.wait_for(unschedulable, timeout=60, what="PodGroupScheduled=False on the PodGroup")
    assert cond["reason"] == "Unschedulable", cond
    deadline = time.monotonic() + 8  # and it stays so: without the gang two of them would have been bound by now
    while time.monotonic() < deadline:
        bound = [n for n in gang_pods if raw_pods(kube, ns, "gang")[n]["spec"].get("nodeName")]
        assert bound == [], f"gang pods bound although the gang does not fit: {bound}"
        time.sleep(1)
    assert get_job(kube, ns, "gang")["status"]["state"] != "Running"

    kwok_nodes(f"{ns}-b", 8, tag)  # now 15 free CPUs, two 3-CPU pods per node: the gang fits
    kube.wait_for(lambda: all(raw_pods(kube, ns, "gang")[n]["spec"].get("nodeName") for n in gang_pods),
                  timeout=120, what="the whole gang bound once the second node is there")
    wait_state(kube, ns, "gang", "Running", timeout=60)

    kube.terminate_pod(ns, "gang-chief-0", 0)
    wait_state(kube, ns, "gang", "Succeeded")
    kube.wait_for(lambda: read_pod_group(kube, "native", ns, "gang") is None, timeout=30,
                  what="the PodGroup deleted when the job succeeded")


def doc_example() -> dict:
    text = (REPO / "docs" / "scheduling.md").read_text()
    block = re.search(r"<!-- kubeps-doc-test: covered-by tests/operator/test_gang.py -->\n```yaml\n(.*?)```", text,
                      re.S)
    assert block, "docs/scheduling.md lost its example manifest"
    return yaml.safe_load(block.group(1))


def test_doc_example_gets_its_gang(kube, gang_operator):
    ns = gang_operator("native")
    manifest = doc_example()
    kube.apply(manifest, namespace=ns)
    name = manifest["metadata"]["name"]
    group = kube.wait_for(lambda: read_pod_group(kube, "native", ns, name), timeout=30, what="the doc's PodGroup")
    assert group["spec"]["schedulingPolicy"]["gang"]["minCount"] == manifest["spec"]["runPolicy"][
        "schedulingPolicy"]["minAvailable"]
    pods = kube.wait_for(lambda: len(p := raw_pods(kube, ns, name)) == 5 and p, timeout=30, what="the doc job's pods")
    assert sorted(n for n, p in pods.items() if p["spec"].get("schedulingGroup")) == [
        f"{name}-chief-0", f"{name}-ps-0", f"{name}-worker-0", f"{name}-worker-1"]


# ------------------------------------------------------------------------------------------------ Volcano, scheduler-plugins
@pytest.fixture(scope="module")
def gang_crds(kube):
    """Volcano's and scheduler-plugins' PodGroup CRDs on the control plane, and a PriorityClass for the pods."""
    proc = subprocess.run(["bash", str(REPO / "hack" / "gang-crds.sh"), "build"], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        _unavailable(f"hack/gang-crds.sh build could not fetch the PodGroup CRDs (needs Go and the Go module "
                     f"proxy):\n{proc.stderr[-2000:]}")
    directory = Path(subprocess.run(["bash", str(REPO / "hack" / "gang-crds.sh"), "dir"], capture_output=True,
                                    text=True, check=True).stdout.strip())
    for name, crd in (("volcano.yaml", "podgroups.scheduling.volcano.sh"),
                      ("scheduler-plugins.yaml", "podgroups.scheduling.x-k8s.io")):
        kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(directory / name))
        kube.kubectl("wait", "--for=condition=Established", "--timeout=30s", f"crd/{crd}")
    for backend in ("volcano", "scheduler-plugins"):
        group, version = API[backend]
        kube.wait_for(lambda: kube.custom().list_cluster_custom_object(group, version, "podgroups", limit=1),
                      timeout=30, what=f"{group} podgroups served")
    scheduling = kube.client("SchedulingV1Api")
    from kubernetes.client.exceptions import ApiException

    try:
        scheduling.create_priority_class({"metadata": {"name": PRIORITY_CLASS}, "value": 1000})
    except ApiException as err:
        if err.status != 409:
            raise
    yield directory
    scheduling.delete_priority_class(PRIORITY_CLASS)


@pytest.mark.parametrize("backend", ["volcano", "scheduler-plugins"])
def test_pod_group_is_accepted_by_the_backends_crd_owned_and_removed(kube, gang_operator, gang_crds, backend):
    ns = gang_operator(backend)
    requests = {"spec": {"containers": [container(resources={"requests": {"cpu": "500m", "memory": "1Gi"}})]}}
    policy = {"minAvailable": 3, "queue": "research", "priorityClass": PRIORITY_CLASS, "scheduleTimeoutSeconds": 60}
    manifest = job_manifest("pg", ps=1, workers=2, evaluator=1, run_policy={"schedulingPolicy": policy},
                            templates={"Chief": requests, "PS": requests, "Worker": requests})
    job = create_job(kube, ns, manifest)
    group = kube.wait_for(lambda: read_pod_group(kube, backend, ns, "pg"), timeout=30, what="the PodGroup")
    # Stored exactly as the operator wrote it: the CRD's schema pruned nothing and defaulted nothing.
    min_resources = {"cpu": "1500m", "memory": str(3 * 2**30)}  # chief, PS and one worker: the first 3 of the gang
    if backend == "volcano":
        expected = {"minMember": 3, "queue": "research", "priorityClassName": PRIORITY_CLASS,
                    "minResources": min_resources}
    else:
        expected = {"minMember": 3, "minResources": min_resources, "scheduleTimeoutSeconds": 60}
    assert group["spec"] == expected
    assert group["metadata"]["labels"] == {"kubeps.dev/job-name": "pg"}
    assert_owned_by(group, job)
    pods = kube.wait_for(lambda: len(p := raw_pods(kube, ns, "pg")) == 5 and p, timeout=30, what="5 pods made")
    for name, pod in pods.items():
        annotations = pod["metadata"].get("annotations") or {}
        labels = pod["metadata"]["labels"]
        if name == "pg-evaluator-0":
            assert "schedulerName" not in pod["spec"] or pod["spec"]["schedulerName"] == "default-scheduler"
            assert "scheduling.k8s.io/group-name" not in annotations
            assert "scheduling.x-k8s.io/pod-group" not in labels
        elif backend == "volcano":
            assert pod["spec"]["schedulerName"] == "volcano"
            assert annotations["scheduling.k8s.io/group-name"] == "pg"
            assert annotations["volcano.sh/task-spec"] == labels["kubeps.dev/replica-type"]
        else:
            assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
            assert labels["scheduling.x-k8s.io/pod-group"] == "pg"
            assert pod["spec"]["priorityClassName"] == PRIORITY_CLASS

    # Suspended: the PodGroup goes with the pods; resumed: a new one comes with them.
    patch_job(kube, ns, "pg", {"spec": {"runPolicy": {"suspend": True}}})
    wait_state(kube, ns, "pg", "Suspended")
    kube.wait_for(lambda: read_pod_group(kube, backend, ns, "pg") is None and not pods_of(kube, ns, "pg"),
                  timeout=30, what="PodGroup and pods deleted on suspend")
    patch_job(kube, ns, "pg", {"spec": {"runPolicy": {"suspend": False}}})
    again = kube.wait_for(lambda: read_pod_group(kube, backend, ns, "pg"), timeout=30, what="the PodGroup again")
    assert again["metadata"]["uid"] != group["metadata"]["uid"] and again["spec"] == expected

    # The job's end (here a deadline: no scheduler named so runs in the test, the pods stay Pending) removes it.
    patch_job(kube, ns, "pg", {"spec": {"runPolicy": {"activeDeadlineSeconds": 1}}})
    failed = wait_state(kube, ns, "pg", "Failed", timeout=30)
    assert condition(failed, "Failed")["reason"] == "DeadlineExceeded"
    kube.wait_for(lambda: read_pod_group(kube, backend, ns, "pg") is None, timeout=30,
                  what="the PodGroup deleted at the job's end")


def test_pod_group_held_by_another_owner_blocks_the_pods(kube, gang_operator):
    ns = gang_operator("native")
    group, version = API["native"]
    kube.custom().create_namespaced_custom_object(group, version, ns, "podgroups", {
        "apiVersion": f"{group}/{version}", "kind": "PodGroup", "metadata": {"name": "held"},
        "spec": {"schedulingPolicy": {"gang": {"minCount": 1}}}})
    create_job(kube, ns, job_manifest("held", ps=1, workers=1))

    def warned():
        events = kube.core().list_namespaced_event(ns, field_selector="involvedObject.name=held").items
        return any(e.reason == "PodGroupConflict" for e in events)

    kube.wait_for(warned, timeout=30, what="a PodGroupConflict Warning")
    assert pods_of(kube, ns, "held") == {}
    kube.custom().delete_namespaced_custom_object(group, version, ns, "podgroups", "held")
    kube.wait_for(lambda: len(pods_of(kube, ns, "held")) == 3, timeout=30,
                  what="the pods made once the foreign PodGroup is gone and the job's own is made")
    assert (read_pod_group(kube, "native", ns, "held") or {}).get("metadata", {}).get("ownerReferences")
