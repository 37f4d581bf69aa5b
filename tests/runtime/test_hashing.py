"""``hash_bucket``: ids hashed into buckets with a fixed hash. Golden values pin it: a change of these numbers
changes every bucket a trained model was trained with, so they may never change."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kubeps.runtime as kp
from kubeps.runtime.data.hashing import hash64, hash_bucket
from kubeps.runtime.util.keyhash import fnv1a64, mix64
from kubeps.runtime.errors import RuntimeConfigError


def test_the_building_blocks_match_their_published_values():
    # FNV-1a 64 (Fowler, Noll, Vo: the reference test vectors)
    assert fnv1a64(np.array([b"", b"a", b"foobar"])).tolist() == [
        0xCBF29CE484222325, 0xAF63DC4C8601EC8C, 0x85944171F73967E8]
    # SplitMix64 (Vigna): the first output of the generator seeded with 0
    assert mix64(np.array([0], np.uint64)).tolist() == [0xE220A8397B1DCDAF]


def test_golden_hashes_and_buckets():
    assert hash64([0, 1, -1]).tolist() == [16294208416658607535, 10451216379200822465, 16490336266968443936]
    assert hash64(["", "a", "criteo"]).tolist() == [14087677454934409008, 6857225946766476583, 9428551963830535847]
    assert hash64([7], salt=123).tolist() == [15112002237677987833]
    assert hash_bucket(["a", "foobar", "é", b"x\x00y"], 1000).tolist() == [583, 415, 722, 520]
    assert hash_bucket([0, 1, -1, 2**40], 1000).tolist() == [535, 465, 936, 641]


def test_shapes_dtypes_and_spellings_of_the_same_id():
    ids = np.array([[3, 4], [5, 2**32 - 1]], dtype=np.int64)
    buckets = hash_bucket(ids, 97)
    assert buckets.shape == (2, 2) and buckets.dtype == np.int64 and ((0 <= buckets) & (buckets < 97)).all()
    # an integer id is the same whatever its integer dtype or container
    assert np.array_equal(hash_bucket(ids.astype(np.uint32), 97), buckets)
    assert hash_bucket(ids.tolist(), 97).tolist() == buckets.tolist()
    assert hash_bucket(5, 97) == buckets[1, 0]
    # a string is the same as str, as UTF-8 bytes, in a list or an object array
    words = ["ad", "click", "日本", "a" * 40]
    want = hash_bucket(words, 1 << 20)
    assert np.array_equal(hash_bucket(np.array([w.encode() for w in words]), 1 << 20), want)
    assert np.array_equal(hash_bucket(np.array(words, dtype=object), 1 << 20), want)
    assert np.array_equal(hash_bucket(np.array(words), 1 << 20), want)  # a str ('U') array, not all ASCII
    assert np.array_equal(hash_bucket(np.array(words[:2]), 1 << 20), want[:2])  # ASCII: hashed from code points
    assert np.array_equal(hash_bucket([words[0].encode(), *words[1:]], 1 << 20), want)  # str and bytes mixed
    # one id's bucket does not depend on the others beside it (the fixed-width array's padding)
    assert hash_bucket(["ad"], 1 << 20)[0] == want[0]


def test_buckets_spread_evenly():
    counts = np.bincount(hash_bucket(np.arange(200_000), 100), minlength=100)
    assert counts.min() > 1800 and counts.max() < 2200
    counts = np.bincount(hash_bucket([f"user-{i}" for i in range(50_000)], 50), minlength=50)
    assert counts.min() > 850 and counts.max() < 1150


def test_mask_value_and_salt_as_keras_hashing():
    buckets = hash_bucket(np.array([-1, 5, -1, 6]), 10, mask_value=-1)
    assert buckets[0] == buckets[2] == 0 and (buckets[[1, 3]] >= 1).all()
    assert hash_bucket([5], 10, mask_value=-1)[0] == 1 + hash64([5])[0] % 9
    assert hash_bucket(["", "x"], 4, mask_value="")[0] == 0
    assert not np.array_equal(hash_bucket(np.arange(100), 1000, salt=1), hash_bucket(np.arange(100), 1000))


@pytest.mark.parametrize("values, match", [
    (np.array([1.5]), "dtype float64"),
    ([1, "a"], "all integers or all strings.*types \\['int', 'str'\\]"),
    ([1.0, 2.0], "types \\['float'\\]"),
    (np.array([True]), "dtype bool"),
])
def test_what_is_not_an_id_is_refused(values, match):
    with pytest.raises(TypeError, match=match):
        hash_bucket(values, 10)


def test_bad_arguments_name_the_field():
    with pytest.raises(RuntimeConfigError, match="num_buckets"):
        hash_bucket([1], 0)
    with pytest.raises(RuntimeConfigError, match="salt"):
        hash_bucket([1], 10, salt=-1)
    with pytest.raises(RuntimeConfigError, match="num_buckets.*mask_value"):
        hash_bucket([1], 1, mask_value=0)


def test_two_processes_agree():
    program = ("import json, numpy as np, kubeps.runtime as kp;"
               "print(json.dumps([kp.hash_bucket(np.arange(-50, 50), 1009).tolist(),"
               " kp.hash_bucket(['a', 'b', 'ünï'], 1009, salt=9).tolist()]))")
    outputs = []
    for seed in ("1", "2"):  # Python's own str hash differs between these two; ours may not
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outputs.append(subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True,
                                      check=True, timeout=120).stdout)
    assert outputs[0] == outputs[1]
    assert json.loads(outputs[0])[0] == kp.hash_bucket(np.arange(-50, 50), 1009).tolist()


def test_in_a_dataset_map_over_batches(tmp_path):
    ds = kp.Dataset.from_tensor_slices({"user": np.array(["u1", "u2", "u3", "u1"])}).batch(2)
    hashed = ds.map(lambda e: {"user": kp.hash_bucket(e["user"], 100)})
    got = np.concatenate([b["user"] for b in hashed])
    assert got.tolist() == hash_bucket(["u1", "u2", "u3", "u1"], 100).tolist() and got[0] == got[3]
