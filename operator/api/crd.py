"""Generate the PSTrainingJob CustomResourceDefinition from the pydantic models.

``python -m kubeps.operator.api.crd`` prints the CRD as YAML. ``deploy/crd.yaml`` (and the Helm chart's copy) is this
output, committed; a test fails when it drifts from the models. Use :func:`crd_yaml` to write it elsewhere.

The JSON schema pydantic produces is turned into a *structural* OpenAPI v3 schema as the API server requires:
``$ref`` inlined, ``Optional[X]`` (``anyOf: [X, null]``) turned into ``X``, ``title`` and
``additionalProperties: true`` dropped (``x-kubernetes-preserve-unknown-fields`` says it instead), defaults kept,
``x-kubernetes-*`` markers and CEL rules kept as written in the models.
"""

from __future__ import annotations

import sys
from typing import Any

from . import models

_DROP = {"title", "$defs"}


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """A structural OpenAPI v3 schema from a pydantic JSON schema (with its ``$defs``)."""
    defs = schema.get("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, list):
            return [resolve(item) for item in node]
        if not isinstance(node, dict):
            return node
        node = dict(node)
        if "$ref" in node:
            target = defs[node.pop("$ref").split("/")[-1]]
            merged = dict(target)
            merged.update(node)  # description/default on the referring field win
            node = merged
        if "anyOf" in node:
            branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
            if len(branches) != 1:
                raise ValueError(f"cannot express anyOf {branches!r} in a structural schema")
            merged = dict(branches[0])
            merged.update(node)
            if merged.get("default", 0) is None:
                del merged["default"]
            return resolve(merged)
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _DROP:
                continue
            if key == "additionalProperties":
                if value is True:
                    out["x-kubernetes-preserve-unknown-fields"] = True
                    continue
                if value is False:
                    continue
                out[key] = resolve(value)
            elif key == "properties":
                out[key] = {name: resolve(sub) for name, sub in value.items()}
            elif key == "items":
                out[key] = resolve(value)
            elif key == "default" and value is None:
                continue
            elif key == "description" and isinstance(value, str):
                out[key] = " ".join(value.split())  # docstrings wrap; kubectl explain wraps by itself
            else:
                out[key] = value
        if "enum" in out and "type" not in out:
            out["type"] = "string"
        if "properties" in out and "type" not in out:
            out["type"] = "object"
        if out.get("x-kubernetes-preserve-unknown-fields") and "properties" in out:
            out.pop("additionalProperties", None)
        return out

    resolved: dict[str, Any] = resolve({k: v for k, v in schema.items()})
    return resolved


def spec_schema() -> dict[str, Any]:
    return structural(models.PSTrainingJobSpec.model_json_schema(mode="validation"))


def status_schema() -> dict[str, Any]:
    schema = structural(models.PSTrainingJobStatus.model_json_schema(mode="serialization"))
    schema.pop("required", None)
    return schema


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "State", "type": "string", "jsonPath": ".status.state", "description": "Latest condition"},
    {"name": "Chief", "type": "string", "jsonPath": ".status.chief", "description": "Chief pod phase"},
    {"name": "PS", "type": "string", "jsonPath": ".status.ps", "description": "Ready/total parameter servers"},
    {"name": "Workers", "type": "string", "jsonPath": ".status.workers", "description": "Ready/total workers"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "description": "Pod restarts"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step", "description": "Training step (chief)"},
    {"name": "Examples/s", "type": "string", "jsonPath": ".status.progress.examplesPerSecond",
     "description": "Examples per second (chief's metrics)"},
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.progress.lastCheckpointStep",
     "description": "Step of the last checkpoint", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


API_VERSION_DOC = (
    "APIVersion defines the versioned schema of this representation of an object: "
    f"{models.API_VERSION}."
)
KIND_DOC = f"Kind is a string value representing the REST resource this object represents: {models.KIND}."
METADATA_DOC = (
    f"Standard object's metadata. metadata.name must be a DNS-1035 label of at most {models.MAX_JOB_NAME} "
    "characters (children are named <job>-<type>-<index>)."
)


def generate_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    root = {
        "type": "object",
        "description": "Parameter-server training job: a chief, parameter servers, workers and an optional "
        "evaluator, each a pod with a headless Service and TF_CONFIG.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": API_VERSION_DOC},
            "kind": {"type": "string", "description": KIND_DOC},
            "metadata": {"type": "object"},  # the API server allows nothing more here
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "x-kubernetes-validations": models.NAME_RULES,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{models.PLURAL}.{models.GROUP}",
            "labels": {"app.kubernetes.io/name": "kubeps", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": models.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": models.KIND,
                "listKind": f"{models.KIND}List",
                "plural": models.PLURAL,
                "singular": models.SINGULAR,
                "shortNames": list(models.SHORT_NAMES),
                "categories": ["all", "kubeps"],
            },
            "versions": [
                {
                    "name": models.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    # kubectl scale psjob NAME --replicas N, an HPA or KEDA: the Worker replicas (docs/elastic.md)
                    "subresources": {"status": {}, "scale": {
                        "specReplicasPath": ".spec.replicaSpecs.Worker.replicas",
                        "statusReplicasPath": ".status.replicaStatuses.Worker.active",
                        "labelSelectorPath": ".status.workerSelector",
                    }},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def json_schema() -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of a whole PSTrainingJob manifest, for editors (yaml-language-server) and
    ``kubeps validate``: the CRD's schema with ``additionalProperties: false`` wherever the API server's strict
    field validation refuses unknown fields (everywhere but the preserved pod template), and ``apiVersion``,
    ``kind`` and ``metadata.name`` required as a manifest needs them. The ``x-kubernetes-*`` markers and CEL rules
    stay (validators ignore unknown keywords; ``kubeps validate`` applies the rules)."""

    def close(node: Any) -> Any:
        if isinstance(node, list):
            return [close(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: close(value) if key in ("properties", "items") or isinstance(value, dict) and key != "default"
               else value for key, value in node.items()}
        if "properties" in node:
            out["properties"] = {name: close(sub) for name, sub in node["properties"].items()}
            if not node.get("x-kubernetes-preserve-unknown-fields"):
                out["additionalProperties"] = False
        if node.get("x-kubernetes-list-type") == "set":
            out["uniqueItems"] = True
        return out

    root = close(generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    root["required"] = ["apiVersion", "kind", "metadata", "spec"]
    root["properties"]["apiVersion"]["const"] = models.API_VERSION
    root["properties"]["kind"]["const"] = models.KIND
    metadata = root["properties"]["metadata"]
    metadata.update({"description": METADATA_DOC, "required": ["name"], "properties": {"name": {"type": "string"}},
                     "x-kubernetes-preserve-unknown-fields": True})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://{models.GROUP}/schemas/{models.VERSION}/{models.SINGULAR}.json",
        "title": f"{models.KIND} ({models.API_VERSION})",
        **root,
    }


def json_schema_text() -> str:
    import json  # noqa: PLC0415

    return json.dumps(json_schema(), indent=2, sort_keys=False) + "\n"


HEADER = "# Generated by `python -m kubeps.operator.api.crd` from operator/api/models.py. Do not edit.\n"


def crd_yaml() -> str:
    import yaml  # noqa: PLC0415 - pyyaml: the generator runs from the test extra

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return HEADER + yaml.dump(generate_crd(), Dumper=_NoAliases, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    """Print the CRD as YAML, or with ``--json-schema`` the manifest's JSON Schema."""
    args = sys.argv[1:] if argv is None else argv
    sys.stdout.write(json_schema_text() if args == ["--json-schema"] else crd_yaml())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
