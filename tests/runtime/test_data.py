"""Distributed input: the Dataset pipeline, InputContext, and auto-sharding as the distributed input guide says."""

from __future__ import annotations

import gc
import pickle
import threading
import time

import cloudpickle
import numpy as np
import pytest

from kubeps.runtime.data import (
    AUTOTUNE,
    AutoShardPolicy,
    Dataset,
    InputContext,
    Options,
    TextLineDataset,
    as_dataset,
    auto_shard,
    read_csv,
)


def values(dataset) -> list:
    """Elements as plain Python values (lists for arrays) for easy comparison."""
    out = []
    for element in dataset:
        out.append(_plain(element))
    return out


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kubeps-prefetch"]


def wait_no_prefetch_threads(timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefetch_threads() == []


@pytest.fixture
def twelve_in_files(tmp_path):
    """The guide's FILE example: file 1 holds 0..5, file 2 holds 6..11 (one number per line)."""
    paths = []
    for i, chunk in enumerate((range(0, 6), range(6, 12))):
        p = tmp_path / f"part-{i}.txt"
        p.write_text("".join(f"{v}\n" for v in chunk))
        paths.append(str(p))
    return paths


def lines_as_ints(paths, **kw):
    return Dataset.from_files(paths, reader="lines", **kw).map(lambda line: np.int64(line))


# -- InputContext -------------------------------------------------------------------------------------------------
def test_input_context_defaults_and_per_replica_batch_size():
    ctx = InputContext()
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 1)
    assert ctx.get_per_replica_batch_size(64) == 64
    ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16
    assert "input_pipeline_id=1" in repr(ctx)


def test_input_context_not_divisible_is_an_error():
    with pytest.raises(ValueError, match=r"`global_batch_size` 10 is not divisible by `num_replicas_in_sync` 4"):
        InputContext(num_replicas_in_sync=4).get_per_replica_batch_size(10)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"num_input_pipelines": 0}, "num_input_pipelines"),
        ({"num_input_pipelines": 2, "input_pipeline_id": 2}, "input_pipeline_id"),
        ({"input_pipeline_id": -1}, "input_pipeline_id"),
        ({"num_replicas_in_sync": 0}, "num_replicas_in_sync"),
    ],
)
def test_input_context_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        InputContext(**kwargs)


# -- sources ------------------------------------------------------------------------------------------------------
def test_from_tensor_slices_keeps_structure():
    x = np.arange(6).reshape(3, 2)
    y = np.array([10, 11, 12])
    assert values(Dataset.from_tensor_slices(x)) == [[0, 1], [2, 3], [4, 5]]
    assert values(Dataset.from_tensor_slices((x, y)))[1] == ([2, 3], 11)
    assert values(Dataset.from_tensor_slices({"x": x, "y": y}))[2] == {"x": [4, 5], "y": 12}
    assert values(Dataset.from_tensor_slices([1, 2, 3])) == [1, 2, 3]  # a list is a tensor, as in TF


def test_from_tensor_slices_rejects_mismatched_rows_and_scalars():
    with pytest.raises(ValueError, match=r"same size in their first dimension.*\[0\]: 3.*\[1\]: 2"):
        Dataset.from_tensor_slices((np.zeros(3), np.zeros(2)))
    with pytest.raises(ValueError, match="scalar"):
        Dataset.from_tensor_slices(np.float32(1.0))


def test_from_generator_calls_the_function_every_pass():
    calls = []

    def gen(n):
        calls.append(n)
        yield from range(n)

    ds = Dataset.from_generator(gen, args=(3,))
    assert values(ds) == [0, 1, 2]
    assert values(ds.repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert calls == [3, 3, 3]
    with pytest.raises(ValueError, match="generator function, not a generator object"):
        Dataset.from_generator(gen(3))


def test_from_iterable_and_one_shot_iterators():
    ds = Dataset.from_iterable([1, 2, 3])
    assert values(ds.repeat(2)) == [1, 2, 3, 1, 2, 3]
    one_shot = Dataset.from_iterable(iter([1, 2]))
    assert values(one_shot) == [1, 2]
    with pytest.raises(RuntimeError, match="one-shot iterator"):
        values(one_shot)
    assert values(as_dataset(range(3)).batch(2)) == [[0, 1], [2]]
    assert values(as_dataset((i * i for i in range(3)))) == [0, 1, 4]
    with pytest.raises(TypeError, match="iterable"):
        as_dataset(5)


def test_range_take_skip_filter_map():
    assert values(Dataset.range(10).skip(2).take(3)) == [2, 3, 4]
    assert values(Dataset.range(1, 10, 3)) == [1, 4, 7]
    assert values(Dataset.range(5).take(-1)) == [0, 1, 2, 3, 4]
    assert values(Dataset.range(10).filter(lambda x: x % 3 == 0)) == [0, 3, 6, 9]
    pairs = Dataset.from_tensor_slices((np.arange(3), np.arange(3) * 10))
    assert values(pairs.map(lambda a, b: a + b)) == [0, 11, 22]  # tuple elements are unpacked
    assert values(Dataset.from_tensor_slices({"a": np.arange(2)}).map(lambda d: d["a"] * 2)) == [0, 2]


# -- shuffle ------------------------------------------------------------------------------------------------------
def test_shuffle_with_seed_is_deterministic_and_a_permutation():
    a = values(Dataset.range(100).shuffle(10, seed=7))
    b = values(Dataset.range(100).shuffle(10, seed=7))
    c = values(Dataset.range(100).shuffle(10, seed=8))
    assert a == b
    assert a != c
    assert sorted(a) == list(range(100))
    assert a != list(range(100))


def test_shuffle_buffer_bounds_displacement():
    # With a buffer of B, element i cannot be emitted before position i - B + 1.
    out = values(Dataset.range(200).shuffle(5, seed=1))
    for pos, v in enumerate(out):
        assert pos >= v - 4
    assert values(Dataset.range(20).shuffle(1, seed=3)) == list(range(20))  # a buffer of one is the identity


def test_reshuffle_each_iteration():
    ds = Dataset.range(50).shuffle(50, seed=3)
    first, second = values(ds), values(ds)
    assert first != second and sorted(first) == sorted(second)
    # a fresh dataset with the same seed replays the same sequence of orders
    again = Dataset.range(50).shuffle(50, seed=3)
    assert values(again) == first and values(again) == second
    fixed = Dataset.range(50).shuffle(50, seed=3, reshuffle_each_iteration=False)
    assert values(fixed) == values(fixed)
    epochs = values(Dataset.range(20).shuffle(20, seed=5).repeat(2))
    assert epochs[:20] != epochs[20:] and sorted(epochs[:20]) == sorted(epochs[20:]) == list(range(20))


def test_shuffle_bad_arguments():
    with pytest.raises(ValueError, match=r"'buffer_size' has invalid value 0: an integer >= 1"):
        Dataset.range(3).shuffle(0)
    with pytest.raises(ValueError, match="seed"):
        Dataset.range(3).shuffle(2, seed=-1)


# -- repeat / batch -----------------------------------------------------------------------------------------------
def test_repeat():
    assert values(Dataset.range(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert values(Dataset.range(3).repeat(0)) == []
    assert values(Dataset.range(2).repeat().take(5)) == [0, 1, 0, 1, 0]
    assert values(Dataset.range(2).repeat(-1).take(3)) == [0, 1, 0]
    assert values(Dataset.range(0).repeat()) == []  # repeating nothing forever ends
    with pytest.raises(ValueError, match="count"):
        Dataset.range(2).repeat(-2)


def test_batch_shapes_and_drop_remainder():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10)
    batches = list(Dataset.from_tensor_slices((x, y)).batch(4))
    assert [b[0].shape for b in batches] == [(4, 2), (4, 2), (2, 2)]
    assert [b[1].shape for b in batches] == [(4,), (4,), (2,)]
    assert batches[0][0].dtype == np.float32
    dropped = list(Dataset.from_tensor_slices((x, y)).batch(4, drop_remainder=True))
    assert [b[0].shape for b in dropped] == [(4, 2), (4, 2)]
    # the generic (stacking) path gives the same as the array-slicing path
    stacked = list(Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a, b)).batch(4))
    for s, b in zip(stacked, batches):
        assert np.array_equal(s[0], b[0]) and np.array_equal(s[1], b[1])


def test_batch_dicts_and_guide_example():
    assert values(Dataset.range(6).batch(4)) == [[0, 1, 2, 3], [4, 5]]
    ds = Dataset.from_tensor_slices({"ids": np.arange(5), "w": np.ones((5, 3))}).filter(lambda d: True)
    b = next(iter(ds.batch(5)))
    assert set(b) == {"ids", "w"} and b["ids"].shape == (5,) and b["w"].shape == (5, 3)
    assert values(Dataset.range(2).repeat(3).batch(3).batch(2)) == [[[0, 1, 0], [1, 0, 1]]]


def test_batch_errors():
    with pytest.raises(ValueError, match=r"'batch_size' has invalid value 0: an integer >= 1"):
        Dataset.range(3).batch(0)
    ragged = Dataset.from_iterable([np.zeros(2), np.zeros(3)])
    with pytest.raises(ValueError, match=r"different shapes \(2,\) and \(3,\)"):
        list(ragged.batch(2))
    mixed = Dataset.from_iterable([(1, 2), 3])
    with pytest.raises(ValueError, match="different structures"):
        list(mixed.batch(2))


# -- shard --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shard_arithmetic(n):
    shards = [values(Dataset.range(17).shard(n, i)) for i in range(n)]
    for i, shard in enumerate(shards):
        assert shard == list(range(i, 17, n))
    assert sorted(sum(shards, [])) == list(range(17))


def test_shard_bad_arguments():
    with pytest.raises(ValueError, match=r"'index' has invalid value 2: an integer in 0..1 \(num_shards=2\)"):
        Dataset.range(4).shard(2, 2)
    with pytest.raises(ValueError, match="num_shards"):
        Dataset.range(4).shard(0, 0)


# -- files --------------------------------------------------------------------------------------------------------
def test_list_files_sorted_shuffled_and_missing(tmp_path):
    for name in ("b.txt", "a.txt", "c.txt", "skip.csv"):
        (tmp_path / name).write_text("x\n")
    pattern = str(tmp_path / "*.txt")
    assert values(Dataset.list_files(pattern, shuffle=False)) == [str(tmp_path / n) for n in ("a.txt", "b.txt", "c.txt")]
    shuffled = Dataset.list_files(pattern, seed=1)
    assert sorted(values(shuffled)) == values(Dataset.list_files(pattern, shuffle=False))
    assert values(Dataset.list_files(pattern, seed=1)) == values(Dataset.list_files(pattern, seed=1))
    with pytest.raises(ValueError, match=r"No files matched pattern: .*nothing-\*\.txt"):
        Dataset.list_files(str(tmp_path / "nothing-*.txt"))
    with pytest.raises(ValueError, match="No files matched pattern"):
        Dataset.list_files([str(tmp_path / "a.txt"), str(tmp_path / "missing.txt")])


def test_readers(tmp_path, twelve_in_files):
    assert values(TextLineDataset(twelve_in_files)) == [str(i) for i in range(12)]
    csv = tmp_path / "t.csv"
    csv.write_text("a,b\n1,2\n3,4.5\n")
    rows = values(Dataset.from_files(str(csv), reader=lambda p: read_csv(p, skip_header=True)))
    assert rows == [[1.0, 2.0], [3.0, 4.5]]
    bad = tmp_path / "bad.csv"
    bad.write_text("1,x\n")
    with pytest.raises(ValueError, match=r"bad.csv:1"):
        values(Dataset.from_files(str(bad), reader="csv"))
    np.save(tmp_path / "m.npy", np.arange(6).reshape(3, 2))
    assert values(Dataset.from_files(str(tmp_path / "m.npy"), reader="npy")) == [[0, 1], [2, 3], [4, 5]]
    np.savez(tmp_path / "d.npz", x=np.arange(4).reshape(2, 2), y=np.array([7, 8]))
    assert values(Dataset.from_files(str(tmp_path / "d.npz"), reader="npz")) == [
        {"x": [0, 1], "y": 7},
        {"x": [2, 3], "y": 8},
    ]
    with pytest.raises(ValueError, match=r"'reader' has invalid value 'parquet': one of \['criteo', 'csv', 'lines', 'npy', 'npz'\] or a callable"):
        Dataset.from_files(str(csv), reader="parquet")


def test_interleave_cycle_and_block(twelve_in_files):
    ds = Dataset.from_files(twelve_in_files, reader="lines", cycle_length=2)
    assert values(ds) == ["0", "6", "1", "7", "2", "8", "3", "9", "4", "10", "5", "11"]
    blocks = Dataset.range(2).interleave(lambda i: Dataset.range(4).map(lambda v: v + 10 * i), 2, block_length=2)
    assert values(blocks) == [0, 1, 10, 11, 2, 3, 12, 13]
    assert values(Dataset.range(3).flat_map(lambda i: [i] * i)) == [1, 2, 2]



def test_interleave_moves_on_after_an_exhausted_iterator_as_tf_data():
    """tf.data's own docstring example: when an iterator ends, interleave advances to the next slot of the cycle and
    refills the freed slot only when the cycle comes back to it (kubeps refilled it and read it at once)."""
    ds = Dataset.range(1, 6).interleave(lambda x: Dataset.from_tensors(x).repeat(6), cycle_length=2, block_length=4)
    assert values(ds) == [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 3, 3, 4, 4, 5, 5, 5, 5, 5, 5]
    # an iterator that ends mid-block hands over to the next slot at once; empty ones are skipped
    uneven = Dataset.range(4).interleave(lambda x: [int(x)] * [1, 3, 0, 2][int(x)], cycle_length=2, block_length=2)
    assert values(uneven) == [0, 1, 1, 1, 3, 3]

# -- auto-sharding ------------------------------------------------------------------------------------------------
def test_guide_data_example_two_workers():
    # One file of 0..11, per-replica batch of 2: worker 0 gets [0,1] [4,5] [8,9], worker 1 [2,3] [6,7] [10,11].
    ds = Dataset.range(12).batch(2)
    assert values(auto_shard(ds, 2, 0, AutoShardPolicy.DATA)) == [[0, 1], [4, 5], [8, 9]]
    assert values(auto_shard(ds, 2, 1, AutoShardPolicy.DATA)) == [[2, 3], [6, 7], [10, 11]]


def test_guide_off_example_two_workers(twelve_in_files):
    ds = lines_as_ints(twelve_in_files).batch(2)
    expected = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    for worker in (0, 1):
        assert values(auto_shard(ds, 2, worker, AutoShardPolicy.OFF)) == expected


def test_guide_file_example_two_workers(twelve_in_files):
    ds = lines_as_ints(twelve_in_files).batch(2)
    assert values(auto_shard(ds, 2, 0, AutoShardPolicy.FILE)) == [[0, 1], [2, 3], [4, 5]]
    assert values(auto_shard(ds, 2, 1, AutoShardPolicy.FILE)) == [[6, 7], [8, 9], [10, 11]]


@pytest.fixture
def six_files(tmp_path):
    paths = []
    for i in range(6):
        p = tmp_path / f"f{i}.txt"
        p.write_text(f"{10 * i}\n{10 * i + 1}\n")
        paths.append(str(p))
    return paths


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_file_policy_partitions_files(six_files, workers):
    ds = lines_as_ints(six_files, shuffle=True, seed=4)  # shuffled file order must not cause overlap
    seen = []
    for w in range(workers):
        part = values(auto_shard(ds, workers, w, AutoShardPolicy.FILE))
        expected_files = six_files[w::workers]
        assert sorted(part) == sorted(v for i, f in enumerate(six_files) if f in expected_files for v in (10 * i, 10 * i + 1))
        seen += part
    assert sorted(seen) == sorted(values(ds))


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_data_policy_partitions_elements(workers):
    ds = Dataset.range(10)
    parts = [values(auto_shard(ds, workers, w, AutoShardPolicy.DATA)) for w in range(workers)]
    assert parts == [list(range(w, 10, workers)) for w in range(workers)]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_off_policy_gives_everything(workers, six_files):
    for ds in (Dataset.range(7), lines_as_ints(six_files)):
        everything = values(ds)
        for w in range(workers):
            assert values(auto_shard(ds, workers, w, AutoShardPolicy.OFF)) == everything


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_auto_policy_is_file_for_files_and_data_otherwise(workers, six_files):
    file_ds = lines_as_ints(six_files)
    for w in range(workers):
        assert values(auto_shard(file_ds, workers, w)) == values(auto_shard(file_ds, workers, w, "FILE"))
        assert values(auto_shard(Dataset.range(9), workers, w)) == list(range(w, 9, workers))
    # any iterable is accepted and sharded by data
    assert values(auto_shard([5, 6, 7, 8], 2, 1)) == [6, 8]


def test_file_policy_errors(twelve_in_files):
    ds = lines_as_ints(twelve_in_files)
    with pytest.raises(ValueError, match=r"has 2 file\(s\) for 3 workers"):
        auto_shard(ds, 3, 0, AutoShardPolicy.FILE)
    with pytest.raises(ValueError, match=r"has 2 file\(s\) for 3 workers"):
        auto_shard(ds, 3, 2)  # AUTO on a file-based dataset: FILE, and the same error as in the guide
    with pytest.raises(ValueError, match=r"FILE needs a file-based dataset"):
        auto_shard(Dataset.range(4), 2, 0, AutoShardPolicy.FILE)


def test_policy_from_options_and_no_double_sharding(twelve_in_files):
    ds = lines_as_ints(twelve_in_files)
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    data_ds = ds.with_options(options)
    assert data_ds.options.experimental_distribute.auto_shard_policy == AutoShardPolicy.DATA
    assert ds.options.experimental_distribute.auto_shard_policy == AutoShardPolicy.AUTO  # unchanged
    assert values(auto_shard(data_ds, 3, 0)) == [0, 3, 6, 9]
    # options survive later transformations, and a sharded dataset is not sharded again
    sharded = auto_shard(data_ds.map(lambda x: x * 2), 3, 1)
    assert values(sharded) == [2, 8, 14, 20]
    assert sharded.options.experimental_distribute.auto_shard_policy == AutoShardPolicy.OFF
    assert values(auto_shard(sharded, 3, 2)) == [2, 8, 14, 20]


def test_auto_shard_bad_arguments():
    with pytest.raises(ValueError, match=r"'worker_index' has invalid value 2: an integer in 0..1 \(num_workers=2\)"):
        auto_shard(Dataset.range(3), 2, 2)
    with pytest.raises(ValueError, match="num_workers"):
        auto_shard(Dataset.range(3), 0, 0)
    with pytest.raises(ValueError, match="auto_shard_policy must be an AutoShardPolicy"):
        auto_shard(Dataset.range(3), 1, 0, "BY_FILE")
    options = Options()
    with pytest.raises(ValueError, match="auto_shard_policy"):
        options.experimental_distribute.auto_shard_policy = 7


# -- prefetch -----------------------------------------------------------------------------------------------------
def test_prefetch_yields_everything_in_order():
    assert values(Dataset.range(100).prefetch(3)) == list(range(100))
    assert values(Dataset.range(10).prefetch(AUTOTUNE).batch(4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert values(Dataset.range(5).prefetch(0)) == list(range(5))
    wait_no_prefetch_threads()


def test_prefetch_propagates_errors_after_earlier_elements():
    def gen():
        yield 1
        yield 2
        raise KeyError("broken record")

    it = iter(Dataset.from_generator(gen).prefetch(2))
    assert next(it) == 1 and next(it) == 2
    with pytest.raises(KeyError, match="broken record"):
        next(it)
    wait_no_prefetch_threads()


def test_prefetch_error_from_map_reaches_consumer():
    ds = Dataset.range(5).map(lambda x: 1 // (int(x) - 3)).prefetch(1)
    with pytest.raises(ZeroDivisionError):
        values(ds)
    wait_no_prefetch_threads()


def test_prefetch_buffer_is_bounded():
    produced = []

    def gen():
        for i in range(1000):
            produced.append(i)
            yield i

    it = iter(Dataset.from_generator(gen).prefetch(3))
    assert next(it) == 0
    time.sleep(0.2)
    # one handed out, up to 3 queued, one held by the producer waiting for room
    assert len(produced) <= 5
    it.close()
    wait_no_prefetch_threads()


def test_prefetch_thread_stops_on_close_and_garbage_collection():
    endless = Dataset.range(3).repeat().prefetch(2)
    with iter(endless) as it:
        assert next(it) == 0
        assert len(prefetch_threads()) == 1
    wait_no_prefetch_threads()

    it = iter(endless.batch(2).prefetch(2))  # two nested prefetch threads
    assert next(it).tolist() == [0, 1]
    assert len(prefetch_threads()) == 2
    del it
    gc.collect()
    wait_no_prefetch_threads()

    for _ in Dataset.range(3).repeat().prefetch(2):  # leaving a for loop early
        break
    gc.collect()
    wait_no_prefetch_threads()


def test_iterator_get_next_and_thread_safety():
    it = iter(Dataset.range(2000).prefetch(4))
    assert it.get_next() == 0
    got: list[int] = []
    lock = threading.Lock()

    def consume():
        for v in it:
            with lock:
                got.append(int(v))

    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 2000))
    wait_no_prefetch_threads()


def test_datasets_pickle_for_shipping_to_workers(six_files):
    ds = lines_as_ints(six_files).shuffle(4, seed=2).batch(3).prefetch(2)
    clone = cloudpickle.loads(cloudpickle.dumps(ds))
    assert values(clone) == values(lines_as_ints(six_files).shuffle(4, seed=2).batch(3))
    assert values(pickle.loads(pickle.dumps(Dataset.range(4).batch(2)))) == [[0, 1], [2, 3]]
    wait_no_prefetch_threads()


# -- the block-wise (vectorised) path gives exactly the element-wise sequence ------------------------------------
def _pipelines(source):
    rows = np.arange(5000, dtype=np.int64)
    data = (rows * 3, rows.astype(np.float32), {"k": rows % 7})
    return {
        "shuffle-batch": source(data).shuffle(300, seed=3).batch(64),
        "shard-shuffle-repeat-batch": source(data).shard(3, 1).shuffle(211, seed=5).repeat(3).batch(50, True),
        "buffer-of-one": source(data).shuffle(1, seed=1).batch(7),
        "buffer-larger-than-data": source(data).take(400).shuffle(10_000, seed=9).repeat(2).batch(33),
        "skip-take-shuffle": source(data).skip(11).take(3000).shuffle(100, seed=2).batch(13),
        "reshuffle-off": source(data).shuffle(64, seed=4, reshuffle_each_iteration=False).repeat(2).batch(100),
        "unbatched": source(data).shard(2, 0).shuffle(50, seed=8).take(700),
    }


@pytest.mark.parametrize("name", list(_pipelines(Dataset.from_tensor_slices)))
def test_block_path_matches_element_path(name):
    def element_source(data):  # a generator source has no blocks: every node below works per element
        return Dataset.from_generator(lambda: Dataset.from_tensor_slices(data).as_numpy_iterator())

    blocked = _pipelines(Dataset.from_tensor_slices)[name]
    per_element = _pipelines(element_source)[name]
    rowwise = lambda ds: ds._node if name == "unbatched" else ds._node.parent  # noqa: E731 - the node under the batch
    assert rowwise(blocked).blocks() is not None and rowwise(per_element).blocks() is None
    got, want = list(blocked), list(per_element)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        for x, y in zip(a[:2], b[:2]):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(a[2]["k"], b[2]["k"])


def test_block_sources_and_batches():
    # range and from_tensors work in blocks too; a batch inside one block is a view of the source (no copy)
    assert [list(b) for b in Dataset.range(3, 20, 4).batch(2)] == [[3, 7], [11, 15], [19]]
    assert [b.tolist() for b in Dataset.from_tensors(np.array([1, 2])).repeat(3).batch(2)] == [[[1, 2], [1, 2]],
                                                                                            [[1, 2]]]
    source = np.arange(100)
    first = next(iter(Dataset.from_tensor_slices(source).batch(10)))
    assert np.shares_memory(first, source)
    # a shuffled batch never aliases the shuffle's buffer: later batches do not change it
    it = iter(Dataset.from_tensor_slices(source).shuffle(20, seed=0).batch(10))
    first = next(it)
    snapshot = first.copy()
    rest = list(it)
    np.testing.assert_array_equal(first, snapshot)
    assert sorted(np.concatenate([first] + rest).tolist()) == list(range(100))
