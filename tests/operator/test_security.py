"""Security of a job's pods: the job's CA and task certificate in its Secret (mounted, re-issued for added
Workers, new after the Secret is lost), plaintext only by ``spec.security.tls.mode: Disabled``, the per-job
NetworkPolicy, and pods that pass the ``restricted`` Pod Security Standard. Pure planner tests first, then the
operator against the real control plane (whose kube-apiserver runs the PodSecurity admission plugin)."""

from __future__ import annotations

import base64
import copy
from datetime import datetime, timezone

import pytest
from cryptography import x509

from kubeps.operator.api import models
from kubeps.operator.core import actions as A
from kubeps.operator.core import children
from kubeps.operator.core import planner as P

from .test_planner import observe
from .conftest import create_job, get_job, job_manifest, make_namespace, delete_namespace, patch_job, pods_of, \
    wait_state

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
TLS_ENV = ("KUBEPS_TLS_CA_FILE", "KUBEPS_TLS_CERT_FILE", "KUBEPS_TLS_KEY_FILE")


def api_job(security: dict | None = None, workers: int = 2, templates: dict | None = None) -> dict:
    job = job_manifest("sec", workers=workers, templates=templates)
    job["metadata"].update(namespace="ns", uid="uid-1", generation=1)
    if security is not None:
        job["spec"]["security"] = security
    return job


def pods_planned(job, secret=None, config=children.PlanConfig(), network_policy=False):
    plan = P.plan(observe(job, [], [], secret, NOW, config, network_policy=network_policy))
    return plan, {a.name: a.body for a in plan.of(A.CreatePod)}


def main_of(pod: dict) -> dict:
    return children.main_container(pod["spec"]["containers"])


# ------------------------------------------------------------------------------------------------ planner
def test_mutual_tls_is_the_default_and_mounts_no_ca_key():
    plan, pods = pods_planned(api_job())
    (secret,) = plan.of(A.CreateSecret)
    assert secret.tls_workers == 2
    assert "sec-worker-1.ns.svc" in secret.tls_hosts and "sec-chief-0.ns.svc" in secret.tls_hosts
    for pod in pods.values():
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == children.TLS_VOLUME]
        assert volume["secret"]["secretName"] == "sec-kubeps-token"
        assert sorted(i["key"] for i in volume["secret"]["items"]) == ["ca.crt", "tls.crt", "tls.key"]
        main = main_of(pod)
        assert {"name": "kubeps-tls", "mountPath": "/var/run/kubeps/tls", "readOnly": True} in main["volumeMounts"]
        env = {e["name"]: e.get("value") for e in main["env"]}
        assert [env[n] for n in TLS_ENV] == ["/var/run/kubeps/tls/ca.crt", "/var/run/kubeps/tls/tls.crt",
                                             "/var/run/kubeps/tls/tls.key"]


def test_tls_disabled_is_plaintext_even_against_the_templates_own_variables():
    container = {"name": "kubeps", "image": "x", "env": [{"name": "KUBEPS_TLS_CA_FILE", "value": "/mine"}]}
    templates = {role: {"spec": {"containers": [copy.deepcopy(container)]}} for role in ("Chief", "PS", "Worker")}
    _, pods = pods_planned(api_job({"tls": {"mode": "Disabled"}}, templates=templates))
    for pod in pods.values():
        assert not [v for v in pod["spec"].get("volumes") or [] if v["name"] == children.TLS_VOLUME]
        env = {e["name"]: e.get("value") for e in main_of(pod)["env"]}
        assert [env[n] for n in TLS_ENV] == ["", "", ""]


def test_cluster_domain_names_are_in_the_certificate():
    plan, _ = pods_planned(api_job(), config=children.PlanConfig(cluster_domain="cluster.local"))
    (secret,) = plan.of(A.CreateSecret)
    assert {"sec-ps-0.ns.svc", "sec-ps-0.ns.svc.cluster.local"} <= set(secret.tls_hosts)


def test_bad_tls_mode_names_the_field_and_the_choices():
    with pytest.raises(models.SpecError) as err:
        models.parse_spec({**api_job()["spec"], "security": {"tls": {"mode": "Plaintext"}}})
    assert "security.tls.mode" in str(err.value) and "MutualTLS" in str(err.value) and "Plaintext" in str(err.value)


def test_added_workers_get_the_certificate_issued_again():
    secret = {"metadata": {"name": "sec-kubeps-token", "annotations": {children.ANNOTATION_TLS_WORKERS: "2"}}}
    plan, _ = pods_planned(api_job(workers=2), secret)
    assert not plan.of(A.ReissueCertificate)
    plan, _ = pods_planned(api_job(workers=3), secret)
    (reissue,) = plan.of(A.ReissueCertificate)
    assert reissue.tls_workers == 3 and "sec-worker-2.ns.svc" in reissue.tls_hosts
    plan, _ = pods_planned(api_job({"tls": {"mode": "Disabled"}}, workers=3), secret)
    assert not plan.of(A.ReissueCertificate)


def test_added_parameter_servers_get_the_certificate_issued_again():
    """A ps count raised on a running job (docs/elastic.md): the new ps's name must be in the certificate, or the
    restarted chief cannot reach it over mutual TLS. A Secret made before the PS annotation existed is taken as
    covering."""
    annotations = {children.ANNOTATION_TLS_WORKERS: "2", children.ANNOTATION_TLS_PS: "2"}
    secret = {"metadata": {"name": "sec-kubeps-token", "annotations": annotations}}
    job = api_job()
    job["spec"]["replicaSpecs"]["PS"]["replicas"] = 2
    plan, _ = pods_planned(job, secret)
    assert not plan.of(A.ReissueCertificate)
    job["spec"]["replicaSpecs"]["PS"]["replicas"] = 3
    plan, pods = pods_planned(job, secret)
    (reissue,) = plan.of(A.ReissueCertificate)
    assert (reissue.tls_workers, reissue.tls_ps) == (2, 3) and "sec-ps-2.ns.svc" in reissue.tls_hosts
    older = {"metadata": {"name": "sec-kubeps-token", "annotations": {children.ANNOTATION_TLS_WORKERS: "2"}}}
    plan, _ = pods_planned(job, older)
    assert not plan.of(A.ReissueCertificate)
    (created,) = pods_planned(job)[0].of(A.CreateSecret)
    assert (created.tls_workers, created.tls_ps) == (2, 3)


def test_network_policy_from_the_spec_or_the_operators_default():
    plan, _ = pods_planned(api_job())
    assert not plan.of(A.CreateNetworkPolicy)
    plan, _ = pods_planned(api_job({"networkPolicy": {"mode": "SameJob"}}))
    (policy,) = plan.of(A.CreateNetworkPolicy)
    own = {"matchLabels": {children.LABEL_JOB: "sec"}}
    # the job's pods from the job's pods; the metrics port (the operator's progress reads, Prometheus) from any pod
    assert policy.body["spec"] == {"podSelector": own, "policyTypes": ["Ingress"], "ingress": [
        {"from": [{"podSelector": own}]},
        {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": "metrics"}]}]}
    same_job = children.PlanConfig(network_policy=models.NetworkPolicyMode.SAME_JOB)
    assert pods_planned(api_job(), config=same_job)[0].of(A.CreateNetworkPolicy)
    assert not pods_planned(api_job({"networkPolicy": {"mode": "None"}}), config=same_job)[0].of(A.CreateNetworkPolicy)
    secret = {"metadata": {"name": "sec-kubeps-token"}}
    assert not pods_planned(api_job(), secret, config=same_job, network_policy=True)[0].of(A.CreateNetworkPolicy)
    # seen made, but the Secret gone: asked for again with the new Secret (a create that finds it is a no-op)
    assert pods_planned(api_job(), None, config=same_job, network_policy=True)[0].of(A.CreateNetworkPolicy)


def test_restricted_defaults_fill_in_and_keep_what_the_template_sets():
    _, pods = pods_planned(api_job())
    for pod in pods.values():
        assert pod["spec"]["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        for c in pod["spec"]["containers"]:
            assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    mine = {"name": "kubeps", "image": "x", "securityContext": {
        "runAsNonRoot": False, "allowPrivilegeEscalation": True, "capabilities": {"add": ["NET_ADMIN"], "drop": []}}}
    init = {"name": "init", "image": "x"}
    template = {"spec": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}, "containers": [mine],
                         "initContainers": [init]}}
    _, pods = pods_planned(api_job(templates={"Worker": template}))
    pod = pods["sec-worker-0"]
    assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "Unconfined"}}  # and no runAsNonRoot
    assert pod["spec"]["containers"][0]["securityContext"] == mine["securityContext"]
    assert pod["spec"]["initContainers"][0]["securityContext"] == {"allowPrivilegeEscalation": False,
                                                                   "capabilities": {"drop": ["ALL"]}}


# ------------------------------------------------------------------------------------------------ control plane
def _secret_files(kube, ns, name="sec"):
    secret = kube.core().read_namespaced_secret(f"{name}-kubeps-token", ns)
    return secret, {k: base64.b64decode(v) for k, v in secret.data.items()}


def _names(cert_pem: bytes) -> set[str]:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName))


def test_secret_holds_the_jobs_ca_and_certificate_reissued_for_added_workers(kube, ns):
    create_job(kube, ns, job_manifest("sec", workers=2))
    wait_state(kube, ns, "sec", "Running")
    secret, files = _secret_files(kube, ns)
    assert set(files) == {"token", "ca.crt", "ca.key", "tls.crt", "tls.key"}
    ca = x509.load_pem_x509_certificate(files["ca.crt"])
    x509.load_pem_x509_certificate(files["tls.crt"]).verify_directly_issued_by(ca)
    assert {f"sec-{t}.{ns}.svc" for t in ("chief-0", "ps-0", "worker-0", "worker-1")} <= _names(files["tls.crt"])
    pod = pods_of(kube, ns, "sec")["sec-worker-0"]
    (volume,) = [v for v in pod.spec.volumes if v.name == "kubeps-tls"]
    assert sorted(i.key for i in volume.secret.items) == ["ca.crt", "tls.crt", "tls.key"]

    patch_job(kube, ns, "sec", {"spec": {"replicaSpecs": {"Worker": {"replicas": 3}}}})
    kube.wait_for(lambda: "sec-worker-2" in pods_of(kube, ns, "sec"), timeout=30, what="worker 2")
    _, after = _secret_files(kube, ns)
    assert f"sec-worker-2.{ns}.svc" in _names(after["tls.crt"])
    assert after["ca.crt"] == files["ca.crt"] and after["token"] == files["token"]  # running pods keep trusting it


def test_lost_secret_gets_a_new_ca(kube, ns):
    create_job(kube, ns, job_manifest("sec", workers=1))
    wait_state(kube, ns, "sec", "Running")
    _, before = _secret_files(kube, ns)
    kube.core().delete_namespaced_secret("sec-kubeps-token", ns)

    def remade():
        try:
            _, files = _secret_files(kube, ns)
        except Exception:  # noqa: BLE001 - not there yet
            return None
        return files if files["ca.crt"] != before["ca.crt"] else None

    # a reconcile happens when a pod changes: the restart for the lost Secret
    kube.core().delete_namespaced_pod("sec-worker-0", ns)
    after = kube.wait_for(remade, timeout=60, what="a new Secret with a new CA")
    assert after["ca.key"] != before["ca.key"] and after["token"] != before["token"]


def test_security_is_immutable_on_a_running_job(kube, ns):
    from kubernetes.client.exceptions import ApiException

    create_job(kube, ns, job_manifest("sec", workers=1))
    with pytest.raises(ApiException) as err:
        patch_job(kube, ns, "sec", {"spec": {"security": {"tls": {"mode": "Disabled"}}}})
    assert err.value.status == 422 and "spec.security is immutable" in err.value.body
    assert get_job(kube, ns, "sec")["spec"]["security"] == {"tls": {"mode": "MutualTLS"}, "networkPolicy": {}}


def test_same_job_network_policy_is_created_and_owned(kube, ns):
    manifest = job_manifest("sec", workers=1)
    manifest["spec"]["security"] = {"networkPolicy": {"mode": "SameJob"}}
    job = create_job(kube, ns, manifest)
    wait_state(kube, ns, "sec", "Running")
    from kubernetes import client

    policy = kube.wait_for(lambda: client.NetworkingV1Api(kube.api_client).read_namespaced_network_policy(
        "sec-kubeps", ns), timeout=30, what="the NetworkPolicy")
    assert policy.metadata.owner_references[0].uid == job["metadata"]["uid"]
    assert policy.spec.pod_selector.match_labels == {"kubeps.dev/job-name": "sec"}
    assert policy.spec.ingress[0]._from[0].pod_selector.match_labels == {"kubeps.dev/job-name": "sec"}


def test_pods_pass_the_restricted_pod_security_standard(kube, operator):
    """In a namespace enforcing ``restricted`` the API server refuses a pod that fails it: every pod is made, the
    job runs, with or without TLS and with an evaluator."""
    name = make_namespace(kube)
    try:
        kube.core().patch_namespace(name, {"metadata": {"labels": {
            "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})
        create_job(kube, name, job_manifest("sec", ps=2, workers=2, evaluator=1))
        plain = job_manifest("plain", workers=1)
        plain["spec"]["security"] = {"tls": {"mode": "Disabled"}}
        create_job(kube, name, plain)
        wait_state(kube, name, "sec", "Running")
        wait_state(kube, name, "plain", "Running")
        assert len(pods_of(kube, name, "sec")) == 6 and len(pods_of(kube, name, "plain")) == 3
        # the control: a pod the standard refuses is refused there
        from kubernetes.client.exceptions import ApiException

        with pytest.raises(ApiException) as err:
            kube.core().create_namespaced_pod(name, {"metadata": {"name": "bare"}, "spec": {"containers": [
                {"name": "c", "image": "registry.test/app:1"}]}})
        assert err.value.status == 403 and "restricted" in err.value.body
    finally:
        delete_namespace(kube, name)
