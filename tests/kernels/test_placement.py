"""Where a worker's layers compute (``kernels.use_device``): the batched transfers, the GPU layers against the CPU
ones, and a GPU that is asked for and absent failing at once. The GPU cases skip with the reason where CuPy sees no
GPU (as in CI); ``hack/device/gpu.sh`` runs them on a GPU machine."""

from __future__ import annotations

import numpy as np
import pytest

from kubeps.runtime.ops import kernels as K
from kubeps.runtime.ops import nn
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.variables.indexed_slices import IndexedSlices

GPU, WHY = K.cupy_available()
needs_gpu = pytest.mark.skipif(not GPU, reason=f"GPU placement: {WHY}")


@pytest.fixture(autouse=True)
def cpu_afterwards():
    yield
    K.use_device(TaskSettings(device="cpu"))


def test_cpu_placement_leaves_arrays_where_they_are():
    assert K.use_device(TaskSettings(device="cpu")) == "CPU (numpy)"
    a, b = np.arange(3.0), np.ones((2, 2), np.int64)
    moved = K.to_device(a, b)
    assert moved[0] is a and moved[1] is b
    assert K.to_host([a, b])[0] is a
    assert K.compute_module() is np


@pytest.mark.skipif(GPU, reason="a GPU is visible: the missing-GPU error cannot happen here")
def test_gpu_asked_for_and_absent_fails_with_the_reason():
    with pytest.raises(K.DeviceUnavailableError, match=r"KUBEPS_DEVICE=gpu was requested but .*KUBEPS_DEVICE=cpu"):
        K.use_device(TaskSettings(device="gpu"))
    assert K.compute_module() is np  # nothing was half-switched


def test_memory_share_divides_the_usable_memory_between_the_gpu_tasks():
    assert K.memory_share(TaskSettings()) == pytest.approx(0.9)
    assert K.memory_share(TaskSettings(gpu_tasks=4)) == pytest.approx(0.225)


@needs_gpu
def test_batched_transfers_round_trip_every_dtype_and_shape():
    import cupy

    K.use_device(TaskSettings(device="gpu", gpu_tasks=4))
    limit = cupy.get_default_memory_pool().get_limit()
    assert limit == int(cupy.cuda.runtime.memGetInfo()[1] * 0.225)
    host = [np.arange(7, dtype=np.int64), np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32),
            np.zeros((0, 4), np.float32), np.array(2.5), np.arange(6, dtype=np.uint8).reshape(2, 3)]
    dev = K.to_device(*host)
    assert all(type(d).__module__.startswith("cupy") for d in dev)
    for h, d in zip(host, dev):
        assert d.shape == h.shape and d.dtype == h.dtype
        np.testing.assert_array_equal(d.get(), h)
    back = K.to_host([d * 2 for d in dev] + ["not an array"])
    for h, b in zip(host, back):
        assert isinstance(b, np.ndarray)
        np.testing.assert_array_equal(b, h * 2)
    assert back[-1] == "not an array"


@needs_gpu
def test_a_model_trains_the_same_on_the_gpu_as_on_the_cpu():
    """Embedding + Dense head: one SGD step on local variables, CPU vs GPU placement, to float32 precision; the
    gradients reach the variables as host arrays (moved back by apply_gradients in one transfer)."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 50, size=(64, 3))
    dense = rng.normal(size=(64, 5)).astype(np.float32)
    labels = (rng.random(64) < 0.3).astype(np.float32)
    table = rng.uniform(-0.05, 0.05, size=(50, 4)).astype(np.float32)
    results = {}
    for device in ("cpu", "gpu"):
        K.use_device(TaskSettings(device=device))
        emb = nn.Embedding(50, 4, embeddings=nn._new_variable(table.copy(), "emb"))
        head = nn.MLP([16, 8], 1, input_dim=3 * 4 + 5, seed=3)
        loss_fn = nn.SigmoidCrossEntropy()
        rows = emb.forward(ids)
        (on_device,) = K.to_device(dense)  # the program's own batch arrays: one transfer
        xp = K.array_module(rows)
        x = xp.concatenate([rows.reshape(64, -1), on_device], axis=1)
        loss = loss_fn.forward(head.forward(x)[:, 0], labels)
        dx = head.backward(loss_fn.backward()[:, None])
        emb.backward(dx[:, :12].reshape(64, 3, 4))
        pairs = nn.all_grads_and_vars([emb, head])
        if device == "gpu":
            assert any(isinstance(g, IndexedSlices) and type(g.values).__module__.startswith("cupy") for g, _ in pairs)
        SGD(0.1).apply_gradients(pairs)
        results[device] = (loss, emb.embeddings.numpy(), [v.numpy() for v in head.trainable_variables])
    assert results["gpu"][0] == pytest.approx(results["cpu"][0], rel=1e-5)
    np.testing.assert_allclose(results["gpu"][1], results["cpu"][1], rtol=1e-5, atol=1e-6)
    for g, c in zip(results["gpu"][2], results["cpu"][2]):
        np.testing.assert_allclose(g, c, rtol=1e-4, atol=1e-6)
