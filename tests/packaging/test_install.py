"""The chart and the plain manifests against a real API server: install, upgrade, uninstall, nothing left behind.

On the loopback control plane the operator pod lands on a kwok node, which reports it Running without running it.
On an external cluster (KUBEPS_TEST_KUBECONFIG, e.g. the kind e2e) the releases here use an image that is never
pulled, so they never start a second operator next to the one under test.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubeps"
CRD = yaml.safe_load((CHART / "files" / "crd.yaml").read_text())
CRD_NAME = CRD["metadata"]["name"]
GROUP, PLURAL = CRD["spec"]["group"], CRD["spec"]["names"]["plural"]
PEERING_CRDS = ("kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev")
# Never pulled: on kind the pod stays in ErrImageNeverPull, on kwok it is "Running" all the same.
INERT_IMAGE = ["--set", "image.repository=kubeps.invalid/kubeps-operator", "--set", "image.pullPolicy=Never"]

pytestmark = pytest.mark.slow


def crd_exists(kube, name: str) -> bool:
    return kube.kubectl("get", "crd", name, "--ignore-not-found", "-o", "name").stdout.strip() != ""


def owned(kube, kind: str, release: str, namespace: str | None = None) -> list[str]:
    """Names of objects of `kind` labelled as this release's (cluster-wide when namespace is None)."""
    scope = ["-n", namespace] if namespace else (["-A"] if kind in ("role", "rolebinding") else [])
    out = kube.kubectl("get", kind, *scope, "-l", f"app.kubernetes.io/instance={release}", "-o", "name").stdout
    return out.split()


def can_i(kube, sa: str, verb: str, resource: str, namespace: str) -> bool:
    resource, _, sub = resource.partition("/")
    extra = [f"--subresource={sub}"] if sub else []
    proc = kube.kubectl("auth", "can-i", verb, resource, *extra, "-n", namespace, f"--as={sa}", check=False)
    assert proc.stdout.strip() in ("yes", "no"), proc.stdout + proc.stderr
    return proc.stdout.strip() == "yes"


def deployment_args(kube, namespace: str, name: str) -> list[str]:
    deploy = kube.apps().read_namespaced_deployment(name, namespace)
    return deploy.spec.template.spec.containers[0].args


def left_behind(kube, release: str, namespaces: list[str]) -> list[str]:
    found = owned(kube, "clusterrole", release) + owned(kube, "clusterrolebinding", release)
    for ns in namespaces:
        for kind in ("deployment", "pod", "service", "serviceaccount", "role", "rolebinding", "secret"):
            found += [f"{ns}/{n}" for n in owned(kube, kind, release, ns)]
    return found


@pytest.fixture
def release(kube, namespace):
    """A release name in the test namespace; uninstalled (if still there) afterwards."""
    name = f"kp-{uuid.uuid4().hex[:6]}"
    yield name
    kube.helm("uninstall", name, "-n", namespace, "--ignore-not-found", check=False)


def test_install_upgrade_uninstall_leaves_nothing(kube, namespace, release, tmp_path):
    crd_was_there = crd_exists(kube, CRD_NAME)
    install = ["--set", f"crds.install={str(not crd_was_there).lower()}", "--set", "crds.keep=false", *INERT_IMAGE]
    wait = ["--wait", "--timeout", "90s"] if kube.local else []
    kube.helm("install", release, str(CHART), "-n", namespace, *install, *wait, timeout=150)
    fullname = f"{release}-kubeps"
    sa = f"system:serviceaccount:{namespace}:{fullname}"
    other = f"{namespace}-other"
    kube.core().create_namespace({"metadata": {"name": other, "labels": {"kubeps.dev/test": "true"}}})
    try:
        # Installed: the CRD is served, the operator's pod scheduled (Running on kwok), cluster-wide rights.
        assert kube.kubectl("get", PLURAL + "." + GROUP, "-A").returncode == 0
        args = deployment_args(kube, namespace, fullname)
        assert "--all-namespaces" in args and "--log-level=info" in args
        if kube.local:
            pods = kube.core().list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/instance={release}")
            assert [p.status.phase for p in pods.items] == ["Running"]
        assert owned(kube, "clusterrole", release) == [f"clusterrole.rbac.authorization.k8s.io/{fullname}-cluster"]
        assert can_i(kube, sa, "watch", f"{PLURAL}.{GROUP}", other)
        assert can_i(kube, sa, "create", "pods", other)
        assert can_i(kube, sa, "patch", f"{PLURAL}.{GROUP}/status", other)
        assert not can_i(kube, sa, "create", "deployments", other)
        assert not can_i(kube, sa, "update", f"{PLURAL}.{GROUP}", other)
        assert not can_i(kube, sa, "patch", f"{PLURAL}.{GROUP}", other)
        assert not can_i(kube, sa, "list", "secrets", other), "the operator only reads its own Secrets by name"
        assert not can_i(kube, sa, "create", "clusterrolebindings", other)

        # Upgrade to namespaced mode: rights only in the watched namespace, new flags on the pod.
        values = tmp_path / "upgrade.yaml"
        values.write_text(yaml.safe_dump({"watchNamespaces": [namespace], "logLevel": "debug"}))
        kube.helm("upgrade", release, str(CHART), "-n", namespace, "--reuse-values", "--values", str(values), *wait,
                  timeout=150)
        args = deployment_args(kube, namespace, fullname)
        assert "--all-namespaces" not in args and f"--namespace={namespace}" in args and "--log-level=debug" in args
        assert owned(kube, "role", release, namespace) == [f"role.rbac.authorization.k8s.io/{fullname}"]
        assert can_i(kube, sa, "watch", f"{PLURAL}.{GROUP}", namespace)
        assert not can_i(kube, sa, "watch", f"{PLURAL}.{GROUP}", other)
        assert not can_i(kube, sa, "create", "pods", other)
        assert can_i(kube, sa, "watch", "customresourcedefinitions.apiextensions.k8s.io", other)
        history = json.loads(kube.helm("history", release, "-n", namespace, "-o", "json").stdout)
        assert [h["status"] for h in history] == ["superseded", "deployed"]

        # Uninstall: nothing of ours is left, cluster-scoped objects included; crds.keep=false removes the CRD.
        kube.helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "90s", timeout=150)
        kube.wait_for(lambda: not left_behind(kube, release, [namespace, other]), timeout=60,
                      what="the release's objects to be gone")
        if not crd_was_there:
            kube.wait_for(lambda: not crd_exists(kube, CRD_NAME), timeout=60, what=f"CRD {CRD_NAME} deleted")
        else:
            assert crd_exists(kube, CRD_NAME), "a CRD the release did not install must not be touched"
    finally:
        kube.core().delete_namespace(other)


def test_default_uninstall_keeps_the_crd_and_peering_installs_its_crds_first(kube, namespace, release):
    """crds.keep=true (default) keeps the CRD and so users' jobs; peering CRDs come before peering objects."""
    restore_crd = False
    if crd_exists(kube, CRD_NAME):
        if not kube.local:
            pytest.skip(f"{CRD_NAME} exists already (installed by someone else): this test needs to own it")
        # Our private control plane: an earlier test module installed the CRD for itself. Take it over, and put it
        # back afterwards for any test that still expects it.
        kube.kubectl("delete", "crd", CRD_NAME, "--wait=true", timeout=120)
        restore_crd = True
    peering_was_there = {n: crd_exists(kube, n) for n in PEERING_CRDS}
    try:
        kube.helm("install", release, str(CHART), "-n", namespace, "--set", f"watchNamespaces={{{namespace}}}",
                  "--set", "peering.enabled=true", *INERT_IMAGE, timeout=150)
        peering = kube.kubectl("get", "kopfpeerings.kopf.dev", "-n", namespace, "-o", "name").stdout.split()
        assert peering == ["kopfpeering.kopf.dev/kubeps"]
        job = {"apiVersion": f"{GROUP}/{CRD['spec']['versions'][0]['name']}", "kind": CRD["spec"]["names"]["kind"],
               "metadata": {"name": "kept", "namespace": namespace}, "spec": {}}
        created = kube.kubectl("create", "-f", "-", "--dry-run=server", "-o", "name", input=json.dumps(job), check=False)
        # The CRD is served (a minimal job may or may not satisfy its schema; the API must know the kind).
        assert "the server doesn't have a resource type" not in created.stderr, created.stderr

        kube.helm("uninstall", release, "-n", namespace, "--wait", timeout=150)
        assert not left_behind(kube, release, [namespace])
        assert kube.kubectl("get", "kopfpeerings.kopf.dev", "-n", namespace, "-o", "name").stdout.split() == []
        crd = json.loads(kube.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        for name in PEERING_CRDS:
            assert crd_exists(kube, name), f"{name} is in crds/: Helm keeps it"
    finally:
        kube.kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=true", check=False)
        for name, was_there in peering_was_there.items():
            if not was_there:
                kube.kubectl("delete", "crd", name, "--ignore-not-found", check=False)
        if restore_crd:
            kube.kubectl("apply", "--server-side", "-f", str(REPO / "deploy" / "crd.yaml"), timeout=60)
            kube.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s", timeout=90)


def test_plain_manifests_install_and_delete(kube):
    """`kubectl apply --server-side -f deploy/` installs the operator; `kubectl delete -f deploy/` removes it all."""
    if not kube.local:
        pytest.skip("would start a second cluster-wide operator in a shared cluster; "
                    "hack/kind-e2e.sh --install manifests covers deploy/ on kind")
    if kube.kubectl("get", "namespace", "kubeps-system", "--ignore-not-found", "-o", "name").stdout.strip():
        pytest.skip("namespace kubeps-system exists already")
    crd_was_there = crd_exists(kube, CRD_NAME)
    files = ["-f", str(REPO / "deploy" / "operator.yaml")] if crd_was_there else ["-f", str(REPO / "deploy")]
    try:
        kube.kubectl("apply", "--server-side", *files, timeout=120)
        kube.kubectl("-n", "kubeps-system", "rollout", "status", "deployment/kubeps", "--timeout=90s", timeout=120)
        assert kube.kubectl("get", f"{PLURAL}.{GROUP}", "-A").returncode == 0
        sa = "system:serviceaccount:kubeps-system:kubeps"
        assert can_i(kube, sa, "watch", f"{PLURAL}.{GROUP}", "default")
    finally:
        kube.kubectl("delete", "--ignore-not-found", "--wait=true", *files, timeout=180, check=False)
    assert not left_behind(kube, "kubeps", ["kubeps-system"])
    assert not kube.kubectl("get", "namespace", "kubeps-system", "--ignore-not-found", "-o", "name").stdout.strip()
    assert crd_exists(kube, CRD_NAME) == crd_was_there


def test_e2e_job_is_accepted_by_the_crd(kube, namespace):
    """examples/ctr/job.yaml passes the real API server's validation against the operator's CRD."""
    crd_was_there = crd_exists(kube, CRD_NAME)
    try:
        if not crd_was_there:
            kube.kubectl("apply", "--server-side", "-f", str(CHART / "files" / "crd.yaml"))
            kube.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=30s")
        proc = kube.kubectl("create", "--dry-run=server", "-n", namespace, "-f",
                            str(REPO / "examples" / "ctr" / "job.yaml"), "-o", "name", check=False)
        assert proc.returncode == 0, proc.stderr
    finally:
        if not crd_was_there:
            kube.kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=true", check=False)


def test_chart_pods_pass_the_restricted_pod_security_standard(kube, namespace, release):
    """Installed into a namespace enforcing ``restricted`` (the API server's PodSecurity admission refuses any pod
    that fails it), the operator's pod is created: with the NetworkPolicies of the chart's variant on."""
    kube.core().patch_namespace(namespace, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})
    kube.helm("install", release, str(CHART), "-n", namespace, "--set", "crds.install=false", *INERT_IMAGE,
              "--values", str(CHART / "ci" / "networkpolicy-values.yaml"), "--wait", "--timeout", "90s")
    pods = kube.core().list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/instance={release}").items
    assert len(pods) == 1
    assert owned(kube, "networkpolicy", release, namespace) == [f"networkpolicy.networking.k8s.io/{release}-kubeps"]


def test_monitors_and_dashboard_are_stored_as_rendered_with_prometheus_operators_crds(kube, namespace, release,
                                                                                     monitoring_crds):
    """The chart's opt-in monitoring on a real API server that serves prometheus-operator's own PodMonitor and
    ServiceMonitor CRDs: the monitors and the dashboard ConfigMap are accepted and stored as rendered (a structural
    schema prunes what it does not know: nothing was), and uninstalling removes them."""
    for crd in monitoring_crds.values():
        kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump(crd))
        kube.kubectl("wait", "--for=condition=Established", "--timeout=30s", f"crd/{crd['metadata']['name']}")
    args = ["-n", namespace, "--values", str(CHART / "ci" / "podmonitor-values.yaml"),
            "--values", str(CHART / "ci" / "servicemonitor-values.yaml"),
            "--set", f"crds.install={str(not crd_exists(kube, CRD_NAME)).lower()}", *INERT_IMAGE]
    rendered = [o for o in yaml.safe_load_all(kube.helm("template", release, str(CHART), *args).stdout) if o]
    kube.helm("install", release, str(CHART), *args, timeout=150)
    custom = kube.custom()
    stored = {}
    for kind, plural in (("PodMonitor", "podmonitors"), ("ServiceMonitor", "servicemonitors")):
        (want,) = [o for o in rendered if o["kind"] == kind]
        got = custom.get_namespaced_custom_object("monitoring.coreos.com", "v1", namespace, plural,
                                                  want["metadata"]["name"])
        assert got["spec"] == want["spec"], kind
        assert got["metadata"]["labels"]["release"] == "prometheus"
        stored[kind] = want["metadata"]["name"]
    (dashboard,) = [o for o in rendered if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")]
    config_map = kube.core().read_namespaced_config_map(dashboard["metadata"]["name"], namespace)
    assert config_map.metadata.labels["grafana_dashboard"] == "1"
    assert json.loads(config_map.data["kubeps.json"]) == json.loads((CHART / "files" / "dashboard.json").read_text())

    kube.helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "90s", timeout=150)
    for kind, plural in (("PodMonitor", "podmonitors"), ("ServiceMonitor", "servicemonitors")):
        names = [o["metadata"]["name"] for o in custom.list_namespaced_custom_object(
            "monitoring.coreos.com", "v1", namespace, plural)["items"]]
        assert stored[kind] not in names, kind
    assert not [c for c in kube.core().list_namespaced_config_map(namespace).items
                if c.metadata.name == dashboard["metadata"]["name"]]
