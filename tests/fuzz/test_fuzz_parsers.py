"""Fuzzing the parsers of untrusted bytes: the frame decoder, TF_CONFIG and checkpoint manifests. Each either
accepts its input or raises its own error naming the field -- never anything else."""

from __future__ import annotations

import json
import struct

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kubeps.runtime.checkpoint.format import CheckpointCorruptError, CheckpointError, Manifest, read_manifest
from kubeps.runtime.cluster import TFConfig, TFConfigError
from kubeps.runtime.rpc import wire

# -- JSON-ish values, with the types that tempt lenient parsers ("2", 2.0, true for 2) ----------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["2", "2.0", "-1", "float32", "ps", "../x", ""]))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
dims = st.one_of(st.integers(0, 5), st.integers(-3, 2**64), st.sampled_from([2**40, 2**62, "2", 2.0, True, None]))


def _frame(header_obj, data: bytes = b"") -> bytes:
    header = json.dumps(header_obj, allow_nan=True).encode()
    head = struct.pack("<4sI", wire.MAGIC, len(header)) + header
    return head + b"\0" * (-len(head) % 8) + data


@st.composite
def frames(draw) -> list[bytes]:
    """Frames from valid to absurd: random bytes, valid frames cut or grown, and headers with mutated fields."""
    kind = draw(st.sampled_from(["bytes", "valid", "header", "deep"]))
    if kind == "bytes":
        return [draw(st.binary(max_size=200))]
    if kind == "deep":
        depth = draw(st.one_of(st.sampled_from([65, 999, 1000, 5000]), st.integers(50, 3000)))
        text = b'{"meta":{"a":' + b"[" * depth + b"]" * depth + b"}}"
        return [struct.pack("<4sI", wire.MAGIC, len(text)) + text]
    arrays = draw(st.lists(st.tuples(st.sampled_from(wire.ALLOWED_DTYPES),
                                     st.lists(st.integers(0, 4), max_size=3)), max_size=3))
    tensors = [np.zeros(shape, dtype) for dtype, shape in arrays]
    frame = b"".join(bytes(s) for s in wire.encode_message(draw(st.dictionaries(st.text(max_size=5), json_values,
                                                                                    max_size=3)), tensors))
    if kind == "header":
        length = struct.unpack_from("<4sI", frame)[1]
        header = json.loads(frame[8 : 8 + length])
        data = frame[wire._align(8 + length):]
        for t in header["tensors"]:
            field = draw(st.sampled_from(["dtype", "shape", "offset", "nbytes", None]))
            if field == "shape":
                t["shape"] = draw(st.one_of(st.lists(dims, max_size=4), st.just([2**40, 2**40, 0])))
            elif field == "dtype":
                t["dtype"] = draw(st.sampled_from(["object", "float32", ">f4", "V8", "int64", 7]))
            elif field:
                t[field] = draw(dims)
        if draw(st.booleans()):
            header["data_bytes"] = draw(dims)
        if draw(st.booleans()):
            header[draw(st.text(max_size=4))] = draw(json_values)
        frame = _frame(header, data)
    cut = draw(st.integers(0, len(frame)))
    frame = draw(st.sampled_from([frame, frame[:cut], frame + draw(st.binary(min_size=1, max_size=16))]))
    parts = draw(st.integers(1, 4))
    step = max(1, len(frame) // parts)
    return [frame[i : i + step] for i in range(0, len(frame), step)] or [b""]


@given(frames())
def test_the_decoder_accepts_or_names_the_field(chunks):
    try:
        meta, arrays = wire.decode_chunks(chunks, max_data_bytes=1 << 20)
    except wire.WireError as err:
        assert err.field and err.allowed
        return
    assert isinstance(meta, dict) and all(isinstance(a, np.ndarray) for a in arrays)


tf_configs = st.one_of(
    st.text(max_size=60),
    json_values.map(json.dumps),
    st.fixed_dictionaries({
        "cluster": st.dictionaries(st.sampled_from(["chief", "ps", "worker", "evaluator", "x"]),
                                   st.one_of(st.lists(st.sampled_from(["h:1", "h:2222", "h", ":1", "h:x", "[::1]:5"]),
                                                      max_size=3), json_values), max_size=4),
        "task": st.one_of(json_values, st.fixed_dictionaries({"type": st.sampled_from(["chief", "ps", "worker", 1]),
                                                              "index": st.one_of(dims, json_values)})),
    }, optional={"environment": json_values, "rpc_layer": json_values}).map(json.dumps),
)


@given(tf_configs)
def test_tf_config_parses_or_names_the_field(text):
    try:
        config = TFConfig.from_env({"TF_CONFIG": text})
    except TFConfigError as err:
        assert err.field
        return
    assert isinstance(config, TFConfig)


def _valid_manifest() -> dict:
    entry = {"start": 0, "stop": 2, "file": "w.value.0-2.npy", "sha256": "0" * 64, "nbytes": 10, "updates": 1}
    slot = {"shape": [2, 3], "dtype": "float32", "slices": [dict(entry, file="w.m.0-2.npy")]}
    return {"format_version": 1, "checkpoint_number": 3, "step": 7, "final": False, "created": 1.5,
            "variables": {"w": {"shape": [2, 3], "dtype": "float32", "slices": [entry], "slots": {"k": {"m": slot}}}},
            "objects": {"step": {"value": 7}}}


@st.composite
def manifests(draw) -> bytes:
    if draw(st.integers(0, 4)) == 0:
        return draw(st.one_of(st.binary(max_size=80), json_values.map(lambda v: json.dumps(v).encode())))
    doc = _valid_manifest()
    paths = [("format_version",), ("checkpoint_number",), ("step",), ("variables", "w", "shape"),
             ("variables", "w", "dtype"), ("variables", "w", "slices"), ("variables", "w", "slices", 0, "file"),
             ("variables", "w", "slices", 0, "start"), ("variables", "w", "slices", 0, "stop"),
             ("variables", "w", "slices", 0, "sha256"), ("variables", "w", "slots", "k", "m", "shape"),
             ("objects",), ("created",)]
    for path in draw(st.lists(st.sampled_from(paths), max_size=3)):
        target = doc
        try:
            for key in path[:-1]:
                target = target[key]
        except (KeyError, IndexError, TypeError):  # an earlier mutation replaced a parent
            continue
        last = path[-1]
        # a dict takes any key; a list (an earlier mutation may have put one where a dict was) only an index in it
        if not (isinstance(target, dict) or (isinstance(target, list) and isinstance(last, int) and last < len(target))):
            continue
        target[last] = draw(st.one_of(json_values, dims, st.sampled_from(["../../etc/passwd", "/abs.npy",
                                                                          ".hidden.npy", "x.npy"])))
    return json.dumps(doc).encode()


@given(manifests())
def test_checkpoint_manifests_parse_or_are_corrupt(tmp_path_factory, raw):
    directory = tmp_path_factory.mktemp("ckpt")
    (directory / "manifest.json").write_bytes(raw)
    try:
        manifest = read_manifest(str(directory))
    except CheckpointCorruptError:
        return
    except CheckpointError as err:  # only the corrupt kind is expected from a file that is there
        raise AssertionError(f"{type(err).__name__}: {err}") from None
    assert isinstance(manifest, Manifest)
    for entry in manifest.variables.values():
        for s in entry.slices:
            assert "/" not in s.file and not s.file.startswith(".")
