"""spec.successPolicy against the real control plane (the rules are table-tested in test_gang_planner.py)."""

from __future__ import annotations

import time

from .conftest import condition, create_job, get_job, job_manifest, pods_of, wait_state


def test_all_workers_succeeds_once_the_chief_and_every_worker_exited_0(kube, ns):
    manifest = job_manifest("aw", ps=1, workers=2, policies={"Worker": "Never"})
    manifest["spec"]["successPolicy"] = "AllWorkers"
    create_job(kube, ns, manifest)
    wait_state(kube, ns, "aw", "Running")
    kube.terminate_pod(ns, "aw-chief-0", 0)
    kube.terminate_pod(ns, "aw-worker-0", 0)
    time.sleep(3)  # a ChiefOnly job would have succeeded by now
    job = get_job(kube, ns, "aw")
    assert job["status"]["state"] == "Running", job["status"]
    pods = pods_of(kube, ns, "aw")
    assert pods["aw-chief-0"].status.phase == "Succeeded"  # kept, not restarted
    assert pods["aw-ps-0"].status.phase == "Running"
    kube.terminate_pod(ns, "aw-worker-1", 0)
    job = wait_state(kube, ns, "aw", "Succeeded")
    assert condition(job, "Succeeded")["reason"] == "AllWorkersSucceeded"
    kube.wait_for(lambda: "aw-ps-0" not in pods_of(kube, ns, "aw"), timeout=20,
                  what="the PS deleted (cleanPodPolicy Running)")
