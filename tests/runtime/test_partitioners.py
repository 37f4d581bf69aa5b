"""Partitioners and the div split: TensorFlow's documented examples, its formulas, and edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kubeps.runtime.variables.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    div_split,
    owner_of,
    shard_offsets,
)


# -- TensorFlow's docstring examples ------------------------------------------------------------------------------
def test_fixed_shards_tf_doc_example():
    assert FixedShardsPartitioner(num_shards=2)([10, 3], np.float32) == [2, 1]


def test_min_size_tf_doc_examples():
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=2)([6, 1], np.float32) == [2, 1]
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=10)([6, 1], np.float32) == [6, 1]


def test_max_size_tf_doc_examples():
    assert MaxSizePartitioner(max_shard_bytes=4)([6, 1], np.float32) == [6, 1]
    assert MaxSizePartitioner(max_shard_bytes=4, max_shards=2)([6, 1], np.float32) == [2, 1]
    assert MaxSizePartitioner(max_shard_bytes=1024)([6, 1], np.float32) == [1, 1]


def test_strategy_guide_embedding_example_gives_two_shards():
    # The PS strategy guide: Embedding(1024, 1024) float32 with MinSizePartitioner(256 << 10, max_shards=2).
    partitioner = MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
    assert partitioner([1024, 1024], "float32") == [2, 1]


# -- the formulas -------------------------------------------------------------------------------------------------
def test_min_size_defaults_are_tfs():
    p = MinSizePartitioner()
    assert (p.min_shard_bytes, p.max_shards, p.bytes_per_string) == (256 << 10, 1, 16)
    assert p([100000, 64], np.float32) == [1, 1]  # max_shards=1 by default


@pytest.mark.parametrize(
    "shape,dtype,min_bytes,max_shards",
    [
        ((100, 8), np.float32, 1000, 10),  # 3200 B -> ceil(3.2) = 4
        ((100, 8), np.float64, 1000, 10),  # 6400 B -> 7
        ((100, 8), np.float64, 1000, 5),  # capped by max_shards
        ((3, 1000), np.float32, 10, 100),  # capped by shape[0]
        ((10,), np.int8, 1 << 20, 4),  # tiny: one shard
        ((1000, 16), np.float16, 4096, 64),  # 32000 B -> 8
    ],
)
def test_min_size_matches_formula(shape, dtype, min_bytes, max_shards):
    total = math.prod(shape) * np.dtype(dtype).itemsize
    expected = max(1, min(shape[0], max_shards, math.ceil(total / min_bytes)))
    result = MinSizePartitioner(min_shard_bytes=min_bytes, max_shards=max_shards)(shape, dtype)
    assert result == [expected] + [1] * (len(shape) - 1)


def test_min_size_known_values():
    assert MinSizePartitioner(1000, 10)((100, 8), np.float32) == [4, 1]
    assert MinSizePartitioner(1000, 10)((100, 8), np.float64) == [7, 1]
    assert MinSizePartitioner(1000, 5)((100, 8), np.float64) == [5, 1]
    assert MinSizePartitioner(10, 100)((3, 1000), np.float32) == [3, 1]


@pytest.mark.parametrize(
    "shape,dtype,max_bytes,max_shards,expected",
    [
        ((100, 10), np.float32, 400, None, 10),  # 40 B rows, 10 rows per shard
        ((100, 10), np.float32, 399, None, 12),  # 9 rows per shard -> ceil(100/9)
        ((100, 10), np.float32, 399, 5, 5),
        ((100, 10), np.float32, 1, None, 100),  # a row bigger than a shard: one row each
        ((100, 10), np.float64, 10 ** 9, None, 1),
        ((7,), np.int32, 8, None, 4),  # 2 rows per shard
        ((5, 2, 3), np.float32, 48, None, 3),  # 24 B rows, 2 per shard
    ],
)
def test_max_size_matches_formula(shape, dtype, max_bytes, max_shards, expected):
    bytes_per_row = math.prod(shape[1:]) * np.dtype(dtype).itemsize
    rows_per_shard = max(1, math.floor(max_bytes / bytes_per_row))
    formula = math.ceil(shape[0] / rows_per_shard)
    if max_shards:
        formula = min(max_shards, formula)
    assert formula == expected
    result = MaxSizePartitioner(max_shard_bytes=max_bytes, max_shards=max_shards)(shape, dtype)
    assert result == [expected] + [1] * (len(shape) - 1)


def test_string_dtypes_use_bytes_per_string():
    # 100 x 4 strings at 16 B each = 6400 B; at 100 B each = 40000 B.
    for dtype in (np.str_, np.bytes_, object, "string"):
        assert MinSizePartitioner(1000, 100)((100, 4), dtype) == [7, 1]
        assert MinSizePartitioner(1000, 100, bytes_per_string=100)((100, 4), dtype) == [40, 1]
        assert MaxSizePartitioner(64)((100, 4), dtype) == [100, 1]  # 64 B rows, one per shard
        assert MaxSizePartitioner(640, bytes_per_string=32)((100, 4), dtype) == [20, 1]  # 5 rows per shard


def test_shape_zero_smaller_than_requested_shards():
    assert FixedShardsPartitioner(8)([3, 5], np.float32) == [3, 1]
    assert FixedShardsPartitioner(8)([1], np.float32) == [1]
    assert MinSizePartitioner(1, 100)([2, 1000], np.float32) == [2, 1]
    assert MaxSizePartitioner(1)([4, 1000], np.float32) == [4, 1]


def test_rank_and_partition_list_shape():
    assert FixedShardsPartitioner(2)([10], np.float32) == [2]
    assert FixedShardsPartitioner(2)((10, 3, 4, 5), np.float32) == [2, 1, 1, 1]
    assert FixedShardsPartitioner(2)(np.zeros((10, 3)).shape, np.float64) == [2, 1]
    assert FixedShardsPartitioner(3).num_shards((10, 3), np.float32) == 3


def test_zero_rows_gives_one_shard():
    assert FixedShardsPartitioner(4)([0, 3], np.float32) == [1, 1]
    assert MinSizePartitioner(1, 4)([0, 3], np.float32) == [1, 1]
    assert MaxSizePartitioner(1)([0, 3], np.float32) == [1, 1]


# -- argument validation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "factory,name,value",
    [
        (lambda v: FixedShardsPartitioner(v), "num_shards", 0),
        (lambda v: FixedShardsPartitioner(v), "num_shards", -2),
        (lambda v: FixedShardsPartitioner(v), "num_shards", 2.5),
        (lambda v: MinSizePartitioner(min_shard_bytes=v), "min_shard_bytes", 0),
        (lambda v: MinSizePartitioner(max_shards=v), "max_shards", 0),
        (lambda v: MinSizePartitioner(bytes_per_string=v), "bytes_per_string", 0),
        (lambda v: MaxSizePartitioner(max_shard_bytes=v), "max_shard_bytes", 0),
        (lambda v: MaxSizePartitioner(4, max_shards=v), "max_shards", 0),
        (lambda v: MaxSizePartitioner(4, bytes_per_string=v), "bytes_per_string", -1),
        (lambda v: MaxSizePartitioner(v), "max_shard_bytes", "4"),
    ],
)
def test_bad_arguments_name_argument_and_value(factory, name, value):
    with pytest.raises(ValueError) as err:
        factory(value)
    assert name in str(err.value)
    assert repr(value) in str(err.value)


def test_bad_shapes_and_axes():
    p = FixedShardsPartitioner(2)
    with pytest.raises(ValueError, match="rank >= 1"):
        p([], np.float32)
    with pytest.raises(ValueError, match="fully defined"):
        p([None, 3], np.float32)
    with pytest.raises(ValueError, match="fully defined"):
        p([4, -1], np.float32)
    with pytest.raises(ValueError, match="axis"):
        p([4, 4], np.float32, axis=1)
    with pytest.raises(ValueError, match="dtype"):
        MinSizePartitioner()([4, 4], "not-a-dtype")


# -- div split ----------------------------------------------------------------------------------------------------
def test_div_split_tf_example_13_rows_5_shards():
    assert div_split(13, 5) == [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]


@pytest.mark.parametrize("rows,shards", [(1, 1), (10, 1), (10, 10), (10, 3), (1000, 7), (5, 4), (0, 1)])
def test_div_split_covers_rows_with_div_sizes(rows, shards):
    ranges = div_split(rows, shards)
    assert len(ranges) == shards
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    sizes = [b - a for a, b in ranges]
    base, extra = divmod(rows, shards)
    assert sizes == [base + 1] * extra + [base] * (shards - extra)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(shards - 1))
    assert shard_offsets(rows, shards).tolist() == [a for a, _ in ranges] + [rows]


def test_div_split_rejects_more_shards_than_rows():
    with pytest.raises(ValueError, match=r"'num_shards' has invalid value 5: <= num_rows \(3\)"):
        div_split(3, 5)
    with pytest.raises(ValueError, match="num_shards"):
        div_split(3, 0)
    with pytest.raises(ValueError, match="num_rows"):
        div_split(-1, 1)


# -- owner_of -----------------------------------------------------------------------------------------------------
def test_owner_of_13_rows_5_shards():
    shard, local = owner_of(np.arange(13), 13, 5)
    assert shard.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    assert local.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 0, 1]


@pytest.mark.parametrize("rows,shards", [(1, 1), (10, 3), (1000, 7), (97, 97), (100, 9), (1 << 20, 13)])
def test_owner_of_agrees_with_div_split(rows, shards):
    ids = np.unique(np.random.default_rng(0).integers(0, rows, size=min(rows, 5000)))
    ids = np.concatenate([ids, [0, rows - 1]])
    shard, local = owner_of(ids, rows, shards)
    ranges = div_split(rows, shards)
    starts = np.array([a for a, _ in ranges])
    stops = np.array([b for _, b in ranges])
    assert np.all(starts[shard] <= ids) and np.all(ids < stops[shard])
    assert np.array_equal(starts[shard] + local, ids)


def test_owner_of_keeps_shape_and_dtype():
    ids = np.array([[0, 12], [5, 9]], dtype=np.int32)
    shard, local = owner_of(ids, 13, 5)
    assert shard.shape == (2, 2) and local.shape == (2, 2)
    assert shard.dtype == np.int64
    assert shard.tolist() == [[0, 4], [1, 3]]
    assert owner_of([], 13, 5)[0].shape == (0,)
    assert owner_of(7, 13, 5)[0].tolist() == 2


def test_owner_of_rejects_out_of_range_and_non_integer_ids():
    with pytest.raises(ValueError, match=r"'ids' has invalid value 13: ids in \[0, 13\)"):
        owner_of([1, 13], 13, 5)
    with pytest.raises(ValueError, match=r"'ids' has invalid value -1: ids in \[0, 13\)"):
        owner_of([-1], 13, 5)
    with pytest.raises(ValueError, match="integers"):
        owner_of([1.5], 13, 5)
