"""Real Kueue v0.19.2 installed into the kind cluster, for tests/e2e/test_kind.py's Kueue scenario.

The manager binary of ``hack/kueue.sh build`` goes into an image of its own (``hack/kind.sh kueue-image``: FROM
scratch, no registry); its CRDs and webhook manifests come from the same module. Certificates are ours (the
``kubeps.runtime.certs`` helpers) for ``kueue-webhook-service.kueue-system.svc``, mounted where Kueue reads them with
its internal certificate management off (as with cert-manager); the API server reaches the webhooks through the
Service (kind runs kube-proxy). Kueue's ServiceAccount is bound to ``cluster-admin``: a test shortcut for the ~40
rules of Kueue's own RBAC kustomization. The operator is restarted once Kueue's API is served (``--kueue auto``).
"""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import yaml

from kubeps.runtime import certs

from .conftest import KIND_SH, NAMESPACE, RELEASE, REPO, Background, Kind, wait

KUEUE_NS = "kueue-system"
SERVICE = "kueue-webhook-service"
IMAGE = "kubeps-kueue:e2e"
#: Kueue's own objects, and the pod and Job webhooks of the integrations turned on below
KEPT_WEBHOOK_PATHS = ("kueue-x-k8s-io", "--v1-pod", "batch-v1-job")
LABEL = "kubeps.dev/e2e-kueue"


def kueue_home() -> Path:
    out = subprocess.run([str(REPO / "hack" / "kueue.sh"), "dir"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def start_image(kind: Kind) -> Background:
    """`hack/kind.sh kueue-image` in the background (the test's ``start_early``): built and loaded meanwhile."""
    return kind.background("Kueue image", str(KIND_SH), "kueue-image")


def install(kind: Kind, image: Background | None = None) -> None:
    """Kueue into the cluster; ``image``: the ``start_image`` already under way."""
    home = kueue_home()
    assert (home / "kueue").is_file(), "Kueue is not built: run hack/kueue.sh build (make kueue)"
    if image is None:
        kind.run(str(KIND_SH), "kueue-image", timeout=600)
    else:
        image.wait(timeout=600)
    crds = sorted((home / "crds").glob("*.yaml"))
    kind.kubectl("apply", "--server-side", "--force-conflicts", *[a for p in crds for a in ("-f", str(p))],
                 timeout=180)
    made = certs.issue_job_credentials("kueue-webhook", [f"{SERVICE}.{KUEUE_NS}.svc"])
    files = made.files()
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": KUEUE_NS,
        "health": {"healthProbeBindAddress": ":8081"}, "metrics": {"bindAddress": "0"},
        "webhook": {"port": 9443}, "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": ["batch/job", "pod"],
                         "externalFrameworks": ["PSTrainingJob.v1alpha1.kubeps.dev"]},
    }
    labels = {LABEL: "true"}
    objects = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NS, "labels": labels}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "kueue", "namespace": KUEUE_NS}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "kubeps-e2e-kueue", "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
         "subjects": [{"kind": "ServiceAccount", "name": "kueue", "namespace": KUEUE_NS}]},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "kueue-webhook-server-cert", "namespace": KUEUE_NS},
         "type": "kubernetes.io/tls",
         "data": {"tls.crt": _b64(files[certs.TLS_CERT_KEY]), "tls.key": _b64(files[certs.TLS_KEY_KEY])}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kueue-manager-config", "namespace": KUEUE_NS},
         "data": {"controller_manager_config.yaml": yaml.safe_dump(config)}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE, "namespace": KUEUE_NS},
         "spec": {"selector": {"app": "kueue"}, "ports": [{"port": 443, "targetPort": 9443}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": "kueue-controller-manager", "namespace": KUEUE_NS},
         "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "kueue"}}, "template": {
             "metadata": {"labels": {"app": "kueue"}},
             "spec": {"serviceAccountName": "kueue", "containers": [{
                 "name": "manager", "image": IMAGE, "imagePullPolicy": "Never",
                 "args": ["--config=/config/controller_manager_config.yaml",
                          "--feature-gates=VisibilityOnDemand=false"],
                 "ports": [{"containerPort": 9443, "name": "webhook"}],
                 "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8081}, "periodSeconds": 2},
                 "volumeMounts": [
                     {"name": "cert", "mountPath": "/tmp/k8s-webhook-server/serving-certs", "readOnly": True},
                     {"name": "cert", "mountPath": "/etc/kueue/metrics/certs", "readOnly": True},
                     {"name": "config", "mountPath": "/config", "readOnly": True}]}],
                 "volumes": [{"name": "cert", "secret": {"secretName": "kueue-webhook-server-cert"}},
                             {"name": "config", "configMap": {"name": "kueue-manager-config"}}]}}}},
    ]
    kind.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))
    kind.kubectl("-n", KUEUE_NS, "rollout", "status", "deployment/kueue-controller-manager", "--timeout=180s",
                 timeout=200)
    kind.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(_webhooks(home, files[certs.CA_CERT_KEY])))
    # The operator turns its Kueue integration on at start when Kueue's API is served (--kueue auto): restart it.
    deployment = kind.kubectl("-n", NAMESPACE, "get", "deployment", "-l", f"app.kubernetes.io/instance={RELEASE}",
                              "-o", "name").split()[0]
    kind.kubectl("-n", NAMESPACE, "rollout", "restart", deployment)
    kind.kubectl("-n", NAMESPACE, "rollout", "status", deployment, "--timeout=180s", timeout=200)
    wait(lambda: "kueue=on" in kind.kubectl("-n", NAMESPACE, "logs", deployment, check=False), 60,
         "the operator to start with Kueue on")


def uninstall(kind: Kind) -> None:
    """Webhooks first (a pod webhook without its server refuses every pod), then the rest."""
    for kind_name in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
        kind.kubectl("delete", kind_name, "-l", f"{LABEL}=true", "--ignore-not-found", check=False)
    kind.kubectl("delete", "namespace", KUEUE_NS, "--ignore-not-found", "--wait=false", check=False)
    kind.kubectl("delete", "clusterrolebinding", "kubeps-e2e-kueue", "--ignore-not-found", check=False)


def _webhooks(home: Path, ca: bytes) -> list[dict]:
    docs = [d for d in yaml.safe_load_all((home / "webhook" / "manifests.yaml").read_text()) if d]
    out = []
    for doc in docs:
        doc["metadata"] = {"name": f"kueue-{doc['metadata']['name']}", "labels": {LABEL: "true"}}
        kept = []
        for hook in doc.get("webhooks") or []:
            service = hook["clientConfig"]["service"]
            if not any(part in service["path"] for part in KEPT_WEBHOOK_PATHS):
                continue
            hook["clientConfig"] = {"service": {"name": SERVICE, "namespace": KUEUE_NS, "path": service["path"],
                                                "port": 443}, "caBundle": _b64(ca)}
            kept.append(hook)
        doc["webhooks"] = kept
        out.append(doc)
    return out


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
