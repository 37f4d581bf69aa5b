"""Elastic workers on the real control plane: the CRD's ``scale`` subresource (``kubectl scale psjob``), an HPA that
drives it, and the membership ConfigMap the operator keeps on the Worker replicas for the chief to watch.

There is no metrics server on the test control plane, so the HPA cannot evaluate a metric: it is given a
``minReplicas`` above the job's Worker replicas, which kube-controller-manager's HPA controller enforces through the
scale subresource before it looks at any metric (its status then says the metrics are missing)."""

from __future__ import annotations

import json

from kubeps.runtime.cluster import Membership

from .conftest import GROUP, PLURAL, VERSION, create_job, get_job, job_manifest, pods_of, wait_state


def _membership(kube, ns: str, name: str) -> Membership | None:
    from kubernetes.client.exceptions import ApiException

    try:
        config_map = kube.core().read_namespaced_config_map(f"{name}-kubeps-membership", ns)
    except ApiException as err:
        if err.status == 404:
            return None
        raise
    return Membership.parse(config_map.data["membership.json"])


def _workers(kube, ns: str, name: str) -> list[str]:
    return sorted(n for n in pods_of(kube, ns, name) if "-worker-" in n)


def test_kubectl_scale_and_an_hpa_drive_the_workers_and_the_membership(kube, ns):
    create_job(kube, ns, job_manifest("el", ps=1, workers=2))
    wait_state(kube, ns, "el", "Running")
    first = kube.wait_for(lambda: _membership(kube, ns, "el"), timeout=20, what="the membership ConfigMap")
    assert first.generation == 1 and first.workers == [f"el-worker-{i}.{ns}.svc:2222" for i in range(2)]
    chief_uid = pods_of(kube, ns, "el")["el-chief-0"].metadata.uid

    kube.kubectl("scale", f"{PLURAL}.{GROUP}/el", "--replicas", "4", "-n", ns)
    kube.wait_for(lambda: get_job(kube, ns, "el")["status"]["workers"] == "4/4", timeout=30, what="4 workers")
    scale = json.loads(kube.kubectl("get", "--raw", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/el/scale")
                       .stdout)
    assert scale["spec"]["replicas"] == 4 and scale["status"]["replicas"] == 4
    assert scale["status"]["selector"] == "kubeps.dev/job-name=el,kubeps.dev/replica-type=worker"
    second = kube.wait_for(lambda: (m := _membership(kube, ns, "el")) and m.generation == 2 and m, timeout=20,
                           what="membership generation 2")
    assert len(second.workers) == 4
    # the running chief is annotated with it: its kubelet refreshes the mounted ConfigMap at once
    kube.wait_for(lambda: (pods_of(kube, ns, "el")["el-chief-0"].metadata.annotations or {}).get(
        "kubeps.dev/membership-generation") == "2", timeout=20, what="the chief annotated with generation 2")

    kube.kubectl("scale", f"{PLURAL}.{GROUP}/el", "--replicas", "1", "-n", ns)
    kube.wait_for(lambda: _workers(kube, ns, "el") == ["el-worker-0"], timeout=30, what="workers 1..3 gone")
    third = kube.wait_for(lambda: (m := _membership(kube, ns, "el")) and m.generation == 3 and m, timeout=20,
                          what="membership generation 3")
    assert third.workers == first.workers[:1]

    kube.apply({
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "el"},
        "spec": {"scaleTargetRef": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PSTrainingJob", "name": "el"},
                 "minReplicas": 3, "maxReplicas": 5,
                 "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                                                               "target": {"type": "Utilization",
                                                                          "averageUtilization": 80}}}]},
    }, namespace=ns)
    kube.wait_for(lambda: get_job(kube, ns, "el")["spec"]["replicaSpecs"]["Worker"]["replicas"] == 3, timeout=90,
                  interval=1, what="the HPA raising the Worker replicas to its minReplicas")
    kube.wait_for(lambda: _workers(kube, ns, "el") == [f"el-worker-{i}" for i in range(3)], timeout=30,
                  what="3 worker pods")
    fourth = kube.wait_for(lambda: (m := _membership(kube, ns, "el")) and len(m.workers) == 3 and m, timeout=20,
                           what="a membership of 3 workers")
    assert fourth.generation == 4
    hpa = kube.client("AutoscalingV2Api").read_namespaced_horizontal_pod_autoscaler("el", ns)
    assert hpa.status.desired_replicas == 3
    assert pods_of(kube, ns, "el")["el-chief-0"].metadata.uid == chief_uid  # the chief was never restarted
    events = kube.core().list_namespaced_event(ns, field_selector="involvedObject.name=el").items
    assert {"Workers 2 -> 4", "Workers 4 -> 1", "Workers 1 -> 3"} <= {
        e.message.split(":")[0] for e in events if e.reason == "WorkersChanged"}
