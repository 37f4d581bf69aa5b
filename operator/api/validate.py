"""``kubeps validate FILE...``: check PSTrainingJob manifests before ``kubectl apply``, every error at once.

What the API server would refuse, without one:

* the schema the CRD carries (:func:`kubeps.operator.api.crd.json_schema`, generated from :mod:`.models`): types,
  required fields, enums, bounds, patterns, ``x-kubernetes-list-type`` sets and maps;
* unknown fields, as the API server's strict field validation refuses them (``kubectl apply`` with
  ``--validate=strict``, the default): ``unknown field "spec.runPolicy.backoffLimt"``, with the closest known
  field. The pod template is kept as written by the CRD (``x-kubernetes-preserve-unknown-fields``), so the API
  server checks nothing inside it, and neither does this;
* the CRD's CEL rules (``x-kubernetes-validations``), the very rule strings of the generated CRD, evaluated with
  ``cel-python``; transition rules (those reading ``oldSelf``: immutable fields) need the stored object and are
  left to the API server. A rule on ``metadata.name`` also says what is wrong with the name (``'_' at index 3``).

A file is read as kubectl reads it (:mod:`.kubectl_yaml`): what is checked is the JSON the API server would
receive, so YAML that kubectl refuses (an alias bomb, NaN, an invalid Unicode escape, a null key) or a document over
the API server's 3 MiB request limit is refused here too, quickly and naming the field. Field validation is
kubectl's: ``Strict`` by default (an unknown field is an error), ``Warn`` (accepted, each unknown field a warning,
as the API server answers a client that asks for no field validation) or ``Ignore``.

Pure: it takes the texts and returns the problems, the lines to print and the exit status (0 every manifest is
valid, 1 a manifest is invalid); the ``kubeps`` command (:mod:`kubeps.runtime.cli`) reads the files, prints, and
answers a usage error (no file, an unreadable one) with 2. jsonschema, cel-python and pyyaml are imported only
when it runs (``kubeps[validate]``). It never raises on a file's content: a check that fails unexpectedly is
reported as that document's problem.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator, Sequence

from . import crd, kubectl_yaml, models

__all__ = ["FIELD_VALIDATION", "Problem", "check_files", "missing_dependency", "validate_manifest", "validate_text"]

EXIT_OK, EXIT_INVALID = 0, 1
#: kubectl's ``--validate`` values, as the API server's ``fieldValidation`` names them: what an unknown field is.
FIELD_VALIDATION = ("Strict", "Warn", "Ignore")
_UNKNOWN = 'unknown field "'


@dataclass(frozen=True)
class Problem:
    """One error: where (``file``, the document's index and name) and what (``field``, ``message``)."""

    source: str
    field: str
    message: str
    warning: bool = False

    def __str__(self) -> str:
        where = f"{self.source}: {self.field}: " if self.field else f"{self.source}: "
        return f"{where}{'Warning: ' if self.warning else ''}{self.message}"


_STRING, _INTEGER = {"type": "string"}, {"type": "integer"}
_STRINGS_MAP = {"type": "object", "additionalProperties": _STRING}
_OBJECTS = {"type": "array", "items": {"type": "object"}}
#: The API server's ObjectMeta, as its strict field validation knows it: any other field of ``metadata`` is unknown.
#: Only the types are checked here; the name's rules are the CRD's CEL rules, other values the API server's.
OBJECT_META: dict[str, Any] = {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {"name": _STRING, "generateName": _STRING, "namespace": _STRING, "selfLink": _STRING,
                   "uid": _STRING, "resourceVersion": _STRING, "generation": _INTEGER,
                   "creationTimestamp": {"type": ["string", "null"]}, "deletionTimestamp": _STRING,
                   "deletionGracePeriodSeconds": _INTEGER, "labels": _STRINGS_MAP, "annotations": _STRINGS_MAP,
                   "ownerReferences": _OBJECTS, "finalizers": {"type": "array", "items": _STRING},
                   "managedFields": _OBJECTS},
}


@lru_cache(maxsize=1)
def _schema() -> dict[str, Any]:
    schema = crd.json_schema()
    schema["properties"]["metadata"] = {**schema["properties"]["metadata"], **OBJECT_META}
    schema["properties"]["metadata"].pop("x-kubernetes-preserve-unknown-fields", None)
    _int_or_string(schema)
    return schema


def _int_or_string(node: Any) -> None:
    """``x-kubernetes-int-or-string`` is a type: an integer or a string, nothing else (JSON Schema ignores it)."""
    if isinstance(node, dict):
        if node.get("x-kubernetes-int-or-string") and "type" not in node:
            node["type"] = ["integer", "string"]
        for value in node.values():
            _int_or_string(value)
    elif isinstance(node, list):
        for item in node:
            _int_or_string(item)


def _without_nulls(node: Any, schema: dict[str, Any]) -> Any:
    """What the API server validates of a field set to null: the field's default where the schema gives one, else
    no field at all (``PruneNonNullableNullsWithoutDefaults``, then defaulting), for every field the schema
    declares; a null elsewhere (inside a preserved pod template) stays."""
    if isinstance(node, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out = {}
        for key, value in node.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if value is None and sub is not None and not sub.get("nullable"):
                if "default" in sub:
                    out[key] = sub["default"]
                continue
            out[key] = _without_nulls(value, sub or {})
        return out
    if isinstance(node, list):
        return [_without_nulls(item, schema.get("items") or {}) for item in node]
    return node


@lru_cache(maxsize=1)
def _validator() -> Any:
    from jsonschema import Draft202012Validator, validators  # noqa: PLC0415 - only `kubeps validate` needs it

    # An integer is what the API server decodes as one (an int64): kubectl_yaml already made every integral number
    # within int64 an int, so a float (1e20, a uint64) is not an integer, as the API server says.
    types = Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool))
    return validators.extend(Draft202012Validator, type_checker=types)(_schema())


def _path(parts: Sequence[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _schema_problems(manifest: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for error in sorted(_validator().iter_errors(manifest), key=lambda e: [str(p) for p in e.absolute_path]):
        where = list(error.absolute_path)
        keyword = error.validator
        if keyword == "additionalProperties":
            known = sorted(error.schema.get("properties", {}))
            for name in sorted(set(error.instance) - set(known)):
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (known fields: {', '.join(known)})"
                yield _path([*where, name]), f'unknown field "{_path([*where, name])}"{hint}'
        elif keyword == "required":
            missing = error.message.split("'")[1] if "'" in error.message else error.message
            yield _path([*where, missing]), "Required value"
        elif keyword == "const":
            yield _path(where), f"Unsupported value: {_short(error.instance)}: must be {error.validator_value!r}"
        elif keyword == "enum":
            allowed = ", ".join(repr(v) for v in error.validator_value)
            yield _path(where), f"Unsupported value: {_short(error.instance)}: supported values: {allowed}"
        elif keyword == "uniqueItems":
            yield _path(where), f"Duplicate value: {_short(error.instance)} holds a value twice (a set)"
        else:
            yield _path(where), f"Invalid value: {_short(error.instance)}: {error.message}"


def _list_map_problems(node: Any, schema: dict[str, Any], where: list[Any]) -> Iterator[tuple[str, str]]:
    """``x-kubernetes-list-type: map`` keys are unique (JSON Schema cannot say it)."""
    if isinstance(node, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in node:
                yield from _list_map_problems(node[name], sub, [*where, name])
    elif isinstance(node, list):
        keys = schema.get("x-kubernetes-list-map-keys")
        seen: dict[tuple[str, ...], int] = {}
        for i, item in enumerate(node):
            if keys and isinstance(item, dict) and all(k in item for k in keys):
                key = tuple(json.dumps(item[k], sort_keys=True) for k in keys)  # a key may hold a list (invalid)
                if key in seen:
                    shown = {k: item[k] for k in keys}
                    yield _path([*where, i]), f"Duplicate value: {shown} (item {seen[key]} has the same key)"
                seen.setdefault(key, i)
            yield from _list_map_problems(item, schema.get("items") or {}, [*where, i])


def _rules(schema: dict[str, Any], where: list[str]) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """Every CEL rule of the schema with the path of the node it is on (objects only: lists carry none here)."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield where, rule
    for name, sub in (schema.get("properties") or {}).items():
        yield from _rules(sub, [*where, name])


@lru_cache(maxsize=None)
def _program(rule: str) -> Any:
    import celpy  # noqa: PLC0415 - cel-python: only `kubeps validate` needs it

    env = celpy.Environment()
    return env.program(env.compile(rule))


def _cel_problems(manifest: dict[str, Any]) -> Iterator[tuple[str, str]]:
    import celpy  # noqa: PLC0415

    for where, rule in _rules(_schema(), []):
        if "oldSelf" in rule["rule"]:
            continue  # a transition rule: it compares with the stored object, which a file does not have
        node: Any = manifest
        for part in where:
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            continue  # the schema's required/type errors say what is missing
        try:
            ok = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(node)})
        except Exception:  # noqa: BLE001 - e.g. a field of the wrong type: the schema error names it
            continue
        if bool(ok):
            continue
        field = ".".join([*where, *rule.get("fieldPath", "").strip(".").split(".")]).strip(".")
        message = rule["message"]
        if "metadata.name" in rule["rule"]:
            field = "metadata.name"
            name = (manifest.get("metadata") or {}).get("name")
            problem = models.name_problem(name) if isinstance(name, str) else None
            message = f"Invalid value: {_short(name)}: {message}" + (f": {problem}" if problem else "")
        yield field, message


def validate_manifest(manifest: Any, source: str, field_validation: str = "Strict") -> list[Problem]:
    """Every problem of one document (a PSTrainingJob, as the JSON kubectl sends), each naming its field; with
    ``field_validation`` ``Warn`` an unknown field is a warning, with ``Ignore`` nothing."""
    if not isinstance(manifest, dict):
        return [Problem(source, "", f"a manifest is a YAML mapping, got {type(manifest).__name__}")]
    manifest = _without_nulls(manifest, _schema())
    found = [*_schema_problems(manifest), *_list_map_problems(manifest, _schema(), []), *_cel_problems(manifest)]
    seen: set[tuple[str, str]] = set()
    problems = []
    for field, message in found:
        if (field, message) in seen:
            continue
        seen.add((field, message))
        unknown = message.startswith(_UNKNOWN)
        if field.split(".")[0].split("[")[0] == "status" and not unknown:
            continue  # a create drops the status (the status subresource) before validating; unknown fields in it
            # are found earlier, as the request is decoded
        if unknown and field_validation == "Ignore":
            continue
        problems.append(Problem(source, field, message, warning=unknown and field_validation == "Warn"))
    return problems


def _label(filename: str, index: int, many: bool, doc: Any) -> str:
    name = doc.get("metadata") if isinstance(doc, dict) else None
    name = name.get("name") if isinstance(name, dict) else None
    shown = f" ({name})" if isinstance(name, str) and name else ""
    return filename + (f"#{index + 1}" if many else "") + shown


def _is_job(doc: Any) -> bool:
    """A document to check: a PSTrainingJob (by kind or by our API group), or anything that is not a mapping with
    a kind (it cannot be another kind's manifest either)."""
    if not isinstance(doc, dict):
        return True
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    return kind == models.KIND or (isinstance(api_version, str) and api_version.startswith(models.GROUP + "/"))


def validate_text(text: str, filename: str, field_validation: str = "Strict") -> tuple[int, list[Problem]]:
    """``(number of PSTrainingJobs checked, problems and warnings)`` of a YAML file (several documents allowed;
    documents of other kinds are skipped, as a file may also hold a ConfigMap or a PVC)."""
    docs = list(kubectl_yaml.documents(text))
    many = len(docs) > 1
    checked, problems = 0, []
    for doc in docs:
        if doc.error is not None:
            checked += 1
            problems.append(Problem(_label(filename, doc.index, many, None), doc.error.field, doc.error.message))
            continue
        if doc.value is None or not _is_job(doc.value):
            continue
        checked += 1
        label = _label(filename, doc.index, many, doc.value)
        problems.extend(Problem(label, "", warning, warning=True) for warning in doc.warnings)
        try:
            problems.extend(validate_manifest(doc.value, label, field_validation))
        except Exception as err:  # noqa: BLE001 - never a traceback on a file's content: say what could not be checked
            problems.append(Problem(label, "", f"cannot be checked: {type(err).__name__}: {err} (a kubeps bug: "
                                               "please report it with this file)"))
    return checked, problems


def missing_dependency() -> str | None:
    """Why ``kubeps validate`` cannot run here (jsonschema or cel-python missing: ``kubeps[validate]``), or None."""
    try:
        import celpy  # noqa: F401, PLC0415 - the CRD's CEL rules
        import jsonschema  # noqa: F401, PLC0415 - the CRD's schema
        import yaml  # noqa: F401, PLC0415
    except ImportError as err:
        return f"{err}; install kubeps[validate] (pip install 'kubeps[validate]')"
    return None


def check_files(texts: Sequence[tuple[str, str]], field_validation: str = "Strict") -> tuple[int, list[str]]:
    """``kubeps validate`` on ``(file name, text)`` pairs: ``(exit status, lines to print)``, every problem and
    warning a line, then a summary. Documents of other kinds are skipped (a glob may take in a PVC), but files
    holding no PSTrainingJob at all are a problem (a CI check that checks nothing must not pass)."""
    if field_validation not in FIELD_VALIDATION:
        raise ValueError(f"field_validation={field_validation!r}: must be one of {', '.join(FIELD_VALIDATION)}")
    total, found = 0, []
    for name, text in texts:
        checked, problems = validate_text(text, name, field_validation)
        total += checked
        found.extend(problems)
    errors = [p for p in found if not p.warning]
    warnings = [str(p) for p in found if p.warning]
    if total == 0 and not errors:
        names = ", ".join(name for name, _ in texts)
        errors.append(Problem(names, "", f"no {models.KIND} (apiVersion {models.API_VERSION}) to check"))
    if errors:
        files = len({p.source.split(" (")[0].split("#")[0] for p in errors})
        return EXIT_INVALID, [*warnings, *(str(p) for p in errors), f"{len(errors)} error(s) in {files} file(s)"]
    return EXIT_OK, [*warnings, f"{total} {models.KIND}(s) in {len(texts)} file(s): valid"]
