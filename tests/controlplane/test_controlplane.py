"""The test cluster is a real one: API server, controller-manager, scheduler and kwok nodes.

Each test exercises a piece a fake API server could not provide: garbage collection,
scheduling against node capacity, CRD schema and CEL validation, helm, and the exit-code
hook the operator's tests rely on.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

TINYCHART = Path(__file__).parent / "testdata" / "tinychart"


def pod_manifest(name: str, *, requests: dict | None = None, limits: dict | None = None,
                 restart_policy: str = "Never", annotations: dict | None = None,
                 owner: dict | None = None) -> dict:
    meta: dict = {"name": name, "annotations": annotations or {}}
    if owner:
        meta["ownerReferences"] = [owner]
    resources = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            # kwok's fake nodes (on kind too, once kwok is attached: docs/testing.md)
            "nodeSelector": {"type": "kwok"},
            "restartPolicy": restart_policy,
            "containers": [{"name": "main", "image": "registry.invalid/kubeps/noop:0",
                            "resources": resources}],
        },
    }


def test_garbage_collector_deletes_dependents_of_a_deleted_owner(kube, namespace):
    core = kube.core()
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    core.create_namespaced_pod(namespace, pod_manifest("dependent", owner={
        "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}))

    core.delete_namespaced_config_map("owner", namespace)

    kube.wait_for_deleted(lambda: core.read_namespaced_pod("dependent", namespace), timeout=60,
                          what="pod owned by the deleted ConfigMap (garbage collector)")


def test_pod_is_scheduled_to_a_kwok_node_and_runs(kube, namespace):
    core = kube.core()
    core.create_namespaced_pod(namespace, pod_manifest(
        "runs", requests={"cpu": "500m", "memory": "1Gi"}, limits={"nvidia.com/gpu": "1"}))

    pod = kube.wait_for_pod_ready(namespace, "runs", timeout=30)

    assert pod.spec.node_name, "scheduler did not bind the pod"
    node = core.read_node(pod.spec.node_name)
    if kube.local:
        assert node.metadata.annotations.get("kwok.x-k8s.io/node") == "fake"
    assert pod.status.container_statuses[0].state.running is not None
    assert pod.status.pod_ip


def test_pod_asking_for_more_gpus_than_any_node_stays_pending(kube, namespace):
    core = kube.core()
    core.create_namespaced_pod(namespace, pod_manifest("greedy", limits={"nvidia.com/gpu": "64"}))

    def unschedulable(pod):
        return any(c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
                   for c in pod.status.conditions or ())

    pod = kube.wait_for_pod(namespace, "greedy", unschedulable, timeout=30,
                            what="PodScheduled=False/Unschedulable")
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None
    cond = next(c for c in pod.status.conditions if c.type == "PodScheduled")
    assert "Insufficient nvidia.com/gpu" in cond.message

    events = kube.wait_for(
        lambda: [e for e in core.list_namespaced_event(namespace).items
                 if e.reason == "FailedScheduling" and e.involved_object.name == "greedy"],
        timeout=30, what="a FailedScheduling event")
    assert "Insufficient nvidia.com/gpu" in events[0].message


def test_crd_schema_and_cel_rule_reject_bad_objects_with_the_api_servers_message(kube, namespace):
    from kubernetes.client.exceptions import ApiException

    group = f"t{uuid.uuid4().hex[:8]}.kubeps.dev"
    plural = "gizmos"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": "gizmo", "kind": "Gizmo"},
            "versions": [{
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {"spec": {
                        "type": "object",
                        "required": ["replicas"],
                        "properties": {
                            "replicas": {"type": "integer", "minimum": 0},
                            "minReplicas": {"type": "integer", "minimum": 0},
                        },
                        "x-kubernetes-validations": [{
                            "rule": "!has(self.minReplicas) || self.minReplicas <= self.replicas",
                            "message": "minReplicas must not exceed replicas",
                        }],
                    }},
                }},
            }],
        },
    }
    ext = kube.apiextensions()
    ext.create_custom_resource_definition(crd)
    try:
        kube.wait_for(
            lambda: any(c.type == "Established" and c.status == "True"
                        for c in ext.read_custom_resource_definition(crd["metadata"]["name"])
                        .status.conditions or ()),
            timeout=30, what="CRD Established")
        custom = kube.custom()

        def create(name, spec):
            body = {"apiVersion": f"{group}/v1", "kind": "Gizmo", "metadata": {"name": name},
                    "spec": spec}
            return kube.wait_for(  # the new resource may take a moment to be served
                lambda: _create_or_api_error(custom, group, namespace, plural, body),
                timeout=30, what=f"create {name}")

        good = create("good", {"replicas": 3, "minReplicas": 1})
        assert not isinstance(good, ApiException), good.body

        bad_cel = create("bad-cel", {"replicas": 1, "minReplicas": 2})
        assert isinstance(bad_cel, ApiException) and bad_cel.status == 422
        assert "minReplicas must not exceed replicas" in bad_cel.body

        bad_schema = create("bad-schema", {"replicas": -1})
        assert isinstance(bad_schema, ApiException) and bad_schema.status == 422
        assert "spec.replicas" in bad_schema.body and "greater than or equal to 0" in bad_schema.body
    finally:
        ext.delete_custom_resource_definition(crd["metadata"]["name"])


def _create_or_api_error(custom, group, namespace, plural, body):
    """The created object, or the 422 ApiException; None (retry) while the type is not served."""
    from kubernetes.client.exceptions import ApiException

    try:
        return custom.create_namespaced_custom_object(group, "v1", namespace, plural, body)
    except ApiException as exc:
        if exc.status == 404:
            return None
        return exc


def test_helm_install_and_uninstall_a_chart(kube, namespace):
    wait = ["--wait", "--timeout", "60s"] if kube.local else []  # kwok makes the pods Ready
    kube.helm("install", "tiny", str(TINYCHART), "--namespace", namespace,
              "--set", "greeting=hi-from-helm", *wait)

    core = kube.core()
    cm = core.read_namespaced_config_map("tiny-settings", namespace)
    assert cm.data == {"greeting": "hi-from-helm"}
    deployment = kube.apps().read_namespaced_deployment("tiny-app", namespace)
    if kube.local:
        assert deployment.status.ready_replicas == 1
    listed = kube.helm("list", "--namespace", namespace, "--short").stdout.split()
    assert listed == ["tiny"]

    kube.helm("uninstall", "tiny", "--namespace", namespace, "--wait", "--timeout", "60s")

    kube.wait_for_deleted(lambda: core.read_namespaced_config_map("tiny-settings", namespace),
                          timeout=30, what="the chart's ConfigMap")
    assert kube.helm("list", "--namespace", namespace, "--short").stdout.split() == []


@pytest.mark.parametrize(("exit_code", "phase"), [(3, "Failed"), (0, "Succeeded")])
def test_terminate_pod_sets_exit_code_and_phase(kube, namespace, exit_code, phase):
    core = kube.core()
    core.create_namespaced_pod(namespace, pod_manifest("worker"))
    kube.wait_for_pod_ready(namespace, "worker")

    kube.terminate_pod(namespace, "worker", exit_code)

    pod = kube.wait_for_pod_phase(namespace, "worker", phase, timeout=15)
    terminated = pod.status.container_statuses[0].state.terminated
    assert terminated.exit_code == exit_code
    assert terminated.reason == ("Completed" if exit_code == 0 else "Error")
    ready = next(c for c in pod.status.conditions if c.type == "Ready")
    assert ready.status == "False"


def test_exit_code_annotation_at_creation_fails_the_pod_after_the_delay(kube, namespace):
    core = kube.core()
    core.create_namespaced_pod(namespace, pod_manifest("crashes", annotations={
        kube.FAKE_EXIT_CODE_ANNOTATION: "137", kube.FAKE_EXIT_DELAY_ANNOTATION: "1s"}))

    pod = kube.wait_for_pod_phase(namespace, "crashes", "Failed", timeout=20)

    assert kube.container_exit_code(pod) == 137
    assert pod.status.start_time is not None  # it ran before it failed


def test_exit_code_with_restart_policy_always_restarts_the_container(kube, namespace):
    core = kube.core()
    core.create_namespaced_pod(namespace, pod_manifest("restarts", restart_policy="Always"))
    kube.wait_for_pod_ready(namespace, "restarts")

    pod = kube.terminate_pod(namespace, "restarts", 1)

    status = pod.status.container_statuses[0]
    assert pod.status.phase == "Running"
    assert status.restart_count == 1
    assert status.last_state.terminated.exit_code == 1
    assert status.state.running is not None
