"""The operator against the real control plane when a node is lost, and the job's PodDisruptionBudget.

A node of the test's own (kwok plays its kubelet while it carries kwok's annotation) runs a job's pods; the test
takes the annotation away (kwok stops answering for it, as a powered-off node's kubelet does) and marks it
``Ready=Unknown`` as the node lifecycle controller would after its grace period: the operator force-deletes the
pods there and makes them again. The budget test uses the real Eviction API (what ``kubectl drain`` calls).
"""

from __future__ import annotations

import uuid

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from .conftest import condition, create_job, get_job, job_manifest, pods_of, wait_state


def own_node(kube) -> str:
    name = f"kop-node-{uuid.uuid4().hex[:6]}"
    kube.core().create_node({
        "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                     "labels": {"kubernetes.io/hostname": name, "type": "kwok-test"}},
        "status": {"allocatable": {"cpu": "16", "memory": "64Gi", "pods": "110"},
                   "capacity": {"cpu": "16", "memory": "64Gi", "pods": "110"}}})
    kube.wait_for(lambda: any(c.type == "Ready" and c.status == "True"
                              for c in kube.core().read_node(name).status.conditions or []),
                  timeout=30, what=f"node {name} Ready (kwok)")
    return name


def test_pods_on_a_lost_node_are_replaced_and_the_ps_restarts_the_chief(kube, ns):
    node = own_node(kube)
    try:
        pinned = {"spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                           "containers": [{"name": "kubeps", "image": "registry.test/app:1"}]}}
        elsewhere = {"spec": {"nodeSelector": {"type": "kwok"},  # the session's kwok nodes, not this one
                              "containers": [{"name": "kubeps", "image": "registry.test/app:1"}]}}
        create_job(kube, ns, job_manifest("lost", ps=1, workers=1,
                                          templates={"PS": pinned, "Worker": pinned, "Chief": elsewhere}))
        wait_state(kube, ns, "lost", "Running")
        before = {n: p.metadata.uid for n, p in pods_of(kube, ns, "lost").items()}
        placed = {n: p.spec.node_name for n, p in pods_of(kube, ns, "lost").items()}
        assert placed["lost-ps-0"] == placed["lost-worker-0"] == node != placed["lost-chief-0"], placed

        # The node stops answering: no kubelet (kwok lets it go), and the node controller's verdict written as it
        # would after node-monitor-grace-period.
        core = kube.core()
        core.patch_node(node, {"metadata": {"annotations": {"kwok.x-k8s.io/node": None}}})
        status = core.read_node(node).status
        for c in status.conditions:
            if c.type == "Ready":
                c.status, c.reason = "Unknown", "NodeStatusUnknown"
        core.patch_node_status(node, {"status": {"conditions": [
            {"type": c.type, "status": c.status, "reason": c.reason, "message": c.message or "",
             "lastHeartbeatTime": c.last_heartbeat_time, "lastTransitionTime": c.last_transition_time}
            for c in status.conditions]}})

        def replaced():
            now = {n: p.metadata.uid for n, p in pods_of(kube, ns, "lost").items()}
            return now if all(now.get(n) not in (None, before[n]) for n in ("lost-ps-0", "lost-worker-0",
                                                                            "lost-chief-0")) else None
        kube.wait_for(replaced, timeout=30, what="the ps, the worker and (for the ps) the chief made again")
        job = get_job(kube, ns, "lost")
        assert job["status"]["backoffCount"] == 1
        assert "ps 0 (pod lost-ps-0) was deleted" in condition(job, "Restarting")["message"]
        events = core.list_namespaced_event(ns, field_selector="reason=NodeLost").items
        assert {e.message.split()[1] for e in events} == {"lost-ps-0", "lost-worker-0"}, [e.message for e in events]
        assert all(node in e.message and "Ready=Unknown" in e.message for e in events)
        # The replacements are kept off the lost node (their template pins them there: they wait, unscheduled).
        ps = core.read_namespaced_pod("lost-ps-0", ns)
        terms = ps.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
        assert [(f.key, f.operator, f.values) for f in terms[0].match_fields] == [("metadata.name", "NotIn", [node])]
        assert ps.spec.node_name is None
        # The old pods are gone, not Terminating on the dead node.
        left = core.list_namespaced_pod(ns, label_selector="kubeps.dev/job-name=lost").items
        assert not [p.metadata.name for p in left if p.metadata.uid in before.values()]
    finally:
        kube.core().delete_node(node)


def test_disruption_budget_refuses_evicting_chief_and_ps_until_the_job_ends(kube, ns):
    create_job(kube, ns, job_manifest("guarded", ps=1, workers=1,
                                      run_policy={"podDisruptionBudget": "ChiefAndPS"}))
    wait_state(kube, ns, "guarded", "Running")
    pdbs = k8s.PolicyV1Api(kube.api_client)
    pdb = kube.wait_for(lambda: pdbs.read_namespaced_pod_disruption_budget("guarded-chief-ps", ns), timeout=20,
                        what="the job's PodDisruptionBudget")
    assert pdb.spec.min_available == 2
    assert pdb.metadata.owner_references[0].name == "guarded"
    kube.wait_for(lambda: pdbs.read_namespaced_pod_disruption_budget("guarded-chief-ps", ns).status.current_healthy == 2,
                  timeout=20, what="the budget to count the chief and the ps")

    def evict(pod: str) -> int:
        body = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name=pod, namespace=ns))
        try:
            kube.core().create_namespaced_pod_eviction(pod, ns, body)
        except ApiException as err:
            return err.status
        return 201

    assert evict("guarded-ps-0") == 429
    assert evict("guarded-chief-0") == 429
    assert evict("guarded-worker-0") == 201  # workers are not covered: replaced at no cost to the job
    kube.terminate_pod(ns, "guarded-chief-0", 0)
    wait_state(kube, ns, "guarded", "Succeeded")

    def budget_gone():
        try:
            pdbs.read_namespaced_pod_disruption_budget("guarded-chief-ps", ns)
        except ApiException as err:
            return err.status == 404
        return False
    kube.wait_for(budget_gone, timeout=20, what="the budget deleted once the job finished")
