"""Array kernels, run on every backend; the CuPy case skips with a reason when CuPy or a GPU is absent."""

from __future__ import annotations

import itertools
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from kubeps.runtime.ops import kernels as K
from kubeps.runtime.settings import TaskSettings


@pytest.fixture(params=["numpy", "cupy"])
def xp(request):
    if request.param == "cupy":
        ok, reason = K.cupy_available()
        if not ok:
            pytest.skip(f"cupy backend: {reason}")
        import cupy

        return cupy
    return np


# ------------------------------------------------------------------------------------------------------------
# Backend switch
# ------------------------------------------------------------------------------------------------------------


def test_cpu_is_forced_by_env():
    assert K.backend_name(TaskSettings.from_env({"KUBEPS_DEVICE": "cpu"})) == "numpy"
    assert K.backend(TaskSettings.from_env({"KUBEPS_DEVICE": " CPU "})) is np


def test_auto_picks_cupy_only_when_a_gpu_is_usable():
    ok, _ = K.cupy_available()
    assert K.backend_name(TaskSettings()) == ("cupy" if ok else "numpy")


def test_gpu_request_without_gpu_is_an_error_not_a_cpu_run():
    ok, reason = K.cupy_available()
    if ok:
        assert K.backend_name(TaskSettings(device="gpu")) == "cupy"
        return
    with pytest.raises(K.DeviceUnavailableError, match=r"KUBEPS_DEVICE=gpu was requested but .*KUBEPS_DEVICE=cpu"):
        K.backend(TaskSettings(device="gpu"))
    assert reason


def test_unknown_device_is_rejected():
    with pytest.raises(ValueError, match=r"'KUBEPS_DEVICE' has invalid value 'tpu': 'cpu', 'gpu'"):
        K.backend_name(TaskSettings.from_env({"KUBEPS_DEVICE": "tpu"}))


def test_backend_follows_the_settings_not_the_process_environment(monkeypatch):
    monkeypatch.setenv("KUBEPS_DEVICE", "gpu")  # read where the task starts, not here
    assert K.backend(TaskSettings(device="cpu")) is np


def test_array_module_follows_inputs(xp):
    assert K.array_module(xp.zeros(2)) is xp
    assert K.array_module(np.zeros(1), xp.zeros(1)) is xp


# ------------------------------------------------------------------------------------------------------------
# Embedding gather and sparse reduction
# ------------------------------------------------------------------------------------------------------------


def test_embedding_gather(xp):
    table = xp.arange(20, dtype=xp.float32).reshape(5, 4)
    out = K.embedding_gather(table, xp.asarray([[4, 0], [0, 2]]))
    assert out.shape == (2, 2, 4)
    np.testing.assert_array_equal(K.to_numpy(out[0, 0]), [16, 17, 18, 19])
    np.testing.assert_array_equal(K.to_numpy(out[1, 1]), [8, 9, 10, 11])
    with pytest.raises(IndexError, match=r"row id 5; allowed: 0 <= id < 5"):
        K.embedding_gather(table, xp.asarray([1, 5]))
    with pytest.raises(TypeError, match=r"integer row ids"):
        K.embedding_gather(table, xp.asarray([1.0]))


def loop_reduce(ids, vals):
    acc = {}
    for i, v in zip(ids.tolist(), vals):
        acc[i] = acc.get(i, 0) + v.astype(np.float64)
    keys = sorted(acc)
    return np.array(keys, dtype=np.int64), np.array([acc[k] for k in keys])


@pytest.mark.parametrize("case", ["random-dups", "no-dups", "one-id-many-times", "high-multiplicity-mix",
                                  "every-multiplicity", "rank3"])
def test_reduce_sparse_matches_loop(xp, case):
    rng = np.random.default_rng(7)
    if case == "random-dups":
        ids = rng.integers(0, 50, size=200)
    elif case == "no-dups":
        ids = rng.permutation(100)[:40]
    elif case == "one-id-many-times":
        ids = np.full(300, 9)  # past the rank passes: the rest of the segment summed by reduceat
    elif case == "high-multiplicity-mix":
        ids = np.concatenate([np.full(20, 3), np.arange(10), np.full(5, 7)])
        rng.shuffle(ids)
    elif case == "every-multiplicity":  # ids occurring 1 to 40 times: some end in the passes, some in reduceat
        ids = rng.permutation(np.repeat(rng.permutation(1000)[:40], np.arange(1, 41)))
    else:
        ids = rng.integers(0, 8, size=30)
    shape = (ids.size, 3, 2) if case == "rank3" else (ids.size, 4)
    vals = rng.normal(size=shape).astype(np.float32)
    u, s = K.reduce_sparse(xp.asarray(ids), xp.asarray(vals))
    want_u, want_s = loop_reduce(ids, vals)
    np.testing.assert_array_equal(K.to_numpy(u), want_u)
    assert K.to_numpy(u).dtype == np.int64 and s.dtype == np.float32
    np.testing.assert_allclose(K.to_numpy(s), want_s, rtol=1e-5, atol=1e-5)


def test_reduce_sparse_empty_and_errors(xp):
    u, s = K.reduce_sparse(xp.zeros(0, dtype=xp.int64), xp.zeros((0, 3)))
    assert u.shape == (0,) and s.shape == (0, 3)
    with pytest.raises(ValueError, match=r"values must have shape \(len\(indices\), ...\) = \(2, ...\)"):
        K.reduce_sparse(xp.asarray([1, 2]), xp.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"indices must be 1-D"):
        K.reduce_sparse(xp.asarray([[1, 2]]), xp.zeros((1, 2)))
    with pytest.raises(TypeError, match=r"integer row ids"):
        K.reduce_sparse(xp.asarray([1.5]), xp.zeros((1, 2)))


# ------------------------------------------------------------------------------------------------------------
# Dense, activations, losses
# ------------------------------------------------------------------------------------------------------------


def test_dense_forward_backward_match_loops(xp):
    rng = np.random.default_rng(3)
    x, w, b, dy = rng.normal(size=(3, 4)), rng.normal(size=(4, 2)), rng.normal(size=2), rng.normal(size=(3, 2))
    y = K.to_numpy(K.dense_forward(xp.asarray(x), xp.asarray(w), xp.asarray(b)))
    dx, dw, db = (K.to_numpy(a) for a in K.dense_backward(xp.asarray(x), xp.asarray(w), xp.asarray(dy)))
    for i, j in itertools.product(range(3), range(2)):
        assert y[i, j] == pytest.approx(sum(x[i, k] * w[k, j] for k in range(4)) + b[j])
    for i, k in itertools.product(range(3), range(4)):
        assert dx[i, k] == pytest.approx(sum(dy[i, j] * w[k, j] for j in range(2)))
    for k, j in itertools.product(range(4), range(2)):
        assert dw[k, j] == pytest.approx(sum(x[i, k] * dy[i, j] for i in range(3)))
    np.testing.assert_allclose(db, dy.sum(axis=0))
    assert K.dense_backward(xp.asarray(x), xp.asarray(w), xp.asarray(dy), with_bias=False)[2] is None
    with pytest.raises(ValueError, match=r"x \(3, 4\) @ w \(3, 2\)"):
        K.dense_forward(xp.asarray(x), xp.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"b has shape \(3,\); expected \(2,\)"):
        K.dense_forward(xp.asarray(x), xp.asarray(w), xp.zeros(3))
    with pytest.raises(ValueError, match=r"dy has shape \(2, 2\); expected \(3, 2\)"):
        K.dense_backward(xp.asarray(x), xp.asarray(w), xp.zeros((2, 2)))


def test_activations(xp):
    x = xp.asarray([-2.0, -0.0, 0.5, 3.0])
    np.testing.assert_allclose(K.to_numpy(K.relu(x)), [0, 0, 0.5, 3])
    np.testing.assert_allclose(K.to_numpy(K.relu_grad(x, xp.ones(4))), [0, 0, 1, 1])
    np.testing.assert_allclose(K.to_numpy(K.sigmoid(x)), 1 / (1 + np.exp(-K.to_numpy(x))))
    np.testing.assert_allclose(K.to_numpy(K.tanh(x)), np.tanh(K.to_numpy(x)))
    y = K.sigmoid(x)
    np.testing.assert_allclose(K.to_numpy(K.sigmoid_grad(y, xp.ones(4))), K.to_numpy(y * (1 - y)))
    t = K.tanh(x)
    np.testing.assert_allclose(K.to_numpy(K.tanh_grad(t, 2 * xp.ones(4))), 2 * (1 - K.to_numpy(t) ** 2))


def test_sigmoid_and_its_loss_are_stable_at_extremes(xp):
    x = xp.asarray([-1000.0, -50.0, 50.0, 1000.0], dtype=xp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow in exp would raise here
        s = K.to_numpy(K.sigmoid(x))
        loss = K.to_numpy(K.sigmoid_cross_entropy_with_logits(x, xp.asarray([1.0, 0.0, 1.0, 0.0], dtype=xp.float32)))
    assert s.dtype == np.float32 and s[0] == 0.0 and s[-1] == 1.0
    np.testing.assert_allclose(loss, [1000.0, 0.0, 0.0, 1000.0], atol=1e-6)


def test_sigmoid_cross_entropy_matches_definition(xp):
    rng = np.random.default_rng(4)
    x, z = rng.normal(size=10) * 3, rng.uniform(size=10)
    p = 1 / (1 + np.exp(-x))
    want = -z * np.log(p) - (1 - z) * np.log(1 - p)
    np.testing.assert_allclose(K.to_numpy(K.sigmoid_cross_entropy_with_logits(xp.asarray(x), xp.asarray(z))), want)
    np.testing.assert_allclose(K.to_numpy(K.sigmoid_cross_entropy_with_logits_grad(xp.asarray(x), xp.asarray(z))),
                               p - z)
    with pytest.raises(ValueError, match=r"labels has shape \(3,\); expected the logits' shape \(10,\)"):
        K.sigmoid_cross_entropy_with_logits(xp.asarray(x), xp.zeros(3))


def test_softmax_cross_entropy_matches_definition_and_is_stable(xp):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, 5)) * 2
    z = np.eye(5)[[0, 3, 3, 1]]
    e = np.exp(x)
    want = -(z * np.log(e / e.sum(1, keepdims=True))).sum(1)
    np.testing.assert_allclose(K.to_numpy(K.softmax_cross_entropy_with_logits(xp.asarray(x), xp.asarray(z))), want)
    big = xp.asarray([[1000.0, 0.0], [0.0, 1000.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = K.to_numpy(K.softmax_cross_entropy_with_logits(big, xp.asarray([[0.0, 1.0], [0.0, 1.0]])))
    np.testing.assert_allclose(out, [1000.0, 0.0])
    np.testing.assert_allclose(K.to_numpy(K.softmax(xp.asarray(x))).sum(1), 1.0)


# ------------------------------------------------------------------------------------------------------------
# AUC
# ------------------------------------------------------------------------------------------------------------


def pairwise_auc(y, s):
    pos = [a for a, l in zip(s, y) if l == 1]
    neg = [a for a, l in zip(s, y) if l == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_auc_matches_pairwise_definition_with_ties(xp):
    rng = np.random.default_rng(6)
    for _ in range(5):
        y = rng.integers(0, 2, size=60)
        s = rng.integers(0, 6, size=60) / 5.0  # many ties
        assert K.auc(xp.asarray(y), xp.asarray(s)) == pytest.approx(pairwise_auc(y, s))
    assert K.auc([0, 0, 1, 1], [0.1, 0.2, 0.8, 0.9]) == 1.0
    assert K.auc([1, 1, 0, 0], [0.1, 0.2, 0.8, 0.9]) == 0.0
    assert K.auc([0, 1, 0, 1], [0.5] * 4) == 0.5


def test_auc_errors():
    with pytest.raises(ValueError, match=r"needs both classes, got 3 positives and 0 negatives"):
        K.auc([1, 1, 1], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"labels must be 0 or 1"):
        K.auc([0, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match=r"labels has 2 values, scores has 3"):
        K.auc([0, 1], [0.1, 0.2, 0.3])


def test_reduce_sparse_passes_ascending_unique_ids_through():
    ids = np.array([2, 5, 9], dtype=np.int64)
    values = np.arange(6, dtype=np.float32).reshape(3, 2)
    out_ids, out_values = K.reduce_sparse(ids, values)
    np.testing.assert_array_equal(out_ids, ids)
    assert out_values is values  # no copy on the ps's hot path
    # one duplicate or one step down and the general path sums and sorts
    for ids in (np.array([2, 5, 5]), np.array([5, 2, 9])):
        got_ids, got = K.reduce_sparse(ids, values)
        want = {}
        for i, row in zip(ids.tolist(), values):
            want[i] = want.get(i, 0) + row
        np.testing.assert_array_equal(got_ids, sorted(want))
        np.testing.assert_array_equal(got, np.array([want[i] for i in sorted(want)]))


def test_the_sparse_update_benchmark_runs():
    """``bench/sparse_update.py`` (docs/kernels.md, ``make bench``) runs as documented, at a small size."""
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(repo / "bench" / "sparse_update.py"), "--rows", "20000", "--ids", "512",
                          "--repeat", "2"], capture_output=True, text=True, timeout=120, cwd=repo)
    assert out.returncode == 0, out.stderr
    assert "kubeps apply_sparse" in out.stdout and "x faster" in out.stdout


@pytest.mark.parametrize("shape, dtype, contiguous", [((50, 16), np.float32, True), ((50, 3, 2), np.float64, True),
                                                      ((50, 4), np.float32, False), ((50,), np.int64, True)])
def test_set_rows_writes_the_rows_of_the_ids_and_nothing_else(xp, shape, dtype, contiguous):
    rng = np.random.default_rng(3)
    table = xp.asarray(rng.normal(size=shape).astype(dtype))
    if not contiguous:  # every other column of a wider table: the plain assignment
        table = xp.asarray(rng.normal(size=(shape[0], 2 * shape[1])).astype(dtype))[:, ::2]
    before = K.to_numpy(table).copy()
    ids = xp.asarray(rng.permutation(shape[0])[:17])
    rows = xp.asarray(rng.normal(size=(17,) + tuple(table.shape[1:])).astype(dtype))
    K.set_rows(table, ids, rows)
    want = before.copy()
    want[K.to_numpy(ids)] = K.to_numpy(rows)
    np.testing.assert_array_equal(K.to_numpy(table), want)


def test_set_rows_of_no_ids_changes_nothing_even_in_an_empty_table():
    for table in (np.zeros((0, 4), np.float32), np.arange(20, dtype=np.float32).reshape(5, 4)):
        before = table.copy()
        K.set_rows(table, np.zeros(0, np.int64), np.zeros((0, 4), np.float32))
        np.testing.assert_array_equal(table, before)
