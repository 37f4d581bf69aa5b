"""The chart grants exactly the API access the operator's code uses: nothing missing, nothing extra.

The operator's calls are read from its source: the REST requests of operator/kube/client.py
(``self.request("POST", f"/api/v1/namespaces/{namespace}/pods", ...)`` -> create pods; ``/apis/<group>/<version>/namespaces/...``
likewise; ``/apis/{api_version}/...``, the gang scheduler's PodGroups, in the group of every backend, compared with the
chart's rights for all backends), the resources of its kopf watch handlers and of its own
watches (``kopf.on.event(models.GROUP, ...)``, ``self._watch("pods", ...)`` -> list, watch), the cluster-wide watches of
operator/controller/nodes.py (``Watcher(kube, "/api/v1/nodes", ...)``, and ``LEASES``, the Leases of kube-node-lease,
which the chart grants with a Role there), the cluster-scoped reads of Kueue's objects and ``kopf.event(...)`` (create
events).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kubeps.operator.core import gang

REPO = Path(__file__).resolve().parents[2]
OPERATOR = REPO / "operator"
CRD = yaml.safe_load((REPO / "charts" / "kubeps" / "files" / "crd.yaml").read_text())
GROUP, PLURAL = CRD["spec"]["group"], CRD["spec"]["names"]["plural"]


def operator_sources() -> list[Path]:
    """Every module of the operator, in every sub-package: a module left out would be a call nobody checks."""
    return sorted(OPERATOR.rglob("*.py"))


def required_permissions() -> set[tuple[str, str, str]]:
    source = "\n".join(p.read_text() for p in operator_sources())
    needed: set[tuple[str, str, str]] = set()
    # operator/kube/client.py: self.request("POST", f"/api/v1/namespaces/{namespace}/pods", ...) and the jobs' paths
    for method, root, api_group, resource, name, sub in re.findall(
            r'self\.request\("(GET|POST|PUT|PATCH|DELETE)", f"(/api/v1/namespaces|/apis/([\w.-]+)/\w+/namespaces|'
            r'/apis/\{api_version\}/namespaces|\{JOBS\})/\{namespace\}/(\w+|\{models\.PLURAL\})(/\{name\})?(/status)?"',
            source):
        groups = [GROUP] if root == "{JOBS}" else [api_group]
        if root == "/apis/{api_version}/namespaces":
            groups = [version.split("/")[0] for version in gang.API_VERSIONS.values()]
        resource = PLURAL if resource == "{models.PLURAL}" else resource
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method)
        verb = verb or ("get" if name else "list")
        needed |= {(group, resource + sub, verb) for group in groups}
    for group, resource in re.findall(r"kopf\.(?:on\.event|index)\(\s*(\"[^\"]*\"|models\.GROUP)\s*,\s*"
                                      r"(?:\"[^\"]*\"|models\.VERSION)\s*,\s*(\"[^\"]*\"|models\.PLURAL)", source):
        group = GROUP if group == "models.GROUP" else group.strip('"')
        resource = PLURAL if resource == "models.PLURAL" else resource.strip('"')
        needed |= {(group, resource, "list"), (group, resource, "watch")}
    # operator/controller/scope.py: the scopes' own watches, self._watch("pods", ...) -> list, watch pods, and of
    # another group, self._watch(f"/apis/kueue.x-k8s.io/v1beta2{self._where()}/workloads", ...)
    for resource in re.findall(r'self\._watch\("(\w+)"', source):
        needed |= {("", resource, "list"), ("", resource, "watch")}
    for group, resource in re.findall(r'self\._watch\(f"/apis/([\w.-]+)/\w+\{self\._where\(\)\}/(\w+)"', source):
        needed |= {(group, resource, "list"), (group, resource, "watch")}
    needed |= cluster_scoped_reads(source)
    # operator/controller/nodes.py: Watcher(kube, "/api/v1/nodes", ...) and LEASES = "/apis/<group>/v1/namespaces/..."
    for resource in re.findall(r'Watcher\(kube, "/api/v1/(\w+)"', source):
        needed |= {("", resource, "get"), ("", resource, "list"), ("", resource, "watch")}
    for group, resource in re.findall(r'LEASES = "/apis/([\w.-]+)/\w+/namespaces/kube-node-lease/(\w+)"', source):
        needed |= {(group, resource, "get"), (group, resource, "list"), (group, resource, "watch")}
    if re.search(r"kopf\.(event|info|warn|exception)\(", source):
        needed.add(("", "events", "create"))
    return needed


def cluster_scoped_reads(source: str) -> set[tuple[str, str, str]]:
    """operator/kube/client.py: ``self._read_or_none(f"/apis/<group>/<version>/<resource>/{name}")`` -> get."""
    return {(group, resource, "get") for group, resource in
            re.findall(r'self\._read_or_none\(f"/apis/([\w.-]+)/\w+/(\w+)/\{name\}"\)', source)}


def test_the_scan_reads_every_operator_module():
    """The scan must see each module that kubeps.operator is made of (the API calls live in kube/, the kopf
    handlers and the watches in controller/): compare it with what Python would import, found independently."""
    import pkgutil

    import kubeps.operator

    scanned = {p.relative_to(OPERATOR).with_suffix("").as_posix().replace("/", ".") for p in operator_sources()}
    scanned = {name.removesuffix(".__init__") for name in scanned}
    importable = {info.name.removeprefix("kubeps.operator.")
                  for info in pkgutil.walk_packages(kubeps.operator.__path__, "kubeps.operator.")}
    assert importable, "found no operator module to compare with"
    assert not importable - scanned, f"operator modules the RBAC scan skips: {sorted(importable - scanned)}"
    for module in ("kube.client", "controller.handlers", "controller.scope", "controller.recorder"):
        assert module in scanned, module


def rules_of(role: dict) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def granted(render) -> set[tuple[str, str, str]]:
    objects = render.template("--set", "gangScheduling.rbacForAllBackends=true")
    role = render.one(objects, "ClusterRole")
    leases = [r for r in render.by_kind(objects, "Role") if r["metadata"]["namespace"] == "kube-node-lease"]
    return {(g, r, v) for g, r, v in rules_of(role).union(*map(rules_of, leases))
            if g not in ("apiextensions.k8s.io", "kopf.dev")}  # kopf's own discovery and peering, tested elsewhere


def test_operator_source_is_readable():
    needed = required_permissions()
    # Sanity of the extraction itself: the operator certainly creates pods and writes job status.
    assert ("", "pods", "create") in needed and (GROUP, f"{PLURAL}/status", "patch") in needed, needed


def test_rbac_is_exactly_what_the_operator_uses(render):
    needed, have = required_permissions(), granted(render)
    assert not needed - have, f"the operator calls the API without the right to: {sorted(needed - have)}"
    assert not have - needed, f"granted but never used by operator/ (not least privilege): {sorted(have - needed)}"


def test_namespaced_roles_grant_the_same(render):
    """Each watched namespace's Role grants the namespaced rules; the cluster-scoped reads (Kueue's objects, nodes)
    stay in the ClusterRole, the Leases in kube-node-lease's Role."""
    objects = render.template("--set", "watchNamespaces={a,b}", "--set", "gangScheduling.rbacForAllBackends=true")
    scoped_reads = cluster_scoped_reads("\n".join(p.read_text() for p in operator_sources()))
    assert scoped_reads, "found no cluster-scoped read to check"
    cluster_wide = granted(render) - NODE_RULES - scoped_reads
    roles = [r for r in render.by_kind(objects, "Role") if r["metadata"]["namespace"] != "kube-node-lease"]
    assert len(roles) == 2
    for role in roles:
        assert rules_of(role) == cluster_wide
    cluster_role = rules_of(render.one(objects, "ClusterRole"))
    assert scoped_reads <= cluster_role
    # Lost nodes are watched in both modes: Nodes in the ClusterRole, Leases in kube-node-lease.
    assert NODE_RULES <= cluster_role.union(
        *(rules_of(r) for r in render.by_kind(objects, "Role") if r["metadata"]["namespace"] == "kube-node-lease"))


NODE_RULES = {(g, r, v) for g, r in (("", "nodes"), ("coordination.k8s.io", "leases")) for v in ("get", "list", "watch")}


def test_node_rights_only_with_node_loss_watch(render):
    objects = render.template("--set", "nodeLoss.watch=false")
    assert not NODE_RULES & rules_of(render.one(objects, "ClusterRole"))
    assert not [r for r in render.by_kind(objects, "Role") if r["metadata"]["namespace"] == "kube-node-lease"]
    args = render.one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--node-lost-after=-1" in args


def test_kueue_off_grants_nothing_of_kueue(render):
    objects = render.template("--set", "kueue=off")
    role = render.one(objects, "ClusterRole")
    assert not [rule for rule in role["rules"] if rule["apiGroups"] in (["kueue.x-k8s.io"], ["scheduling.k8s.io"])]


def _operator_options(render, *args):
    """What kopf.run would get from the chart's Deployment: its env and args through the operator's parser."""
    from kubeps.operator.main import kopf_run_options, settings_from_args

    container = render.one(render.template(*args), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return kopf_run_options(settings_from_args(container.get("args", []), env=env))


def test_peering_enabled_in_the_chart_makes_the_operator_peer(render):
    """peering.enabled sets KOPF_RUN_PEERING; the operator then runs with that peering, not standalone."""
    options = _operator_options(render, "--set", "peering.enabled=true", "--set", "peering.name=kubeps-peers",
                                "--set", "peering.lifetime=15")
    assert options["standalone"] is False and options["peering_name"] == "kubeps-peers"
    assert options["settings"].peering.lifetime == 15


def test_default_chart_runs_the_operator_standalone(render):
    options = _operator_options(render)
    assert options["standalone"] is True and "peering_name" not in options
