"""The Helm chart, offline: lint, schema, every documented variant valid for Kubernetes, security settings, RBAC."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kubeps.operator.core.children import DEFAULT_IMAGE
from kubeps.runtime.contract import VERSION

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubeps"
VARIANTS = {p.name.removesuffix("-values.yaml"): p for p in sorted((CHART / "ci").glob("*-values.yaml"))}
PEERING_CRDS = CHART / "charts" / "kopf-peering" / "crds" / "kopf-peering.yaml"
DASHBOARD = CHART / "files" / "dashboard.json"


def variant_args(name: str) -> list[str]:
    return [] if name == "default" else ["--values", str(VARIANTS[name])]


ALL_VARIANTS = ["default", *VARIANTS]


def test_documented_variants_exist():
    assert {"namespaced", "servicemonitor", "custom-images"} <= set(VARIANTS)


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_helm_lint_strict(render, variant):
    proc = render.run("lint", "--strict", str(CHART), *variant_args(variant), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_rendering_is_valid_kubernetes_strict(render, variant, monitoring_crds):
    """kubernetes-validate --strict on every built-in object; CRD-typed objects against their own schema
    (prometheus-operator's monitors against its CRDs, with no field the schema does not know)."""
    import jsonschema
    import kubernetes_validate

    objects = render.template("--include-crds", *variant_args(variant))
    assert objects
    peering_schemas = {
        crd["spec"]["names"]["kind"]: crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for crd in yaml.safe_load_all(PEERING_CRDS.read_text())
    }
    for obj in objects:
        kind = obj["kind"]
        if kind in peering_schemas:
            jsonschema.validate(obj, peering_schemas[kind])
            assert obj["apiVersion"] == "kopf.dev/v1"
        elif kind in ("ServiceMonitor", "PodMonitor"):
            (version,) = monitoring_crds[kind]["spec"]["versions"]
            jsonschema.validate(obj, closed(version["schema"]["openAPIV3Schema"]))
            assert obj["apiVersion"] == "monitoring.coreos.com/" + version["name"]
            if kind == "ServiceMonitor":  # and that it scrapes our Service
                check_service_monitor(obj, objects)
        else:
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def closed(schema: dict) -> dict:
    """``schema`` with ``additionalProperties: false`` wherever it lists the properties of an object (as an API server
    prunes the fields a structural schema does not list, a misspelt field would vanish silently rather than fail);
    ``metadata``, which CRD schemas leave open, stays open."""
    if not isinstance(schema, dict):
        return schema
    out = {k: ([closed(v) for v in value] if isinstance(value, list) else
               {name: closed(sub) for name, sub in value.items()} if k == "properties" else
               closed(value) if isinstance(value, dict) else value) for k, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema and "metadata" not in schema["properties"]:
        out["additionalProperties"] = False
    return out


def check_service_monitor(monitor: dict, objects: list[dict]) -> None:
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    services = [o for o in objects if o["kind"] == "Service"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    targets = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
    assert len(targets) == 1, f"ServiceMonitor selector {selector} matches {len(targets)} Services"
    service = targets[0]
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
        assert re.fullmatch(r"([0-9]+(ms|s|m|h))+", endpoint["interval"])


def test_servicemonitor_only_when_enabled(render):
    assert not render.by_kind(render.template(), "ServiceMonitor")
    monitor = render.one(render.template("--values", str(VARIANTS["servicemonitor"])), "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    proc = render.run("template", "x", str(CHART), "--set", "serviceMonitor.enabled=true",
                      "--set", "metrics.service.enabled=false", check=False)
    assert proc.returncode != 0 and "serviceMonitor.enabled needs metrics.service.enabled" in proc.stderr


def test_podmonitor_and_dashboard_only_when_enabled(render):
    import json

    default = render.template()
    assert not render.by_kind(default, "PodMonitor")
    assert not [o for o in render.by_kind(default, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    objects = render.template("--values", str(VARIANTS["podmonitor"]))
    monitor = render.one(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchExpressions"] == [{"key": "kubeps.dev/job-name", "operator": "Exists"}]
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]  # the operator's port name
    dashboard = next(o for o in render.by_kind(objects, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard"))
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["kubeps.json"]) == json.loads(DASHBOARD.read_text())
    scoped = render.one(render.template("--values", str(VARIANTS["podmonitor"]), "--set", "watchNamespaces={a,b}"),
                        "PodMonitor")
    assert scoped["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "logLevel=verbose"], "logLevel must be one of the following"),
        (["--set", "metrics.port=70000"], "metrics.port: Must be less than or equal to 65535"),
        (["--set", "liveness.port=0"], "liveness.port: Must be greater than or equal to 1"),
        (["--set", "watchNamespaces[0]=Team_A"], "watchNamespaces.0: Does not match pattern"),
        (["--set", "imag.tag=1"], "Additional property imag is not allowed"),
        (["--set", "image.digest=latest"], "image.digest: Does not match pattern"),
        (["--set", "image.repository=Registry/Op"], "image.repository: Does not match pattern"),
        (["--set", "clusterDomain=.cluster.local"], "clusterDomain: Does not match pattern"),
        (["--set", "crds.keep=yes"], "crds.keep: Invalid type. Expected: boolean, given: string"),
        (["--set", "resources.limits.memory=lots"], "resources.limits.memory"),
        (["--set", "serviceAccount.create=false"], "serviceAccount.name is required"),
        (["--set", "replicaCount=2"], "replicaCount > 1 needs peering.enabled=true"),
        (["--set", "replicaCount=0"], "replicaCount: Must be greater than or equal to 1"),
        (["--set", "peering.lifetime=1"], "peering.lifetime: Must be greater than or equal to 2"),
    ],
)
def test_bad_values_fail_with_a_clear_message(render, args, message):
    proc = render.run("template", "x", str(CHART), *args, check=False)
    assert proc.returncode != 0, f"helm template {args} succeeded"
    assert message in proc.stderr, proc.stderr


def deployment_and_container(objects):
    deploy = next(o for o in objects if o["kind"] == "Deployment")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    return deploy, container


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_operator_deployment_is_hardened(render, variant):
    deploy, container = deployment_and_container(render.template(*variant_args(variant)))
    spec = deploy["spec"]
    # Old pods stop before new ones start: an old standalone pod ignores peering, so it must never overlap.
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # Writable /tmp on a read-only root.
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert any(v["name"] == tmp["name"] and "emptyDir" in v for v in pod["volumes"])
    res = container["resources"]
    assert {"cpu", "memory"} <= res["requests"].keys() and {"cpu", "memory"} <= res["limits"].keys()
    # The probe and the metrics port are the ones the operator is told to serve.
    args = container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--liveness-port={ports['liveness']}" in args
    assert f"--metrics-port={ports['metrics']}" in args
    probe = container["livenessProbe"]["httpGet"]
    assert probe == {"path": "/healthz", "port": "liveness"}
    assert container["command"] == ["kubeps", "operator"]


def test_operator_arguments_follow_values(render):
    _, c = deployment_and_container(render.template())
    assert "--all-namespaces" in c["args"]
    # the chart's default images are the release's (its appVersion, kubeps.runtime.contract.VERSION), as is the
    # operator's own default (kubeps.operator.core.children.DEFAULT_IMAGE)
    assert f"--default-image=ghcr.io/kubeps/kubeps-runtime:{VERSION}" in c["args"]
    assert f"--default-image={DEFAULT_IMAGE}" in c["args"]
    assert c["image"] == f"ghcr.io/kubeps/kubeps-operator:{VERSION}"
    assert "--cluster-domain=cluster.local" in c["args"] and "--log-level=info" in c["args"]

    _, c = deployment_and_container(render.template("--values", str(VARIANTS["custom-images"])))
    assert c["image"] == "registry.example.com/ml/kubeps-operator:0.1.0-rc1"
    assert c["imagePullPolicy"] == "Always"
    digest = "sha256:" + "0123456789abcdef" * 4
    assert f"--default-image=registry.example.com/ml/kubeps-runtime-gpu@{digest}" in c["args"]
    assert "--cluster-domain=k8s.example.internal" in c["args"] and "--log-level=debug" in c["args"]

    _, c = deployment_and_container(render.template("--values", str(VARIANTS["namespaced"])))
    assert "--all-namespaces" not in c["args"]
    assert [a for a in c["args"] if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]


def rules_of(role: dict) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def crd_group_plural() -> tuple[str, str]:
    crd = yaml.safe_load((CHART / "files" / "crd.yaml").read_text())
    return crd["spec"]["group"], crd["spec"]["names"]["plural"]


def test_cluster_wide_rbac(render):
    objects = render.template()
    # The one Role: the kubelets' Leases, read in kube-node-lease (lost nodes, docs/nodes.md).
    assert [(r["metadata"]["namespace"], rules_of(r)) for r in render.by_kind(objects, "Role")] == [
        ("kube-node-lease", {("coordination.k8s.io", "leases", v) for v in ("get", "list", "watch")})]
    assert [b["metadata"]["namespace"] for b in render.by_kind(objects, "RoleBinding")] == ["kube-node-lease"]
    role = render.one(objects, "ClusterRole")
    binding = render.one(objects, "ClusterRoleBinding")
    sa = render.one(objects, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": "kubeps-system"}]
    deploy, _ = deployment_and_container(objects)
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    rules = rules_of(role)
    group, plural = crd_group_plural()
    assert (group, plural, "watch") in rules and (group, f"{plural}/status", "patch") in rules
    # Cluster-wide, kopf watches every namespace's objects directly: no rights on namespaces, no peering.
    assert not any(res == "namespaces" for _, res, _ in rules)
    assert not any(g == "kopf.dev" for g, _, _ in rules)
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in rules_of(
        render.one(render.template("--set", "peering.enabled=true"), "ClusterRole"))
    # Least privilege: no wildcards, no escalation, nothing on workloads other than pods.
    assert not any("*" in r for r in rules), rules
    assert not {res for _, res, _ in rules} & {"roles", "rolebindings", "clusterroles", "clusterrolebindings",
                                                "deployments", "serviceaccounts"}
    # the per-job membership ConfigMap (docs/elastic.md): made, read back and patched by name; never listed or deleted
    assert {v for _, res, v in rules if res == "configmaps"} == {"get", "create", "patch"}
    assert {v for _, res, v in rules if res == "nodes"} == {"get", "list", "watch"}  # read only
    assert not {v for _, _, v in rules} & {"escalate", "bind", "impersonate", "deletecollection", "update"}


def test_namespaced_mode_rbac(render):
    objects = render.template("--values", str(VARIANTS["namespaced"]))
    cluster_rules = rules_of(render.one(objects, "ClusterRole"))
    # Cluster-wide only what kopf needs to discover its resource and the watched namespaces, the cluster-scoped
    # Kueue objects a queued job names (read only), and the nodes read to replace the pods of lost ones.
    assert cluster_rules == {("apiextensions.k8s.io", "customresourcedefinitions", "list"),
                             ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
                             ("", "namespaces", "list"), ("", "namespaces", "watch"),
                             ("kueue.x-k8s.io", "resourceflavors", "get"),
                             ("kueue.x-k8s.io", "workloadpriorityclasses", "get"),
                             ("scheduling.k8s.io", "priorityclasses", "get"),
                             ("", "nodes", "get"), ("", "nodes", "list"), ("", "nodes", "watch")}
    roles = [r for r in render.by_kind(objects, "Role") if r["metadata"]["namespace"] != "kube-node-lease"]
    bindings = [b for b in render.by_kind(objects, "RoleBinding") if b["metadata"]["namespace"] != "kube-node-lease"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    group, plural = crd_group_plural()
    for role in roles:
        rules = rules_of(role)
        assert (group, plural, "watch") in rules and ("", "pods", "create") in rules
        assert not any(res == "namespaces" or g == "kopf.dev" for g, res, _ in rules)
    objects = render.template("--values", str(VARIANTS["namespaced"]), "--set", "peering.enabled=true")
    for role in render.by_kind(objects, "Role"):
        if role["metadata"]["namespace"] != "kube-node-lease":
            assert ("kopf.dev", "kopfpeerings", "patch") in rules_of(role)


def test_replicas_with_peering_roll_and_stand_by(render):
    deploy, container = deployment_and_container(render.template(
        "--set", "peering.enabled=true", "--set", "replicaCount=2", "--set", "peering.lifetime=15"))
    assert deploy["spec"]["replicas"] == 2 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["KOPF_RUN_PEERING"] == "kubeps" and env["KUBEPS_PEERING_LIFETIME"] == "15"
    assert env["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_peering_objects_and_crds_only_when_enabled(render):
    kinds = {o["kind"] for o in render.template("--include-crds")}
    crd_names = {o["metadata"]["name"] for o in render.template("--include-crds") if o["kind"] == "CustomResourceDefinition"}
    assert not kinds & {"KopfPeering", "ClusterKopfPeering"}
    assert not any(n.endswith(".kopf.dev") for n in crd_names)

    objects = render.template("--include-crds", "--set", "peering.enabled=true")
    assert render.one(objects, "ClusterKopfPeering")["metadata"]["name"] == "kubeps"
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "CustomResourceDefinition"} >= {
        "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"}
    _, c = deployment_and_container(objects)
    assert {"name": "KOPF_RUN_PEERING", "value": "kubeps"} in c["env"]

    objects = render.template("--set", "peering.enabled=true", "--values", str(VARIANTS["namespaced"]))
    assert sorted(p["metadata"]["namespace"] for p in render.by_kind(objects, "KopfPeering")) == ["team-a", "team-b"]
    assert not render.by_kind(objects, "ClusterKopfPeering")


def test_crd_is_the_operators_crd(render):
    """The chart's CRD is `python -m kubeps.operator.api.crd` plus Helm's labels and the keep policy."""
    generated = subprocess.run([sys.executable, "-m", "kubeps.operator.api.crd"], capture_output=True, text=True,
                               cwd=REPO, check=True).stdout
    expected = yaml.safe_load(generated)
    rendered = render.one(render.template(), "CustomResourceDefinition")
    assert rendered["spec"] == expected["spec"]
    assert rendered["metadata"]["name"] == expected["metadata"]["name"]
    assert rendered["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert expected["metadata"].get("labels", {}).items() <= rendered["metadata"]["labels"].items()

    rendered = render.one(render.template("--set", "crds.keep=false"), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in (rendered["metadata"].get("annotations") or {})
    assert not render.by_kind(render.template("--set", "crds.install=false"), "CustomResourceDefinition")


def test_generated_files_are_up_to_date():
    """charts/kubeps/files/crd.yaml and deploy/operator.yaml are what hack/generate-manifests.py writes."""
    proc = subprocess.run([sys.executable, str(REPO / "hack" / "generate-manifests.py"), "--check"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_plain_manifests_match_the_chart(render):
    """deploy/ installs the same operator as the chart (minus Helm's own labels, plus the namespace)."""
    rendered = render.template("--set", "crds.install=false")
    plain = [d for d in yaml.safe_load_all((REPO / "deploy" / "operator.yaml").read_text()) if d]
    assert plain[0]["kind"] == "Namespace" and plain[0]["metadata"]["name"] == "kubeps-system"
    assert [(o["kind"], o["metadata"]["name"]) for o in plain[1:]] == [
        (o["kind"], o["metadata"]["name"]) for o in rendered]
    for obj in plain:
        assert "helm.sh/chart" not in obj["metadata"].get("labels", {})
    crd = yaml.safe_load((REPO / "deploy" / "crd.yaml").read_text())
    assert crd["spec"]["group"] == crd_group_plural()[0]


def test_chart_ports_are_the_operators_defaults():
    """docs/operator.md said metrics on 8080 (the operator's default) while the chart served them on 9090
    and probed liveness on 8080. The chart's defaults are the operator's own."""
    from kubeps.operator.controller.settings import Settings

    values = yaml.safe_load((REPO / "charts" / "kubeps" / "values.yaml").read_text())
    defaults = Settings()
    assert values["metrics"]["port"] == defaults.metrics_port
    assert values["liveness"]["port"] == defaults.liveness_port
    assert defaults.metrics_port != defaults.liveness_port


def test_network_policies_only_when_enabled(render):
    assert not render.by_kind(render.template(), "NetworkPolicy")
    args = render.one(render.template(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--job-network-policy=None" in args
    objects = render.template("--values", str(VARIANTS["networkpolicy"]))
    args = render.one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--job-network-policy=SameJob" in args
    policy = render.one(objects, "NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    (metrics,) = policy["ingress"]  # healthFrom is empty: nothing but the metrics port, from Prometheus only
    assert metrics["ports"] == [{"port": 8080, "protocol": "TCP"}]
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    failed = render.run("template", "r", str(CHART), "--set", "networkPolicy.jobs=Everyone", check=False)
    assert failed.returncode != 0 and "networkPolicy.jobs" in failed.stderr


@pytest.mark.parametrize("backend, group", [("native", "scheduling.k8s.io"), ("volcano", "scheduling.volcano.sh"),
                                            ("scheduler-plugins", "scheduling.x-k8s.io")])
def test_gang_scheduling_backend_flag_and_podgroup_rights_of_that_backend_only(render, backend, group):
    def podgroup_groups(objects: list) -> set[str]:
        return {g for role in render.by_kind(objects, "ClusterRole") + render.by_kind(objects, "Role")
                for g, res, _ in rules_of(role) if res == "podgroups"}

    default = render.template()
    assert "--gang-scheduler=none" in deployment_and_container(default)[1]["args"]
    assert podgroup_groups(default) == set()
    objects = render.template("--set", f"gangScheduling.backend={backend}", "--set",
                              "gangScheduling.schedulerName=my-scheduler")
    args = deployment_and_container(objects)[1]["args"]
    assert f"--gang-scheduler={backend}" in args and "--gang-scheduler-name=my-scheduler" in args
    assert {(g, v) for g, r, v in rules_of(render.one(objects, "ClusterRole")) if r == "podgroups"} == {
        (group, verb) for verb in ("get", "create", "delete")}
    namespaced = render.template("--set", f"gangScheduling.backend={backend}", "--set", "watchNamespaces={a,b}")
    assert podgroup_groups(namespaced) == {group}
    plain = [d for d in yaml.safe_load_all((REPO / "deploy" / "operator.yaml").read_text()) if d]
    assert podgroup_groups(plain) == {"scheduling.k8s.io", "scheduling.volcano.sh", "scheduling.x-k8s.io"}
    failed = render.run("template", "r", str(CHART), "--set", "gangScheduling.backend=kube-batch", check=False)
    assert failed.returncode != 0 and "gangScheduling.backend" in failed.stderr
