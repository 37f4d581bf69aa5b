"""YAML manifests read as ``kubectl`` reads them: each document turned into the JSON the API server receives.

kubectl converts every YAML document to JSON (``sigs.k8s.io/yaml`` over go-yaml v2, itself a port of libyaml) and
sends that; the API server never sees the YAML. :func:`documents` reads a file the same way, so that
``kubeps validate`` judges what the API server will judge, with kubectl's limits:

* plain scalars resolve as go-yaml v2 resolves them (YAML 1.1): ``y``, ``yes`` and ``on`` are ``true``, ``1e3`` and
  ``0x1F`` are numbers, ``2001-01-01`` and ``1:30`` stay strings; map keys become strings (``1`` is ``"1"``,
  ``true`` is ``"true"``), a null or a collection as a key is refused; ``<<`` merges maps; a later duplicate key
  wins;
* aliases are counted as go-yaml counts them and a document is refused once alias expansions make up too much of it
  (go-yaml's ``document contains excessive aliasing``): an alias bomb is refused after at most about 400,000
  expansions, never expanded further; an anchor that contains its own alias is refused;
* NaN and infinities are refused (JSON cannot hold them); a number is what the API server decodes from Go's JSON:
  an integral value within int64 an integer, anything else a number with a fraction;
* a document whose JSON is over the API server's request limit (:data:`MAX_REQUEST_BYTES`, 3 MiB) is refused, one
  over etcd's default request limit (:data:`ETCD_REQUEST_BYTES`) is warned about;
* a file that starts with ``{`` is JSON, read as Go's JSON decoder reads it (kubectl does not read it as YAML);
* the parser is libyaml's when PyYAML was built with it (PyYAML's ``CBaseLoader``): invalid Unicode escapes (``"\\ud800"``)
  and control characters are refused as go-yaml refuses them.

Pure: text in, documents (or the problem that stopped one) out. PyYAML is imported only when it runs.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["ETCD_REQUEST_BYTES", "MAX_REQUEST_BYTES", "Document", "ManifestError", "allowed_alias_ratio",
           "documents", "json_size"]

#: The API server's limit on a request's body (``--max-request-bytes``' default in kube-apiserver): 3 MiB.
MAX_REQUEST_BYTES = 3 * 1024 * 1024
#: etcd's default ``--max-request-bytes`` (1.5 MiB): a larger object passes a dry run but fails to be stored.
ETCD_REQUEST_BYTES = 3 * 512 * 1024
#: go-yaml v2's alias budget (``decode.go``): up to this many decodes, 99% may come from aliases ...
_ALIAS_RANGE_LOW = 400_000
#: ... and from this many on, 10%, scaled linearly in between.
_ALIAS_RANGE_HIGH = 4_000_000
_INT64_MIN, _INT64_MAX, _UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1
_PLAIN = "kubeps:plain"  # the tag this reader gives an untagged plain scalar: resolved as go-yaml resolves it
_TAG = "tag:yaml.org,2002:"

_BOOLS_NULLS: dict[str, Any] = {
    **dict.fromkeys(["y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"], True),
    **dict.fromkeys(["n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"], False),
    **dict.fromkeys(["", "~", "null", "Null", "NULL"], None),
    **dict.fromkeys([".nan", ".NaN", ".NAN"], math.nan),
    **dict.fromkeys([".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF"], math.inf),
    **dict.fromkeys(["-.inf", "-.Inf", "-.INF"], -math.inf),
}
# Go's strconv.ParseInt(s, 0, 64) syntax (underscores already removed, as go-yaml removes them).
_GO_INT = re.compile(r"([-+]?)(0[xX][0-9a-fA-F]+|0[oO][0-7]+|0[bB][01]+|0[0-7]*|[1-9][0-9]*)\Z")
_GO_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?\Z")  # go-yaml's yamlStyleFloat
_DOT_FLOAT = re.compile(r"\.[0-9]+([eE][-+]?[0-9]+)?\Z")  # strconv.ParseFloat of a plain scalar starting with '.'


class ManifestError(ValueError):
    """Why a document cannot be sent: ``field`` (a path like ``spec.runPolicy``, or ``""`` for the document) and
    ``message`` (what is wrong and what would be accepted)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Document:
    """One document of a file: its index (0-based), the JSON-able value kubectl would send (None when ``error``),
    what stopped it (``error``), and warnings (e.g. over etcd's default limit)."""

    index: int
    value: Any
    error: ManifestError | None = None
    warnings: tuple[str, ...] = ()


def allowed_alias_ratio(decodes: int) -> float:
    """go-yaml v2's ``allowedAliasRatio``: the share of decodes that may come from alias expansion."""
    if decodes <= _ALIAS_RANGE_LOW:
        return 0.99
    if decodes >= _ALIAS_RANGE_HIGH:
        return 0.10
    return 0.99 - 0.89 * (decodes - _ALIAS_RANGE_LOW) / (_ALIAS_RANGE_HIGH - _ALIAS_RANGE_LOW)


def json_size(value: Any) -> int:
    """The bytes of ``value`` as Go's ``json.Marshal`` writes it (compact, UTF-8, ``<``, ``>``, ``&``, U+2028 and
    U+2029 escaped as ``\\u00XX``), which is what kubectl sends."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    escaped = text.count("<") + text.count(">") + text.count("&")
    return len(text.encode("utf-8", "surrogatepass")) + 5 * escaped + 3 * (text.count("\u2028") + text.count("\u2029"))


def _path(parts: list[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _go_number(text: str) -> int | float | None:
    """go-yaml v2's ``resolve`` of a plain scalar starting with a digit or a sign: an int, a float, or None (a
    string)."""
    plain = text.replace("_", "")
    match = _GO_INT.match(plain)
    if match:
        sign, digits = match.groups()
        lowered = digits.lower()
        base = 16 if lowered.startswith("0x") else 8 if lowered.startswith("0o") else 2 if lowered.startswith(
            "0b") else 8 if len(digits) > 1 and digits.startswith("0") else 10
        body = digits[2:] if base != 10 and lowered[1:2] in ("x", "o", "b") else digits
        value = int(body, base) * (-1 if sign == "-" else 1)
        if _INT64_MIN <= value <= _INT64_MAX or (sign == "" and value <= _UINT64_MAX):
            return value
    if _GO_FLOAT.match(plain):
        return float(plain)
    return None


def _resolve(tag: str, text: str, where: list[Any]) -> Any:
    """A scalar as go-yaml v2 decodes it into an ``interface{}``: ``tag`` is :data:`_PLAIN`, or the explicit tag."""
    if tag == _TAG + "str" or not (tag == _PLAIN or tag[len(_TAG):] in ("bool", "int", "float", "null", "timestamp",
                                                                        "binary")):
        return text  # quoted, !!str, or a tag go-yaml does not resolve (kept as the string)
    if tag == _TAG + "binary":
        try:
            return base64.b64decode(text.replace("\n", "").replace(" ", ""), validate=True).decode("utf-8", "replace")
        except (binascii.Error, ValueError):
            raise ManifestError(_path(where), "!!binary value contains invalid base64 data") from None
    if text in _BOOLS_NULLS:
        value = _BOOLS_NULLS[text]
    elif text[:1] == ".":
        value = float(text) if _DOT_FLOAT.match(text) else text
    elif text[:1] in "+-0123456789" and text:
        number = _go_number(text)
        value = text if number is None else number
    else:
        value = text
    wanted = tag[len(_TAG):] if tag != _PLAIN else ""
    got = {bool: "bool", int: "int", float: "float", type(None): "null", str: "str"}[type(value)]
    if wanted in ("", got, "timestamp") or (wanted == "float" and got == "int"):
        return float(value) if wanted == "float" else value
    raise ManifestError(_path(where), f"cannot decode !!{got} `{text}` as a !!{wanted}")


def _key(value: Any, where: list[Any]) -> str:
    """A map key as sigs.k8s.io/yaml turns it into a JSON object's key."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return {math.inf: ".inf", -math.inf: "-.inf"}.get(value, ".nan" if math.isnan(value) else f"{value:g}")
    if value is None:
        raise ManifestError(_path(where), "unsupported map key: null (a JSON object's keys are strings)")
    raise ManifestError(_path(where), f"invalid map key: {_short(value)} (a JSON object's keys are strings)")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_number(value: Any, where: list[Any]) -> Any:
    """What the API server decodes from Go's ``json.Marshal`` of a number."""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            shown = "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
            raise ManifestError(_path(where), f"json: unsupported value: {shown} (JSON holds finite numbers only)")
        if value.is_integer() and _INT64_MIN <= value <= _INT64_MAX:
            return int(value)
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > _INT64_MAX:
        return float(value)  # a uint64: the API server's decoder makes it a float64
    return value


class _Decoder:
    """One document's node graph turned into JSON values, counting decodes and alias expansions as go-yaml does."""

    def __init__(self) -> None:
        self.decodes = 0
        self.aliased = 0
        self.alias_depth = 0
        self.seen: set[int] = set()  # nodes met once: meeting one again is an alias
        self.open: set[int] = set()  # aliases being expanded: meeting one inside itself is a cycle

    def _count(self, where: list[Any]) -> None:
        self.decodes += 1
        if self.alias_depth:
            self.aliased += 1
        if self.aliased > 100 and self.decodes > 1000 and self.aliased / self.decodes > allowed_alias_ratio(
                self.decodes):
            raise ManifestError(_path(where), f"document contains excessive aliasing: {self.aliased:,} of "
                                              f"{self.decodes:,} values come from aliases (kubectl refuses more than "
                                              f"{allowed_alias_ratio(self.decodes):.0%} once past 1,000)")

    def decode(self, node: Any, where: list[Any]) -> Any:
        self._count(where)
        if id(node) in self.seen:  # an alias: go-yaml decodes its target again, counted as aliased
            if id(node) in self.open:
                raise ManifestError(_path(where), f"anchor value contains itself ({node.start_mark})")
            self.open.add(id(node))
            self.alias_depth += 1
            self._count(where)  # the target, under the alias
            try:
                return self._node(node, where)
            finally:
                self.alias_depth -= 1
                self.open.discard(id(node))
        self.seen.add(id(node))
        return self._node(node, where)

    def _node(self, node: Any, where: list[Any]) -> Any:
        import yaml  # noqa: PLC0415

        if isinstance(node, yaml.ScalarNode):
            return _json_number(_resolve(node.tag, node.value, where), where)
        if isinstance(node, yaml.SequenceNode):
            return [self.decode(item, [*where, i]) for i, item in enumerate(node.value)]
        out: dict[str, Any] = {}
        self._mapping(node, out, where)
        return out

    def _mapping(self, node: Any, out: dict[str, Any], where: list[Any]) -> None:
        import yaml  # noqa: PLC0415

        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value == "<<" and key_node.tag in (_PLAIN,
                                                                                                     _TAG + "merge"):
                self._merge(value_node, out, where)
                continue
            raw = self.decode(key_node, where)
            key = _key(raw, where)
            out[key] = self.decode(value_node, [*where, key])

    def _merge(self, node: Any, out: dict[str, Any], where: list[Any]) -> None:
        """go-yaml v2's ``merge``: a map, an alias of one, or a sequence of them (the earlier ones win)."""
        import yaml  # noqa: PLC0415

        items = list(reversed(node.value)) if isinstance(node, yaml.SequenceNode) else [node]
        for item in items:
            if not isinstance(item, yaml.MappingNode):
                raise ManifestError(_path([*where, "<<"]), "map merge requires map or sequence of maps as the value")
            merged = self.decode(item, [*where, "<<"])
            out.update(merged)


def _loader_class() -> Any:
    """A PyYAML loader that composes node graphs (libyaml's parser when available, as go-yaml is a port of it) and
    leaves plain scalars unresolved (:data:`_PLAIN`): :class:`_Decoder` resolves them as go-yaml does."""
    import yaml  # noqa: PLC0415

    base: Any = yaml.CBaseLoader if getattr(yaml, "__with_libyaml__", False) else yaml.BaseLoader

    class Loader(base):  # type: ignore[misc]  # PyYAML's loaders are untyped
        def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
            if kind is yaml.ScalarNode and implicit[0]:
                return _PLAIN
            return super().resolve(kind, value, implicit)

    return Loader


def _json_value(value: Any, where: list[Any]) -> Any:
    """A value of a JSON file as the API server receives it: numbers as :func:`_json_number` makes them, a lone
    surrogate escape (``"\\ud800"``) as U+FFFD, as Go's JSON decoder reads it."""
    if isinstance(value, dict):
        return {_json_value(k, where): _json_value(v, [*where, k]) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_value(item, [*where, i]) for i, item in enumerate(value)]
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return _json_number(value, where)


def _json_documents(text: str) -> Iterator[Document]:
    """A file that starts with ``{``: kubectl reads it with Go's JSON decoder (one or more values in a row), not
    as YAML: NaN, ``Infinity`` and trailing commas are errors."""

    def constant(name: str) -> Any:
        raise ValueError(f"invalid character {name[0]!r} looking for beginning of value (JSON has no {name})")

    decoder = json.JSONDecoder(parse_constant=constant)
    position, index = 0, 0
    while True:
        while position < len(text) and text[position] in " \t\r\n":
            position += 1
        if position >= len(text):
            return
        try:
            value, position = decoder.raw_decode(text, position)
            yield _sized(index, _json_value(value, []))
        except ManifestError as err:
            yield Document(index, None, err)
            return
        except ValueError as err:
            yield Document(index, None, ManifestError("", f"not valid JSON: {err}"))
            return
        except RecursionError:
            yield Document(index, None, ManifestError("", "nested too deeply"))
            return
        index += 1


def documents(text: str) -> Iterator[Document]:
    """Every document of ``text`` as kubectl would send it, in order; a YAML error stops the file (a
    :class:`Document` with ``error`` and no ``value``)."""
    import yaml  # noqa: PLC0415

    if text.lstrip(" \t\r\n").startswith("{"):
        yield from _json_documents(text)
        return

    loader = _loader_class()(text)
    index = 0
    try:
        while True:
            try:
                if not loader.check_node():
                    return
                node = loader.get_node()
            except (yaml.YAMLError, ValueError) as err:  # ValueError: the pure parser's chr() of a bad escape
                yield Document(index, None, ManifestError("", "not valid YAML: " + " ".join(str(err).split())))
                return
            yield _document(index, node)
            index += 1
    finally:
        loader.dispose()


def _document(index: int, node: Any) -> Document:
    if node is None:
        return Document(index, None)
    try:
        value = _Decoder().decode(node, [])
    except ManifestError as err:
        return Document(index, None, err)
    except RecursionError:
        return Document(index, None, ManifestError("", "nested too deeply"))
    return _sized(index, value)


def _sized(index: int, value: Any) -> Document:
    """The document, or the API server's refusal of a request over its limit; a warning over etcd's."""
    size = json_size(value)
    if size > MAX_REQUEST_BYTES:
        return Document(index, None, ManifestError("", f"Request entity too large: {size:,} bytes as JSON, the API "
                                                       f"server accepts at most {MAX_REQUEST_BYTES:,} (3 MiB)"))
    warnings: tuple[str, ...] = ()
    if size > ETCD_REQUEST_BYTES:
        warnings = (f"{size:,} bytes as JSON: over etcd's default request limit ({ETCD_REQUEST_BYTES:,} bytes, "
                    f"1.5 MiB), a cluster with that default cannot store it",)
    return Document(index, value, warnings=warnings)
