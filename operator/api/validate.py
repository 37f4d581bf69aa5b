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

Pure: it takes the texts and returns the problems, the lines to print and the exit status (0 every manifest is
valid, 1 a manifest is invalid); the ``kubeps`` command (:mod:`kubeps.runtime.cli`) reads the files, prints, and
answers a usage error (no file, an unreadable one) with 2. jsonschema, cel-python and pyyaml are imported only
when it runs (``kubeps[validate]``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator, Sequence

from . import crd, models

__all__ = ["Problem", "check_files", "missing_dependency", "validate_manifest", "validate_text"]

EXIT_OK, EXIT_INVALID = 0, 1


@dataclass(frozen=True)
class Problem:
    """One error: where (``file``, the document's index and name) and what (``field``, ``message``)."""

    source: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.source}: {self.field}: {self.message}" if self.field else f"{self.source}: {self.message}"


@lru_cache(maxsize=1)
def _schema() -> dict[str, Any]:
    return crd.json_schema()


@lru_cache(maxsize=1)
def _validator() -> Any:
    from jsonschema import Draft202012Validator  # noqa: PLC0415 - only `kubeps validate` needs it

    return Draft202012Validator(_schema())


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
        seen: dict[tuple[Any, ...], int] = {}
        for i, item in enumerate(node):
            if keys and isinstance(item, dict) and all(k in item for k in keys):
                key = tuple(item[k] for k in keys)
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


def validate_manifest(manifest: Any, source: str) -> list[Problem]:
    """Every problem of one parsed document (a PSTrainingJob), each naming its field."""
    if not isinstance(manifest, dict):
        return [Problem(source, "", f"a manifest is a YAML mapping, got {type(manifest).__name__}")]
    found = [*_schema_problems(manifest), *_list_map_problems(manifest, _schema(), []), *_cel_problems(manifest)]
    seen: set[tuple[str, str]] = set()
    problems = []
    for field, message in found:
        if (field, message) not in seen:
            seen.add((field, message))
            problems.append(Problem(source, field, message))
    return problems


def validate_text(text: str, filename: str) -> tuple[int, list[Problem]]:
    """``(number of PSTrainingJobs checked, problems)`` of a YAML file (several documents allowed; documents of
    other kinds are skipped, as a file may also hold a ConfigMap or a PVC)."""
    import yaml  # noqa: PLC0415

    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as err:
        return 0, [Problem(filename, "", f"not valid YAML: {err}")]
    checked, problems = 0, []
    for index, doc in enumerate(documents):
        if doc is None:
            continue
        kind = doc.get("kind") if isinstance(doc, dict) else None
        api_version = str(doc.get("apiVersion", "")) if isinstance(doc, dict) else ""
        if isinstance(doc, dict) and kind != models.KIND and not api_version.startswith(models.GROUP + "/"):
            continue
        checked += 1
        name = (doc.get("metadata") or {}).get("name") if isinstance(doc, dict) else None
        label = filename + (f"#{index + 1}" if len(documents) > 1 else "") + (f" ({name})" if name else "")
        problems.extend(validate_manifest(doc, label))
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


def check_files(texts: Sequence[tuple[str, str]]) -> tuple[int, list[str]]:
    """``kubeps validate`` on ``(file name, text)`` pairs: ``(exit status, lines to print)``, every problem a line,
    then a summary. Documents of other kinds are skipped (a glob may take in a PVC), but files holding no
    PSTrainingJob at all are a problem (a CI check that checks nothing must not pass)."""
    total, problems = 0, []
    for name, text in texts:
        checked, found = validate_text(text, name)
        total += checked
        problems.extend(found)
    if total == 0 and not problems:
        names = ", ".join(name for name, _ in texts)
        problems.append(Problem(names, "", f"no {models.KIND} (apiVersion {models.API_VERSION}) to check"))
    if problems:
        files = len({p.source.split(" (")[0].split("#")[0] for p in problems})
        return EXIT_INVALID, [*(str(p) for p in problems), f"{len(problems)} error(s) in {files} file(s)"]
    return EXIT_OK, [f"{total} {models.KIND}(s) in {len(texts)} file(s): valid"]
