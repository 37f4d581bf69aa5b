"""GPU workers under the operator: a replica whose container asks for ``nvidia.com/gpu`` gets ``KUBEPS_DEVICE=gpu``
(never a silent CPU run; the chief and the ps, asking for none, get nothing), and the scheduler places such pods on
nodes with GPU capacity -- a kwok node advertising 2 fake ``nvidia.com/gpu`` takes two one-GPU workers and leaves
the third Pending for want of a GPU."""

from __future__ import annotations

import uuid

from kubeps.operator.core import children

from .conftest import create_job, job_manifest, pods_of
from .test_security import api_job, main_of, pods_planned

GPU = children.GPU_RESOURCE


def _env(pod: dict) -> dict:
    return {e["name"]: e.get("value") for e in main_of(pod).get("env") or []}


def gpu_template(extra_spec: dict | None = None, env: list | None = None, count: str = "1") -> dict:
    container = {"name": "kubeps", "image": "registry.test/app:1", "resources": {"limits": {GPU: count}}}
    if env is not None:
        container["env"] = env
    return {"spec": {"containers": [container], **(extra_spec or {})}}


# ------------------------------------------------------------------------------------------------ planner
def test_gpu_workers_get_kubeps_device_gpu_and_the_others_nothing():
    _, pods = pods_planned(api_job(templates={"Worker": gpu_template()}))
    for name, pod in pods.items():
        want = "gpu" if "-worker-" in name else None
        assert _env(pod).get("KUBEPS_DEVICE") == want, name
        if want:
            assert main_of(pod)["resources"]["limits"][GPU] == "1"  # the template's request is kept


def test_a_template_that_sets_kubeps_device_keeps_it_and_zero_gpus_is_none():
    _, pods = pods_planned(api_job(templates={"Worker": gpu_template(env=[{"name": "KUBEPS_DEVICE", "value": "cpu"}])}))
    assert {_env(p)["KUBEPS_DEVICE"] for n, p in pods.items() if "-worker-" in n} == {"cpu"}
    _, pods = pods_planned(api_job(templates={"Worker": gpu_template(count="0")}))
    assert not any("KUBEPS_DEVICE" in _env(p) for p in pods.values())
    requests_only = {"name": "kubeps", "resources": {"requests": {GPU: 2}}}
    assert children.gpu_device(requests_only) == "gpu"


# ------------------------------------------------------------------------------------------------ control plane
def test_gpu_workers_are_scheduled_on_gpu_capacity_only(kube, ns):
    node = f"kop-gpu-{uuid.uuid4().hex[:6]}"
    taint = {"key": GPU, "value": "present", "effect": "NoSchedule"}  # as GPU node pools usually are tainted
    capacity = {"cpu": "16", "memory": "64Gi", "pods": "110", GPU: "2"}
    kube.core().create_node({
        "metadata": {"name": node, "annotations": {"kwok.x-k8s.io/node": "fake"},
                     "labels": {"kubernetes.io/hostname": node, "type": "kwok-gpu"}},
        "spec": {"taints": [taint]},
        "status": {"allocatable": capacity, "capacity": capacity}})
    try:
        kube.wait_for(lambda: any(c.type == "Ready" and c.status == "True"
                                  for c in kube.core().read_node(node).status.conditions or []),
                      timeout=30, what=f"node {node} Ready (kwok)")
        worker = gpu_template({"nodeSelector": {"type": "kwok-gpu"},
                               "tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]})
        create_job(kube, ns, job_manifest("gpus", ps=1, workers=3, templates={"Worker": worker}))

        def placed():
            pods = pods_of(kube, ns, "gpus")
            workers = {n: p for n, p in pods.items() if "-worker-" in n}
            on_node = [n for n, p in workers.items() if p.spec.node_name == node]
            pending = [n for n, p in workers.items() if not p.spec.node_name and any(
                c.type == "PodScheduled" and c.status == "False" and GPU in (c.message or "")
                for c in (p.status.conditions or []))]
            return (pods, on_node, pending) if len(on_node) == 2 and len(pending) == 1 else None

        pods, on_node, pending = kube.wait_for(placed, timeout=60, what="two GPU workers placed, one pending")
        for name, pod in pods.items():
            env = {e.name: e.value for e in pod.spec.containers[0].env or []}
            assert env.get("KUBEPS_DEVICE") == ("gpu" if "-worker-" in name else None), name
            if "-worker-" not in name:
                assert pod.spec.node_name != node, name  # the chief and the ps take no GPU node
    finally:
        kube.core().delete_node(node)
