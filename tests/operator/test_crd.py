"""The CRD is generated from the pydantic models; the committed YAML must match the generator."""

from __future__ import annotations

from pathlib import Path

import yaml

from kubeps.operator.api import crd, models

REPO = Path(__file__).resolve().parents[2]


def _walk(node, path=""):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def test_deploy_crd_yaml_matches_the_models():
    committed = (REPO / "deploy" / "crd.yaml").read_text()
    assert committed == crd.crd_yaml(), (
        "deploy/crd.yaml drifted from operator/api/models.py: run "
        "`python -m kubeps.operator.api.crd > deploy/crd.yaml` and commit it")


def test_crd_is_structural():
    schema = crd.generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        assert node.get("additionalProperties") not in (True, False), path
        if "properties" in node or "items" in node:
            assert "type" in node, f"{path} has no type"


def test_crd_names_defaults_and_rules():
    doc = crd.generate_crd()
    assert doc["metadata"]["name"] == "pstrainingjobs.kubeps.dev"
    assert doc["spec"]["names"]["shortNames"] == ["psjob"]
    version = doc["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicaSpecs.Worker.replicas",
        "statusReplicasPath": ".status.replicaStatuses.Worker.active", "labelSelectorPath": ".status.workerSelector"}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "State", "Chief", "PS", "Workers", "Restarts", "Step", "Examples/s", "Checkpoint", "Age"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    run_policy = spec["properties"]["runPolicy"]
    assert run_policy["default"] == {}
    assert run_policy["properties"]["cleanPodPolicy"]["default"] == "Running"
    assert run_policy["properties"]["backoffLimit"]["default"] == 6
    chief = spec["properties"]["replicaSpecs"]["properties"]["Chief"]["properties"]["replicas"]
    assert (chief["minimum"], chief["maximum"]) == (1, 1)
    rules = [r["fieldPath"] for r in spec["x-kubernetes-validations"]]
    assert {".replicaSpecs.PS.template", ".replicaSpecs.Worker.template"} <= set(rules)
    assert ".replicaSpecs.PS" not in rules and ".replicaSpecs.Worker" not in rules  # replicas may change
    root_rules = version["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert root_rules == models.NAME_RULES


def test_cli_prints_the_yaml(capsys):
    assert crd.main([]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["kind"] == "CustomResourceDefinition"


def test_each_role_s_default_restart_policy_is_the_lifecycle_table_s():
    """One default per role for the operator and ``kubeps local --restart``: the models (which the planner parses a
    job with) and the CRD (which the API server defaults with) take it from :data:`kubeps.runtime.lifecycle.ROLES`."""
    from kubeps.runtime import lifecycle

    table = {role: spec.policy for role, spec in lifecycle.ROLES.items()}
    specs = crd.generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["replicaSpecs"]["properties"]
    assert {rt.task_type: specs[rt.value]["properties"]["restartPolicy"]["default"]
            for rt in models.REPLICA_TYPES} == table
    template = {"spec": {"containers": [{"name": "x", "image": "i"}]}}
    parsed = models.parse_spec({"replicaSpecs": {rt.value: {"template": template} for rt in models.REPLICA_TYPES}})
    assert {rt.task_type: parsed.replicaSpecs.get(rt).restartPolicy.value for rt in models.REPLICA_TYPES} == table
    assert table == {"chief": "ExitCode", "ps": "Always", "worker": "OnFailure", "evaluator": "OnFailure"}
