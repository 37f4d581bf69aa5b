"""``kubectl_yaml``: a file read as kubectl reads it (go-yaml v2 through sigs.k8s.io/yaml), the JSON the API server
would receive; what kubectl refuses (excessive aliasing, NaN, invalid escapes, null keys) refused, quickly."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from kubeps.operator.api import kubectl_yaml
from kubeps.operator.api.kubectl_yaml import MAX_REQUEST_BYTES, documents


def _one(text: str):
    docs = list(documents(text))
    assert len(docs) == 1, docs
    return docs[0]


@pytest.mark.parametrize("scalar, value", [
    ("y", True), ("Yes", True), ("on", True), ("N", False), ("off", False), ("~", None), ("", None),
    ("1e3", 1000), ("1.0", 1), ("1.5", 1.5), (".5", 0.5), ("0x1F", 31), ("0o17", 15), ("010", 8), ("-0b11", -3),
    ("1_000", 1000), ("+1", 1), ("1:30", "1:30"), ("2001-01-01", "2001-01-01"), ("<<", "<<"), ("Y2K", "Y2K"),
    ("9223372036854775807", 2**63 - 1), ("18446744073709551615", float(2**64 - 1)), ("1e20", 1e20),
    ("'y'", "y"), ('"1e3"', "1e3"), ("!!str 1", "1"), ("!!float 3", 3), ("!!binary aGk=", "hi"), ("!foo bar", "bar"),
])
def test_scalars_resolve_as_go_yaml_v2_resolves_them(scalar, value):
    doc = _one(f"a: {scalar}\n")
    assert doc.error is None, doc.error
    assert doc.value == {"a": value} and type(doc.value["a"]) is type(value)


@pytest.mark.parametrize("text, field, words", [
    ("a: .nan\n", "a", "unsupported value: NaN"),
    ("a: [1, -.inf]\n", "a[1]", "unsupported value: -Inf"),
    ("? !!null\n: 1\n", "", "unsupported map key: null"),
    ("a: {? [x]: 1}\n", "a", "invalid map key"),
    ("a: !!int x\n", "a", "cannot decode !!str `x` as a !!int"),
    ("a: &a [*a]\n", "a[0][0]", "contains itself"),
    ("<<: 1\n", "<<", "map merge requires map"),
    ('a: "\\ud800"\n', "", "invalid Unicode character escape"),
    ('a: "\\U00110000"\n', "", "invalid Unicode character escape"),
    ("a: \x07\n", "", "control characters are not allowed"),
    ('{"a": NaN}', "", "JSON has no NaN"),
    ('{"a": 1e400}', "a", "unsupported value: +Inf"),
])
def test_what_kubectl_refuses_is_refused_naming_the_field(text, field, words):
    doc = _one(text)
    assert doc.value is None and doc.error is not None
    assert doc.error.field == field and words in doc.error.message, doc.error


def test_keys_become_strings_merges_and_duplicates_as_go_yaml():
    doc = _one("1: a\ny: b\nbase: &b {p: 1, q: 2}\nm: {<<: *b, q: 3}\nd: 1\nd: 2\n")
    assert doc.value == {"1": "a", "true": "b", "base": {"p": 1, "q": 2}, "m": {"p": 1, "q": 3}, "d": 2}


def test_a_json_file_is_read_as_json():
    assert _one('{"a": "\\ud800", "b": 99999999999999999999}').value == {"a": "\ufffd", "b": 1e20}
    assert [d.value for d in documents('{"a": 1} {"b": 2}')] == [{"a": 1}, {"b": 2}]


def _bomb(levels: int, fan: int) -> str:
    lines = ['l0: &l0 ["lol"]'] + [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * fan) + "]"
                                   for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels, fan", [(9, 9), (6, 10), (30, 2)])
def test_an_alias_bomb_is_refused_in_bounded_time_and_memory(levels, fan):
    text = _bomb(levels, fan)  # 9 x 9: a few hundred bytes expanding to 387 million values
    tracemalloc.start()
    start = time.process_time()
    doc = _one(text)
    seconds = time.process_time() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert doc.error is not None and "excessive aliasing" in doc.error.message, doc
    assert seconds < 2.0 and peak < 200 * 2**20, (seconds, peak)


def test_aliases_within_go_yamls_budget_are_expanded():
    doc = _one(_bomb(2, 9))  # 81 values from aliases: under the 100 go-yaml lets pass
    assert doc.error is None and len(doc.value["l2"]) == 9
    assert kubectl_yaml.allowed_alias_ratio(1000) == 0.99 and kubectl_yaml.allowed_alias_ratio(5_000_000) == 0.10


def test_a_document_over_the_request_limit_is_refused_and_one_over_etcds_warned():
    over = _one(f'a: "{"x" * MAX_REQUEST_BYTES}"\n')
    assert over.value is None and "Request entity too large" in over.error.message
    assert "3 MiB" in over.error.message
    under = _one(f'a: "{"x" * (2 * 2**20)}"\n')
    assert under.error is None and "etcd" in under.warnings[0]
    assert kubectl_yaml.json_size({"a": "<&>"}) == len('{"a":"\\u003c\\u0026\\u003e"}')
