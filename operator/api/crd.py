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


PRINTER_COLUMNS = [
    {"name": "State", "type": "string", "jsonPath": ".status.state", "description": "Latest condition"},
    {"name": "Chief", "type": "string", "jsonPath": ".status.chief", "description": "Chief pod phase"},
    {"name": "PS", "type": "string", "jsonPath": ".status.ps", "description": "Ready/total parameter servers"},
    {"name": "Workers", "type": "string", "jsonPath": ".status.workers", "description": "Ready/total workers"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "description": "Pod restarts"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def generate_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    root = {
        "type": "object",
        "description": "Parameter-server training job: a chief, parameter servers, workers and an optional "
        "evaluator, each a pod with a headless Service and TF_CONFIG.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
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
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = "# Generated by `python -m kubeps.operator.api.crd` from operator/api/models.py. Do not edit.\n"


def crd_yaml() -> str:
    import yaml  # noqa: PLC0415 - pyyaml: the generator runs from the test extra

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return HEADER + yaml.dump(generate_crd(), Dumper=_NoAliases, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:  # noqa: ARG001 - takes no arguments
    sys.stdout.write(crd_yaml())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
