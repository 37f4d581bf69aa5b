"""The operator under load and in pairs, on the real control plane.

* A burst of 50 jobs: every reconcile succeeds the first time (no error logged, no retry scheduled, no API error
  counted). A pooled connection handed back with an unread answer made the next request on it read that answer
  as its status line: the reconcile failed and was retried 5 s later, which hid it from every other test.
* Two operators with kopf peering: exactly one acts; SIGKILLed, the other takes over within the peering lifetime;
  a replica paused by a higher-priority one leaves the children alone.
* ``kopf run -m kubeps.operator.controller.handlers`` runs a job too.
"""

from __future__ import annotations

import re
import time

import pytest

from .conftest import (REPO, OperatorProcess, create_job, delete_namespace, get_job, job_manifest, make_namespace,
                       pods_of, services_of)

BURST = 50


def _pods_created(proc: OperatorProcess) -> float:
    return sum(float(v) for v in re.findall(r'^kubeps_pods_created_total\{role="\w+"\} (\S+)', proc.metrics(), re.M))


def _reconciles(proc: OperatorProcess) -> float:
    """Reconciles done, whatever they changed (a second actor's creates would all be 409s, not counted above)."""
    return float(re.search(r"^kubeps_reconcile_duration_seconds_count (\S+)", proc.metrics(), re.M).group(1))


def _peered_namespace(kube, prefix: str) -> str:
    """A fresh namespace with the KopfPeering ``kubeps-test`` (kopf's peering CRDs installed first)."""
    kube.kubectl("apply", "--server-side", "-f",
                 str(REPO / "charts" / "kubeps" / "charts" / "kopf-peering" / "crds" / "kopf-peering.yaml"))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=30s", "crd/kopfpeerings.kopf.dev")
    ns = make_namespace(kube, prefix=prefix)
    kube.apply({"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "kubeps-test"}},
               namespace=ns)
    return ns


def test_burst_of_jobs_reconciles_without_error_or_retry(crd, kube, tmp_path):
    ns = make_namespace(kube, prefix="kbu-")
    proc = OperatorProcess(kube, [ns], tmp_path / "operator.log")
    try:
        proc.start()
        names = [f"b{i:02d}" for i in range(BURST)]
        for name in names:  # 1 chief + 1 PS + 2 workers: 200 pods, 200 Services, 50 Secrets
            create_job(kube, ns, job_manifest(name, ps=1, workers=2))

        def all_running():
            jobs = kube.custom().list_namespaced_custom_object("kubeps.dev", "v1alpha1", ns, "pstrainingjobs")
            states = [(j.get("status") or {}).get("state") for j in jobs["items"]]
            return states.count("Running") == BURST

        # ~1,000 requests at the default 100/s, on a loaded 2-core machine: generous.
        kube.wait_for(all_running, timeout=120, interval=1, what=f"{BURST} jobs Running")
        log = proc.log_path.read_text(errors="replace")
        failures = [line for line in log.splitlines() if "failed" in line or "Traceback" in line or "retry" in line]
        assert not failures, "\n".join(failures[:20])
        metrics = proc.metrics()
        assert "kubeps_api_errors_total{" not in metrics, re.findall(r"kubeps_api_errors_total\{.*", metrics)
        assert _pods_created(proc) == BURST * 4  # each pod made once: no reconcile lost its work and repeated it
    finally:
        proc.stop()
        delete_namespace(kube, ns)


def test_two_operators_with_peering_one_acts_and_the_other_takes_over(crd, kube, tmp_path):
    ns = _peered_namespace(kube, "kpe-")
    args = ["--peering", "kubeps-test"]
    first = OperatorProcess(kube, [ns], tmp_path / "first.log", args)
    second = OperatorProcess(kube, [ns], tmp_path / "second.log", args)
    try:
        first.start()
        second.start()  # started later: a lower priority, so it waits behind the first
        create_job(kube, ns, job_manifest("pa", ps=1, workers=2))
        kube.wait_for(lambda: (get_job(kube, ns, "pa").get("status") or {}).get("state") == "Running",
                      timeout=40, what="job pa Running")
        time.sleep(2)  # a second actor would have reconciled by now
        assert _pods_created(first) == 4 and _reconciles(first) > 0
        assert _reconciles(second) == 0

        first.kill()
        killed = time.monotonic()
        create_job(kube, ns, job_manifest("pb", ps=1, workers=2))
        kube.wait_for(lambda: (get_job(kube, ns, "pb").get("status") or {}).get("state") == "Running",
                      timeout=60, what=f"job pb Running after the leader's SIGKILL\n{second.log_tail()}")
        takeover = time.monotonic() - killed
        print(f"take-over after SIGKILL of the leader: {takeover:.1f} s (peering lifetime 10 s)")
        assert _pods_created(second) == 4  # pa's pods were left alone, pb's made
        assert takeover < 30, takeover
    finally:
        first.kill()
        second.stop()
        delete_namespace(kube, ns)


def test_a_replica_paused_by_a_higher_priority_one_leaves_the_job_alone(crd, kube, tmp_path):
    """The pods and Services are watched outside kopf, so their events reach a paused replica too: its peering gate
    must keep it from acting on them. A pod deleted after the take-over is replaced by the new leader only."""
    ns = _peered_namespace(kube, "kpp-")
    low = OperatorProcess(kube, [ns], tmp_path / "low.log", ["--peering", "kubeps-test", "--peering-priority", "10"])
    high = OperatorProcess(kube, [ns], tmp_path / "high.log", ["--peering", "kubeps-test", "--peering-priority", "20"])
    try:
        low.start()
        create_job(kube, ns, job_manifest("pc", ps=1, workers=2))
        kube.wait_for(lambda: (get_job(kube, ns, "pc").get("status") or {}).get("state") == "Running",
                      timeout=40, what="job pc Running")
        assert _pods_created(low) == 4
        high.start()
        kube.wait_for(lambda: "Pausing operations" in low.log_path.read_text(errors="replace"), timeout=30,
                      what=f"kopf pausing the low-priority replica\n{low.log_tail()}")
        time.sleep(1)  # its gate, reading the same peering object, closes with it
        kube.wait_for(lambda: _reconciles(high) > 0, timeout=30, what="the high-priority replica reconciling")
        low_reconciles = _reconciles(low)

        old_uid = kube.core().read_namespaced_pod("pc-worker-1", ns).metadata.uid
        kube.kubectl("-n", ns, "delete", "pod", "pc-worker-1", "--wait=false")

        def replaced():
            try:
                pod = kube.core().read_namespaced_pod("pc-worker-1", ns)
            except Exception:  # noqa: BLE001 - not there yet
                return False
            return pod.metadata.uid != old_uid and pod.status.phase == "Running"

        kube.wait_for(replaced, timeout=40, what="pc-worker-1 replaced")
        time.sleep(2)  # a paused replica reacting to the deletion would have by now
        assert _pods_created(high) == 1
        assert _pods_created(low) == 4 and _reconciles(low) == low_reconciles
    finally:
        low.stop()
        high.stop()
        delete_namespace(kube, ns)


def test_kopf_run_module_runs_a_job(crd, kube, tmp_path):
    """`kopf run -m kubeps.operator.controller.handlers` (kopf's CLI, our handlers): the children are watched by the
    operator's own watches under kopf's options too, and a job runs."""
    ns = make_namespace(kube, prefix="kcl-")
    proc = OperatorProcess(kube, [ns], tmp_path / "kopf-run.log", ["--standalone"], kopf_cli=True)
    try:
        proc.start()
        create_job(kube, ns, job_manifest("kr", ps=1, workers=2))
        kube.wait_for(lambda: (get_job(kube, ns, "kr").get("status") or {}).get("state") == "Running",
                      timeout=40, what=f"job kr Running under kopf run\n{proc.log_tail()}")
        pods = kube.core().list_namespaced_pod(ns, label_selector="kubeps.dev/job-name=kr").items
        assert sorted(p.metadata.name for p in pods) == ["kr-chief-0", "kr-ps-0", "kr-worker-0", "kr-worker-1"]
    finally:
        proc.stop()
        delete_namespace(kube, ns)


@pytest.mark.slow
@pytest.mark.alone  # 2,102 creates and 1,051 force-deletes: both cores busy for a minute or more (docs/testing.md)
@pytest.mark.timeout(600)
def test_a_1000_worker_job_gets_every_pod_with_its_tf_config(crd, kube, tmp_path):
    """One job of 1 chief + 50 ps + 1,000 workers on a fake node of its own (kwok; tainted, so that no other test's
    pod lands there): all 1,051 pods and Services are created, each pod with the whole cluster in its TF_CONFIG.
    (Waiting for all of them Running measures kwok more than the operator: 473 s here at load average 45-71.)
    Its own operator: the force-deletes of 1,051 pods when the node goes are no other test's wait."""
    ns = make_namespace(kube, prefix="kbg-")
    proc = OperatorProcess(kube, [ns], tmp_path / "operator.log")
    try:
        proc.start()
        _a_1000_worker_job(kube, ns, proc)
    finally:
        proc.stop()
        delete_namespace(kube, ns)


def _a_1000_worker_job(kube, ns: str, proc: OperatorProcess) -> None:
    from kubeps.runtime.cluster import TFConfig

    pool = {"kubeps.dev/test-pool": ns}
    node_name = f"scale-{ns}"[:63]
    resources = {"cpu": "2000", "memory": "8000Gi", "pods": "1100", "ephemeral-storage": "1000Gi"}
    kube.core().create_node({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node_name, "labels": {**pool, "type": "kwok-scale"},
                     "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"}},
        "spec": {"taints": [{"key": "kubeps.dev/test-pool", "value": ns, "effect": "NoSchedule"}]},
        "status": {"allocatable": resources, "capacity": resources},
    })
    try:
        template = {"spec": {"nodeSelector": pool, "containers": [{"name": "kubeps", "image": "registry.test/app:1"}],
                             "tolerations": [{"key": "kubeps.dev/test-pool", "operator": "Equal", "value": ns,
                                              "effect": "NoSchedule"}]}}
        manifest = job_manifest("big", ps=50, workers=1000, templates={r: template for r in ("Chief", "PS", "Worker")})
        started = time.monotonic()
        create_job(kube, ns, manifest)

        def all_created():  # the operator's own count of the job's Pending and Running pods
            counts = (get_job(kube, ns, "big").get("status") or {}).get("replicaStatuses") or {}
            return [counts.get(r, {}).get("active", 0) for r in ("Chief", "PS", "Worker")] == [1, 50, 1000]

        kube.wait_for(all_created, timeout=400, interval=2.0, what="1,051 pods created")
        created_s = time.monotonic() - started
        core = kube.core()
        for name, task_type, index in (("big-worker-999", "worker", 999), ("big-ps-49", "ps", 49),
                                       ("big-chief-0", "chief", 0)):
            env = {e.name: e.value for e in core.read_namespaced_pod(name, ns).spec.containers[0].env}
            config = TFConfig.parse(env["TF_CONFIG"])
            assert (config.task_type, config.task_index) == (task_type, index)
            assert [len(config.cluster[t]) for t in ("chief", "ps", "worker")] == [1, 50, 1000]
            assert config.cluster["worker"][999].startswith(f"big-worker-999.{ns}.svc:")
        assert len(services_of(kube, ns, "big")) == 1051
        print(f"\nSCALE 1,000 workers + 50 ps: all 1,051 pods created {created_s:.1f} s after the job; "
              f"TF_CONFIG {len(env['TF_CONFIG'])} bytes")
    finally:
        kube.core().delete_node(node_name)
        # the operator force-deletes the pods of the node that went (nothing else would: no kubelet)
        kube.wait_for(lambda: not pods_of(kube, ns, "big"), timeout=120, interval=2.0, what="big's pods gone")


def test_a_big_jobs_requests_do_not_hold_up_a_small_job(crd, kube, tmp_path):
    """The API client serves requests in the order they come; a job holds at most half its connections, so a small
    job created while a big one's 400 creates are going (at 20 requests/s here: ~20 s of them) gets its pods at
    once, not after all of the big job's."""
    ns = make_namespace(kube, prefix="kfa-")
    proc = OperatorProcess(kube, [ns], tmp_path / "operator.log", ["--api-qps", "20", "--api-burst", "5"]).start()
    try:
        create_job(kube, ns, job_manifest("big", ps=1, workers=198))
        kube.wait_for(lambda: len(pods_of(kube, ns, "big")) > 0, timeout=60, what="the big job's first pod")
        create_job(kube, ns, job_manifest("small", ps=1, workers=2))
        kube.wait_for(lambda: len(pods_of(kube, ns, "small")) == 4, timeout=60, what="the small job's 4 pods")
        big_pods = len(pods_of(kube, ns, "big"))
        print(f"\nFAIRNESS the small job had its 4 pods when the big job had {big_pods} of 200")
        assert big_pods < 150, big_pods
    finally:
        proc.stop()
        delete_namespace(kube, ns)
