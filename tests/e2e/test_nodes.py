"""PSTrainingJobs over several nodes (hack/kind.sh: a control-plane node and KUBEPS_KIND_WORKERS=2 workers, pod
traffic routed between them): spread over the nodes, a node drained (with and without the job's
PodDisruptionBudget), and a node lost mid-training. docs/nodes.md describes what they show and their figures.

The checkpoints go to ``/kubeps-shared``, one host folder that hack/kind.sh mounts into every node: the stand-in
of a ReadWriteMany volume (NFS, a CSI file share, object storage), which a job whose parameter servers may move
between nodes needs. kind's local-path volumes are bound to one node.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from .conftest import KIND_SH, NAMESPACE, Kind, record, wait
from .test_kind import chief_log, ctr_job, learned, pod_uid, running

WORKERS = int(os.environ.get("KUBEPS_KIND_WORKERS", "2"))
pytestmark = pytest.mark.skipif(WORKERS < 2, reason="needs a kind cluster with 2 or more workers")

SHARED = "/kubeps-shared"


@pytest.fixture(autouse=True)
def _settled(kind: Kind) -> None:
    """No image load of an earlier test still under way: these tests stop and drain nodes."""
    kind.settle()


def spread_job(name: str, ns: str, *, steps: int, every: int) -> dict:
    """The CTR job with checkpoints on the shared folder and its parameter servers and its workers each spread
    over the nodes: a topologySpreadConstraint per role, as users write it (docs/nodes.md)."""
    job = ctr_job(name, steps=steps)
    specs = job["spec"]["replicaSpecs"]
    chief = specs["Chief"]["template"]["spec"]["containers"][0]
    chief["command"] += ["--checkpoint-every", str(every)]
    job["spec"]["runPolicy"]["backoffLimit"] = 10
    job["spec"]["runPolicy"]["activeDeadlineSeconds"] = 1200
    for rt, role in (("Chief", "chief"), ("PS", "ps"), ("Worker", "worker")):
        pod = specs[rt]["template"]["spec"]
        c = pod["containers"][0]
        c["env"] = [{"name": "KUBEPS_CHECKPOINT_DIR", "value": f"/ckpt/{ns}-{name}"}]
        c["volumeMounts"] = [{"name": "ckpt", "mountPath": "/ckpt"}]
        pod["volumes"] = [{"name": "ckpt", "hostPath": {"path": SHARED, "type": "Directory"}}]
        if role != "chief":
            pod["topologySpreadConstraints"] = [{
                "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
                # a cordoned or lost node (tainted) does not count, so replacements still fit on the others
                "nodeTaintsPolicy": "Honor",
                "labelSelector": {"matchLabels": {"kubeps.dev/job-name": name, "kubeps.dev/job-role": role}}}]
    return job


def nodes_of(kind: Kind, ns: str, job: str) -> dict[str, str]:
    """pod name -> node, for the job's live pods."""
    return {p["metadata"]["name"]: p["spec"].get("nodeName", "") for p in kind.pods(ns, job)
            if not p["metadata"].get("deletionTimestamp")}


def start_spread(kind: Kind, ns: str, job: dict) -> dict[str, str]:
    name = job["metadata"]["name"]
    start = time.monotonic()
    kind.apply(ns, job)
    wait(lambda: running(kind, ns, name, 5), 180, "5 pods Running", interval=0.5)
    record("job create -> all pods Running (spread)", time.monotonic() - start, pods=5)
    where = nodes_of(kind, ns, name)
    print("placement:", where)
    assert where[f"{name}-ps-0"] != where[f"{name}-ps-1"], where
    assert where[f"{name}-worker-0"] != where[f"{name}-worker-1"], where
    wait(lambda: re.search(r"saved \S+", chief_log(kind, ns, name)), 240, "a checkpoint saved")
    return where


def test_job_spreads_over_nodes_and_trains_across_them(kind: Kind, ns: str):
    """ps-0 and ps-1 on different nodes, and so are the workers: every worker reads and updates variables on both
    parameter servers (the embedding tables are sharded over them), so training crosses nodes."""
    job = spread_job("spread", ns, steps=600, every=200)
    where = start_spread(kind, ns, job)
    assert len(set(where.values())) >= 2, where
    assert kind.wait_finished(ns, "spread") == "Succeeded"
    learned(chief_log(kind, ns, "spread"))


def test_drain_waits_for_the_budget_then_moves_the_pods(kind: Kind, ns: str):
    """runPolicy.podDisruptionBudget ChiefAndPS: a drain evicts the workers of the node but not its chief or ps
    (the budget refuses); without the budget the drain moves them all, and the job resumes and finishes."""
    job = spread_job("drained", ns, steps=8000, every=500)  # still training after the refused drain's 12 s
    job["spec"]["runPolicy"]["podDisruptionBudget"] = "ChiefAndPS"
    where = start_spread(kind, ns, job)
    pdb = kind.json("-n", ns, "get", "pdb", "drained-chief-ps")
    assert pdb["spec"]["minAvailable"] == 3, pdb
    wait(lambda: kind.json("-n", ns, "get", "pdb", "drained-chief-ps").get("status", {}).get("currentHealthy") == 3,
         30, "the budget to count the chief and 2 ps")
    node = where["drained-ps-0"]
    protected = {p for p, n in where.items() if n == node and ("-ps-" in p or "-chief-" in p)}
    uids = {p: pod_uid(kind, ns, p) for p in protected}
    try:
        start = time.monotonic()
        proc = subprocess.run(["kubectl", "drain", node, "--ignore-daemonsets", "--delete-emptydir-data",
                               "--timeout=12s"], env=kind.env, capture_output=True, text=True, timeout=90)
        print(proc.stdout[-1500:], proc.stderr[-1500:])
        assert proc.returncode != 0, "the drain went through the PodDisruptionBudget"
        assert "disruption budget" in (proc.stdout + proc.stderr), proc.stderr[-1500:]
        for pod, uid in uids.items():
            assert pod_uid(kind, ns, pod) == uid, f"{pod} was evicted through the budget"
        record("drain refused by the budget", time.monotonic() - start, protected=sorted(protected))

        # The budget goes with the spec field (and at the end of the job): the drain now moves everything.
        kind.kubectl("-n", ns, "patch", "psjob", "drained", "--type=merge",
                     "-p", '{"spec": {"runPolicy": {"podDisruptionBudget": "None"}}}')
        wait(lambda: not kind.kubectl("-n", ns, "get", "pdb", "-o", "name").strip(), 30, "the budget deleted")
        start = time.monotonic()
        kind.kubectl("drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=120s", timeout=150)
        record("drain with no budget (evictions done)", time.monotonic() - start)

        def moved() -> bool:
            now = nodes_of(kind, ns, "drained")
            return len(now) == 5 and node not in now.values() and bool(running(kind, ns, "drained", 5))
        wait(moved, 180, "every pod Running off the drained node", interval=0.5)
        record("drain -> all pods Running elsewhere", time.monotonic() - start)
        assert kind.wait_finished(ns, "drained") == "Succeeded"
        log = chief_log(kind, ns, "drained")
        m = re.search(r"resumed from step (\d+)", log)
        assert m and int(m.group(1)) > 0, f"the chief did not resume from a checkpoint:\n{log[-2000:]}"
        learned(log)
    finally:
        kind.kubectl("uncordon", node, check=False)


def test_node_lost_mid_training(kind: Kind, ns: str):
    """The node container of a parameter server stopped (`docker stop`): the operator sees its Lease go stale,
    force-deletes the pods there, the chief restarts from the checkpoint and the job succeeds. Timed: node stop ->
    pods replaced -> training resumed (the restarted chief's `resumed from step N`)."""
    # Short: the chief cannot train on without the lost ps, so the job still runs when the node is found lost.
    job = spread_job("node-lost", ns, steps=3000, every=500)
    where = start_spread(kind, ns, job)
    chief_node = where["node-lost-chief-0"]
    victim = next(where[p] for p in ("node-lost-ps-0", "node-lost-ps-1") if where[p] != chief_node)
    operator_nodes = {p["spec"].get("nodeName") for p in kind.json("-n", NAMESPACE, "get", "pods")["items"]}
    assert victim not in operator_nodes, "the operator runs on the node to be stopped (see _on_the_control_plane)"
    lost = sorted(p for p, n in where.items() if n == victim)
    old = {p: pod_uid(kind, ns, p) for p in lost}
    print(f"stopping node {victim} (pods {lost}); the chief runs on {chief_node}")
    try:
        start = time.monotonic()
        subprocess.run(["docker", "stop", "-t", "1", victim], check=True, capture_output=True, timeout=60)
        stopped = time.monotonic()
        record("docker stop of the node", stopped - start)

        def replaced() -> bool:
            pods = {p["metadata"]["name"]: p for p in kind.pods(ns, "node-lost")}
            return all(p in pods and pods[p]["metadata"]["uid"] != old[p] and pods[p]["status"].get("phase") == "Running"
                       and pods[p]["spec"].get("nodeName") not in (None, "", victim) for p in lost)
        wait(replaced, 240, f"{lost} replaced and Running on another node", interval=0.5)
        record("node stop -> lost pods Running on another node", time.monotonic() - stopped, pods=lost)

        def resumed() -> bool:
            """A chief resumed from the checkpoint and trained on: a step logged after its `resumed from step N`
            (a chief that resumed and then lost a ps it had resolved to the old address, and exited 133, is not)."""
            m = re.search(r"resumed from step (\d+)(.*)", chief_log(kind, ns, "node-lost"), re.S)
            return bool(m and any(int(n) > int(m.group(1)) for n in re.findall(r"^step\s+(\d+)/", m.group(2), re.M)))
        wait(resumed, 240, "the chief resumed from a checkpoint and trained on", interval=0.5)
        took = time.monotonic() - stopped
        record("node stop -> training resumed", took)
        events = kind.json("-n", ns, "get", "events", "--field-selector", "reason=NodeLost")["items"]
        assert events and victim in events[0]["message"], events
        print("NodeLost:", events[0]["message"])
        assert kind.wait_finished(ns, "node-lost") == "Succeeded"
        log = chief_log(kind, ns, "node-lost")
        m = re.search(r"resumed from step (\d+)", log)
        assert m and int(m.group(1)) > 0, log[-2000:]
        learned(log)
        assert took <= 60, f"training resumed {took:.0f} s after the node stopped (goal: 60 s)"
    finally:
        # Back for what runs after (a kept cluster too): the node restarts, its kubelet comes back by itself (not
        # waited for), and the routes are set again (its address may have changed).
        subprocess.run(["docker", "start", victim], capture_output=True, timeout=60)
        subprocess.run([str(KIND_SH), "network"], env=kind.env, timeout=60)
