"""An operator killed (SIGKILL) at random moments converges: no duplicate, orphaned or lost pods, and a PS
restart that happened while it was dying is counted exactly once."""

from __future__ import annotations

import random
import time

from .conftest import (
    OperatorProcess,
    create_job,
    delete_namespace,
    get_job,
    job_manifest,
    make_namespace,
    patch_job,
    pods_of,
    services_of,
)

JOBS = ("ra", "rb", "rc")


def expected_names(job: str, ps: int, workers: int) -> set[str]:
    return {f"{job}-chief-0"} | {f"{job}-ps-{i}" for i in range(ps)} | {f"{job}-worker-{i}" for i in range(workers)}


def chaos(proc: OperatorProcess, rng: random.Random, rounds: int, kube, ns: str) -> list[int]:
    """Start the operator and SIGKILL it after a random delay, ``rounds`` times; returns the pod count after
    each kill (a count strictly between 0 and the total shows a kill landed mid-reconcile)."""
    counts = []
    for _ in range(rounds):
        proc.start(wait=False)
        time.sleep(rng.uniform(1.2, 2.6))  # start-up takes ~1 s: the kill lands before, during or after work
        proc.kill()
        counts.append(len(kube.core().list_namespaced_pod(ns).items))
    print("pods after each kill:", counts)
    return counts


def test_operator_killed_mid_reconcile_converges(crd, kube, tmp_path):
    rng = random.Random(4)
    ns = make_namespace(kube, prefix="krs-")
    proc = OperatorProcess(kube, [ns], tmp_path / "operator.log")
    try:
        for job in JOBS:
            create_job(kube, ns, job_manifest(job, ps=2, workers=4))
        chaos(proc, rng, 4, kube, ns)
        proc.start()

        def all_running():
            states = {j: (get_job(kube, ns, j).get("status") or {}).get("state") for j in JOBS}
            return all(s == "Running" for s in states.values()) and states

        kube.wait_for(all_running, timeout=40, what="every job Running after the chaos")
        before = {j: {n: p.metadata.uid for n, p in pods_of(kube, ns, j).items()} for j in JOBS}
        for job in JOBS:
            assert set(before[job]) == expected_names(job, 2, 4)
        proc.kill()

        # While the operator is down: a PS of "ra" dies and "rb" loses two workers.
        kube.terminate_pod(ns, "ra-ps-1", 137)
        patch_job(kube, ns, "rb", {"spec": {"replicaSpecs": {"Worker": {"replicas": 2}}}})
        chaos(proc, rng, 4, kube, ns)
        proc.start()

        def settled():
            ra = get_job(kube, ns, "ra")
            rb = get_job(kube, ns, "rb")
            pods_ok = set(pods_of(kube, ns, "rb")) == expected_names("rb", 2, 2)
            # pods and Services are deleted concurrently: the Services of the removed workers may lag
            pods_ok = pods_ok and set(services_of(kube, ns, "rb")) == expected_names("rb", 2, 2)
            return (ra["status"].get("state") == "Running" and ra["status"].get("backoffCount") == 1
                    and rb["status"].get("workers") == "2/2" and pods_ok and (ra, rb))

        ra, rb = kube.wait_for(settled, timeout=40, what="the PS restart and the scale-down to settle")
        # Counted once, whatever moment the kills hit.
        assert ra["status"]["chiefEpoch"] == 1
        assert ra["status"]["replicaStatuses"]["PS"]["restarts"] == 1
        assert ra["status"]["replicaStatuses"]["Chief"]["restarts"] == 1
        after = {j: {n: p.metadata.uid for n, p in pods_of(kube, ns, j).items()} for j in JOBS}
        # Only the failed PS and the chief of "ra" were recreated; nothing else was touched.
        changed = {n for n in before["ra"] if after["ra"][n] != before["ra"][n]}
        assert changed == {"ra-ps-1", "ra-chief-0"}
        assert after["rc"] == before["rc"]
        assert after["rb"] == {n: u for n, u in before["rb"].items() if n in expected_names("rb", 2, 2)}
        # No orphans: every pod and Service in the namespace is controlled by its job; none lost.
        jobs_uid = {j: get_job(kube, ns, j)["metadata"]["uid"] for j in JOBS}
        for pod in kube.core().list_namespaced_pod(ns).items:
            if pod.metadata.deletion_timestamp is not None:
                continue
            job = pod.metadata.labels["kubeps.dev/job-name"]
            refs = [r for r in pod.metadata.owner_references if r.controller]
            assert [r.uid for r in refs] == [jobs_uid[job]], pod.metadata.name
        for job, (ps, workers) in {"ra": (2, 4), "rb": (2, 2), "rc": (2, 4)}.items():
            assert set(services_of(kube, ns, job)) == expected_names(job, ps, workers)
    finally:
        proc.kill()
        delete_namespace(kube, ns)
