"""Invalid PSTrainingJobs are rejected by the real API server (generated schema + CEL), naming the field; and
``kubeps validate`` agrees with it: what it refuses the API server's strict field validation and CEL rules refuse,
naming the same fields, and what it accepts is accepted; ``kubectl explain`` shows the CRD's descriptions."""

from __future__ import annotations

import copy
import json

import pytest

from kubeps.operator.api.validate import validate_manifest

from .conftest import GROUP, PLURAL, REPO, VERSION, container, delete_namespace, job_manifest, make_namespace


@pytest.fixture(scope="module")
def namespace(crd, kube):
    """One namespace for the whole module (no operator watches it: names do not match ``kop-*``)."""
    name = make_namespace(kube, prefix="kval-")
    yield name
    delete_namespace(kube, name)


def _set(path: str, value):
    def mutate(manifest: dict) -> None:
        node = manifest
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        last = parts[-1]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


_DELETE = object()
RS = "spec.replicaSpecs"

# (id, mutation, text the API server's message must contain: the field and what is wrong)
INVALID = [
    ("no-replica-specs", _set("spec.replicaSpecs", _DELETE), "spec.replicaSpecs: Required value"),
    ("no-chief", _set(f"{RS}.Chief", _DELETE), "spec.replicaSpecs.Chief: Required value"),
    ("no-ps", _set(f"{RS}.PS", _DELETE), "spec.replicaSpecs.PS: Required value"),
    ("no-worker", _set(f"{RS}.Worker", _DELETE), "spec.replicaSpecs.Worker: Required value"),
    ("two-chiefs", _set(f"{RS}.Chief.replicas", 2), "spec.replicaSpecs.Chief.replicas"),
    ("zero-chiefs", _set(f"{RS}.Chief.replicas", 0), "spec.replicaSpecs.Chief.replicas"),
    ("zero-ps", _set(f"{RS}.PS.replicas", 0), "spec.replicaSpecs.PS.replicas"),
    ("too-many-ps", _set(f"{RS}.PS.replicas", 101), "spec.replicaSpecs.PS.replicas"),
    ("zero-workers", _set(f"{RS}.Worker.replicas", 0), "spec.replicaSpecs.Worker.replicas"),
    ("too-many-workers", _set(f"{RS}.Worker.replicas", 1001), "spec.replicaSpecs.Worker.replicas"),
    ("workers-not-int", _set(f"{RS}.Worker.replicas", "three"), "spec.replicaSpecs.Worker.replicas"),
    ("two-evaluators", _set(f"{RS}.Evaluator", {"replicas": 2, "template": {"spec": {"containers": [container()]}}}),
     "spec.replicaSpecs.Evaluator.replicas"),
    ("bad-restart-policy", _set(f"{RS}.PS.restartPolicy", "Sometimes"), "spec.replicaSpecs.PS.restartPolicy"),
    ("no-template", _set(f"{RS}.Worker.template", _DELETE), "spec.replicaSpecs.Worker.template: Required value"),
    ("no-containers", _set(f"{RS}.Chief.template.spec.containers", []), "spec.replicaSpecs.Chief.template.spec.containers"),
    ("container-without-name", _set(f"{RS}.PS.template.spec.containers", [{"image": "x"}]),
     "spec.replicaSpecs.PS.template.spec.containers[0].name: Required value"),
    ("duplicate-container-names", _set(f"{RS}.Worker.template.spec.containers", [container(), container()]),
     "spec.replicaSpecs.Worker.template.spec.containers[1]: Duplicate value"),
    ("port-out-of-range", _set(f"{RS}.Chief.template.spec.containers.0.ports",
                               [{"name": "kubeps-port", "containerPort": 70000}]),
     "spec.replicaSpecs.Chief.template.spec.containers[0].ports[0].containerPort"),
    ("port-name-too-long", _set(f"{RS}.Chief.template.spec.containers.0.ports",
                                [{"name": "a-very-long-port-name", "containerPort": 2222}]),
     "spec.replicaSpecs.Chief.template.spec.containers[0].ports[0].name"),
    ("bad-clean-pod-policy", _set("spec.runPolicy.cleanPodPolicy", "Some"), "spec.runPolicy.cleanPodPolicy"),
    ("negative-backoff", _set("spec.runPolicy.backoffLimit", -1), "spec.runPolicy.backoffLimit"),
    ("zero-deadline", _set("spec.runPolicy.activeDeadlineSeconds", 0), "spec.runPolicy.activeDeadlineSeconds"),
    ("negative-ttl", _set("spec.runPolicy.ttlSecondsAfterFinished", -5), "spec.runPolicy.ttlSecondsAfterFinished"),
    ("negative-evaluator-grace", _set("spec.runPolicy.evaluatorGraceSeconds", -1),
     "spec.runPolicy.evaluatorGraceSeconds"),
    ("suspend-not-bool", _set("spec.runPolicy.suspend", "yes"), "spec.runPolicy.suspend"),
    ("exit-code-0", _set("spec.runPolicy.retryableExitCodes", [0]), "spec.runPolicy.retryableExitCodes[0]"),
    ("exit-code-300", _set("spec.runPolicy.retryableExitCodes", [300]), "spec.runPolicy.retryableExitCodes[0]"),
    ("duplicate-exit-codes", _set("spec.runPolicy.retryableExitCodes", [137, 137]),
     "spec.runPolicy.retryableExitCodes[1]: Duplicate value"),
    ("min-available-0", _set("spec.runPolicy.schedulingPolicy", {"minAvailable": 0}),
     "spec.runPolicy.schedulingPolicy.minAvailable"),
    ("min-available-beyond-the-gang", _set("spec.runPolicy.schedulingPolicy", {"minAvailable": 5}),
     "spec.runPolicy.schedulingPolicy.minAvailable must be at most the gang's size"),
    ("bad-quantity", _set("spec.runPolicy.schedulingPolicy", {"minResources": {"cpu": "two"}}),
     "spec.runPolicy.schedulingPolicy.minResources.cpu"),
    ("bad-success-policy", _set("spec.successPolicy", "AnyWorker"), "spec.successPolicy"),
    ("all-workers-with-always", lambda m: (_set("spec.successPolicy", "AllWorkers")(m),
                                           _set(f"{RS}.Worker.restartPolicy", "Always")(m)),
     "spec.successPolicy: Forbidden: spec.successPolicy AllWorkers needs every worker to exit 0"),
    ("name-too-long", _set("metadata.name", "a" * 52), "metadata.name must be at most 51 characters"),
    ("name-starts-with-digit", _set("metadata.name", "1job"), "metadata.name must start with a lower-case letter"),
]


@pytest.mark.parametrize("mutate,expected", [pytest.param(m, e, id=i) for i, m, e in INVALID])
def test_invalid_manifest_is_rejected_naming_the_field(crd, kube, namespace, mutate, expected):
    from kubernetes.client.exceptions import ApiException

    manifest = copy.deepcopy(job_manifest("valid-name"))
    mutate(manifest)
    with pytest.raises(ApiException) as info:
        kube.custom().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest, dry_run="All")
    assert info.value.status == 422, info.value.body
    assert expected in info.value.body, info.value.body


def test_the_valid_base_manifest_is_accepted_with_defaults(crd, kube, namespace):
    manifest = job_manifest("valid-name")
    manifest["spec"].pop("runPolicy")
    for role in ("Chief", "PS", "Worker"):
        del manifest["spec"]["replicaSpecs"][role]["restartPolicy"]
    created = kube.custom().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest,
                                                            dry_run="All")
    assert created["spec"]["runPolicy"] == {"cleanPodPolicy": "Running", "evaluatorGraceSeconds": 60, "backoffLimit": 6,
                                            "suspend": False}
    # each role's default is the lifecycle table's (kubeps.runtime.lifecycle.ROLES), as kubeps local's
    assert {role: created["spec"]["replicaSpecs"][role]["restartPolicy"] for role in ("Chief", "PS", "Worker")} == \
        {"Chief": "ExitCode", "PS": "Always", "Worker": "OnFailure"}


IMMUTABLE = [
    ("chief-template", {"Chief": {"template": {"spec": {"containers": [container(image="other:2")]}}}},
     "spec.replicaSpecs.Chief: Forbidden"),
    ("ps-template", {"PS": {"template": {"spec": {"containers": [container(image="other:2")]}}}},
     "spec.replicaSpecs.PS.template: Forbidden"),
    ("ps-restart-policy", {"PS": {"restartPolicy": "Never"}}, "spec.replicaSpecs.PS.restartPolicy"),
    ("worker-template", {"Worker": {"template": {"spec": {"containers": [container(), {"name": "side"}]}}}},
     "spec.replicaSpecs.Worker.template: Forbidden"),
    ("worker-restart-policy", {"Worker": {"restartPolicy": "Never"}}, "spec.replicaSpecs.Worker.restartPolicy"),
    ("add-evaluator", {"Evaluator": {"template": {"spec": {"containers": [container()]}}}},
     "spec.replicaSpecs.Evaluator: Forbidden"),
]


def test_running_job_fields_are_immutable_but_worker_and_ps_replicas_and_run_policy_change(crd, kube, namespace):
    from kubernetes.client.exceptions import ApiException

    custom = kube.custom()
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job_manifest("imm"))

    def patch(body):
        return custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "imm", body,
                                                     _content_type="application/merge-patch+json")

    for name, replica_specs, expected in IMMUTABLE:
        with pytest.raises(ApiException) as info:
            patch({"spec": {"replicaSpecs": replica_specs}})
        assert info.value.status == 422 and expected in info.value.body, (name, info.value.body)
        assert "immutable unless the job is suspended" in info.value.body
    # Allowed on a running job: Worker and PS replicas (docs/elastic.md) and runPolicy.
    patched = patch({"spec": {"replicaSpecs": {"Worker": {"replicas": 5}, "PS": {"replicas": 3}},
                              "runPolicy": {"backoffLimit": 2, "ttlSecondsAfterFinished": 60}}})
    assert (patched["spec"]["replicaSpecs"]["Worker"]["replicas"], patched["spec"]["replicaSpecs"]["PS"]["replicas"]) \
        == (5, 3)
    # A suspended job may change its templates (e.g. a queue controller setting node selectors).
    patch({"spec": {"runPolicy": {"suspend": True}}})
    patched = patch({"spec": {"replicaSpecs": {"PS": {"restartPolicy": "Never"}}}})
    assert patched["spec"]["replicaSpecs"]["PS"]["restartPolicy"] == "Never"


def _job_files() -> list:
    """examples/jobs/*.yaml that hold a PSTrainingJob (tensorboard.yaml holds the PVC and Deployment beside one)."""
    return sorted(p for p in (REPO / "examples" / "jobs").glob("*.yaml") if "\nkind: PSTrainingJob" in p.read_text())


@pytest.mark.parametrize("path", _job_files(), ids=lambda p: p.name)
def test_sample_manifests_are_accepted(crd, kube, namespace, path):
    import yaml

    from kubeps.operator.api import models

    manifest = yaml.safe_load(path.read_text())
    created = kube.custom().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest,
                                                            dry_run="All")
    models.parse_spec(created["spec"])  # and the operator reads them as the API server stored them


# -- kubeps validate agrees with this API server ---------------------------------------------------------------
def _mutated(path: str, value):
    manifest = copy.deepcopy(job_manifest("agree"))
    _set(path, value)(manifest)
    return manifest


CASES = [
    ("valid", job_manifest("agree"), []),
    ("underscore-name", _mutated("metadata.name", "job_x"), ["metadata.name"]),
    ("digit-first-name", _mutated("metadata.name", "1job"), ["metadata.name"]),
    ("long-name", _mutated("metadata.name", "a" * 52), ["metadata.name"]),
    ("backoffLimt", _mutated("spec.runPolicy.backoffLimt", 3), ["spec.runPolicy.backoffLimt"]),
    ("replica", _mutated("spec.replicaSpecs.PS.replica", 2), ["spec.replicaSpecs.PS.replica"]),
    ("two-chiefs", _mutated("spec.replicaSpecs.Chief.replicas", 2), ["spec.replicaSpecs.Chief.replicas"]),
    ("exit-codes", _mutated("spec.runPolicy.retryableExitCodes", [137, 137]), ["spec.runPolicy.retryableExitCodes"]),
    ("min-available", _mutated("spec.runPolicy.schedulingPolicy", {"minAvailable": 9}),
     ["spec.runPolicy.schedulingPolicy.minAvailable"]),
    ("quantity", _mutated("spec.runPolicy.schedulingPolicy", {"minResources": {"memory": "4GB"}}),
     ["spec.runPolicy.schedulingPolicy.minResources.memory"]),
    ("scheduling-policy-fields", _mutated("spec.runPolicy.schedulingPolicy", {
        "minAvailable": 3, "queue": "q", "priorityClass": "high", "scheduleTimeoutSeconds": 60,
        "minResources": {"cpu": "1500m", "memory": 4 * 2**30}}), []),
    ("unknown-in-template-is-kept", _mutated("spec.replicaSpecs.PS.template.spec.nodeSelectr", {"a": "b"}), []),
]


@pytest.mark.parametrize("manifest, fields", [pytest.param(m, f, id=i) for i, m, f in CASES])
def test_kubeps_validate_and_the_api_server_agree(crd, kube, namespace, manifest, fields):
    from kubernetes.client.exceptions import ApiException

    ours = validate_manifest(manifest, "case")
    assert sorted({p.field for p in ours}) == sorted(fields), [str(p) for p in ours]
    api = kube.custom()
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest, dry_run="All",
                                            field_validation="Strict")
        refused = None
    except ApiException as err:
        refused = err
    if not fields:
        assert refused is None, refused.body
        return
    assert refused is not None and refused.status in (400, 422), "the API server accepted what kubeps refuses"
    body = json.loads(refused.body)
    for field in fields:
        assert field.split("[")[0] in body["message"], (field, body["message"])


def test_kubectl_explain_shows_the_descriptions(crd, kube):
    out = kube.kubectl("explain", "pstrainingjobs.spec.runPolicy").stdout
    assert "How the job runs as a whole" in out and "backoffLimit" in out
    out = kube.kubectl("explain", "pstrainingjobs.spec.replicaSpecs").stdout
    assert "The job's roles" in out
