"""``helm upgrade`` from the previous release's chart keeps a job and its children, and the new operator takes the job
over (docs/upgrade.md).

The previous release, for this first versioned one, is the chart as it was before versioned releases began:
``fixtures/kubeps-chart-b638c4e.tgz`` is ``helm package`` of ``charts/kubeps`` at commit b638c4e
(``git archive b638c4e charts/kubeps | tar -x -C DIR && helm package DIR/charts/kubeps``); a later release replaces it
with the package of the release before it.

On the loopback control plane the chart's operator pod lands on a kwok node, which reports it Running without
running it, so the operator before and after the upgrade runs as a process on loopback (this tree's code, watching
the test's namespace only), stopped when the old chart's Deployment goes and started again once the new one is in
place. What the upgrade itself changes -- the CRD (a template of the chart), the Deployment, the RBAC -- is the
charts' own, applied by the real Helm against the real API server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubeps.runtime.contract import VERSION as KUBEPS_VERSION

from .conftest import (GROUP, PLURAL, VERSION, OperatorProcess, create_job, delete_namespace, get_job, job_manifest,
                       make_namespace, patch_job, pods_of, services_of, wait_state)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubeps"
PREVIOUS_CHART = Path(__file__).parent / "fixtures" / "kubeps-chart-b638c4e.tgz"
CRD_NAME = f"{PLURAL}.{GROUP}"
# Never pulled: on kwok the pod is "Running" all the same, and no second operator starts beside the test's.
INERT_IMAGE = ["--set", "image.repository=kubeps.invalid/kubeps-operator", "--set", "image.pullPolicy=Never"]

pytestmark = pytest.mark.slow


def crd(kube) -> dict | None:
    out = kube.kubectl("get", "crd", CRD_NAME, "--ignore-not-found", "-o", "json").stdout.strip()
    return json.loads(out) if out else None


def uids(kube, namespace: str, job: str) -> dict[str, str]:
    found = {f"pod/{n}": p.metadata.uid for n, p in pods_of(kube, namespace, job).items()}
    found |= {f"service/{n}": s.metadata.uid for n, s in services_of(kube, namespace, job).items()}
    secrets = kube.core().list_namespaced_secret(namespace, label_selector=f"kubeps.dev/job-name={job}").items
    return found | {f"secret/{s.metadata.name}": s.metadata.uid for s in secrets}


def test_helm_upgrade_from_the_previous_chart_keeps_a_running_job(kube, tmp_path):
    if not kube.local:
        pytest.skip("installs and deletes the CRD: only on the private loopback control plane")
    restore_crd = crd(kube) is not None
    if restore_crd:  # an earlier test module applied it for itself: the releases here must own it
        kube.kubectl("delete", "crd", CRD_NAME, "--wait=true", timeout=120)
    namespace = make_namespace(kube, "upg-")
    release = "kubeps-upg"
    values = ["--set", f"watchNamespaces={{{namespace}}}", *INERT_IMAGE]
    operator = None
    try:
        kube.helm("install", release, str(PREVIOUS_CHART), "-n", namespace, *values, "--wait", "--timeout", "90s",
                  timeout=150)
        kube.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s", timeout=90)
        kube.wait_for(lambda: kube.custom().list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL),
                      timeout=30, what="the PSTrainingJob resource to be served")
        operator = OperatorProcess(kube, [namespace], tmp_path / "before.log").start()
        job = create_job(kube, namespace, job_manifest("upg", ps=1, workers=1))
        wait_state(kube, namespace, "upg", "Running")
        before = uids(kube, namespace, "upg")
        assert sorted(k for k in before if k.startswith("pod/")) == [
            "pod/upg-chief-0", "pod/upg-ps-0", "pod/upg-worker-0"], before
        operator.stop()  # the old operator goes with the old chart's Deployment

        kube.helm("upgrade", release, str(CHART), "-n", namespace, "--reuse-values", "--wait", "--timeout", "90s",
                  timeout=150)
        history = json.loads(kube.helm("history", release, "-n", namespace, "-o", "json").stdout)
        assert [h["revision"] for h in history] == [1, 2] and history[-1]["status"] == "deployed", history
        (deployment,) = kube.apps().list_namespaced_deployment(
            namespace, label_selector=f"app.kubernetes.io/instance={release}").items
        assert deployment.metadata.labels["app.kubernetes.io/version"] == KUBEPS_VERSION
        assert deployment.metadata.labels["helm.sh/chart"] == f"kubeps-{KUBEPS_VERSION}"

        # The CRD: still served and stored at the version the job was written in; the job and its children as they
        # were (the same objects, nothing deleted and made again).
        upgraded = crd(kube)
        assert upgraded["status"]["storedVersions"] == [VERSION], upgraded["status"]
        assert [v["name"] for v in upgraded["spec"]["versions"] if v["storage"]] == [VERSION]
        assert get_job(kube, namespace, "upg")["metadata"]["uid"] == job["metadata"]["uid"]
        assert uids(kube, namespace, "upg") == before

        # The new operator takes the job over: it acts on a change made after the upgrade.
        operator = OperatorProcess(kube, [namespace], tmp_path / "after.log").start()
        patch_job(kube, namespace, "upg", {"spec": {"replicaSpecs": {"Worker": {"replicas": 2}}}})
        try:
            kube.wait_for(lambda: get_job(kube, namespace, "upg")["status"]["workers"] == "2/2", timeout=60,
                          what="the new operator to add worker 1")
        except AssertionError as err:  # what the job and its pods were, and what the operator said
            pods = {n: p.status.phase for n, p in pods_of(kube, namespace, "upg").items()}
            raise AssertionError(f"{err}\nstatus: {get_job(kube, namespace, 'upg').get('status')}\npods: {pods}\n"
                                 f"operator log:\n{operator.log_tail(40)}") from None
        after = uids(kube, namespace, "upg")
        assert {k: v for k, v in after.items() if k in before} == before  # the old children kept
        assert "pod/upg-worker-1" in after and get_job(kube, namespace, "upg")["status"]["state"] == "Running"
        assert f"kubeps operator {KUBEPS_VERSION} starting" in operator.log_tail(400)
    finally:
        if operator is not None:
            operator.stop()
        kube.helm("uninstall", release, "-n", namespace, "--ignore-not-found", check=False, timeout=150)
        delete_namespace(kube, namespace)
        kube.kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=true", check=False, timeout=120)
        if restore_crd:
            kube.kubectl("apply", "--server-side", "-f", str(REPO / "deploy" / "crd.yaml"), timeout=60)
            kube.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s", timeout=90)
