"""``KUBEPS_DEVICE=gpu`` is never a silent CPU run: without a GPU every task that would compute fails at start with
the reason -- ``kubeps local`` before it starts any task, a worker task when it starts -- while a ps (whose updates run
on numpy) serves as always. With a GPU (``hack/device/gpu.sh``), a worker logs the GPU it computes on and holds a
CUDA context, and a ps holds none."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubeps.runtime.cluster import TFConfig
from kubeps.runtime.ops.kernels import cupy_available

from .conftest import TOKEN, free_ports

REPO = Path(__file__).resolve().parents[2]
GPU, WHY = cupy_available()


def _env(**updates: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEPS_") and k != "TF_CONFIG"}
    env.update(updates)
    return env


def _task_env(cluster: dict, job: str, index: int, **updates: str) -> dict[str, str]:
    return _env(TF_CONFIG=TFConfig.for_task(cluster, job, index).to_json(), KUBEPS_JOB_TOKEN=TOKEN,
                KUBEPS_BIND_HOST="127.0.0.1", KUBEPS_DEVICE="gpu", **updates)


@pytest.mark.skipif(GPU, reason="a GPU is visible: kubeps local would train on it")
def test_kubeps_local_refuses_gpu_without_one_and_starts_no_task():
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "1", "--workers", "2",
                             "examples/mlp/train.py", "--", "--steps", "20"], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env=_env(KUBEPS_DEVICE="gpu"))
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "KUBEPS_DEVICE=gpu" in out and "no task was started" in out, out
    assert ("CuPy is not installed" in out) or ("no CUDA GPU is visible" in out), out
    assert "[worker-" not in out and "[chief-" not in out, out  # no task ran, on any device
    assert time.monotonic() - started < 60


@pytest.mark.skipif(GPU, reason="a GPU is visible: the worker would compute on it")
def test_a_worker_task_asked_for_a_gpu_fails_at_start_and_a_ps_serves():
    ps_port, worker_port = free_ports(2)
    cluster = {"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{worker_port}"]}
    worker = subprocess.run([sys.executable, "-m", "kubeps.runtime.server"], capture_output=True, text=True,
                            timeout=60, env=_task_env(cluster, "worker", 0))
    assert worker.returncode == 2, worker.stderr
    assert "DeviceUnavailableError" in worker.stderr and "KUBEPS_DEVICE=gpu was requested but" in worker.stderr
    ps = subprocess.Popen([sys.executable, "-m", "kubeps.runtime.server"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=_task_env(cluster, "ps", 0))
    try:
        assert ps.stdout is not None
        line = ps.stdout.readline()
        while line and "server ready" not in line:
            line = ps.stdout.readline()
        assert "server ready: /job:ps/task:0" in line
    finally:
        ps.terminate()
        ps.wait(timeout=30)


@pytest.mark.skipif(not GPU or shutil.which("nvidia-smi") is None, reason=f"GPU placement: {WHY or 'no nvidia-smi'}")
def test_on_a_gpu_the_worker_holds_a_cuda_context_and_the_ps_none():
    ps_port, worker_port = free_ports(2)
    cluster = {"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{worker_port}"]}
    procs = {job: subprocess.Popen([sys.executable, "-m", "kubeps.runtime.server"], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=_task_env(cluster, job, 0))
             for job in ("ps", "worker")}
    try:
        logs = {}
        for job, proc in procs.items():
            assert proc.stdout is not None
            lines = [proc.stdout.readline()]
            while lines[-1] and "server ready" not in lines[-1]:
                lines.append(proc.stdout.readline())
            logs[job] = "".join(lines)
        assert "kubeps worker task 0 computes on GPU" in logs["worker"], logs["worker"]
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.split()
        pids = {int(p) for p in apps if p.strip().isdigit()}
        # inside a container nvidia-smi may list no pids, or the host's (another pid namespace): then say so
        if procs["worker"].pid not in pids:
            pytest.skip(f"nvidia-smi lists {sorted(pids)}, not this namespace's worker pid: context check not possible")
        assert procs["ps"].pid not in pids, (pids, logs)
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(timeout=30)


def test_kubeps_local_gives_workers_that_share_a_gpu_their_memory_share(monkeypatch, tmp_path):
    """With a GPU visible (pretended here) the workers of kubeps local share it: each is told KUBEPS_GPU_TASKS =
    the worker count, whether KUBEPS_DEVICE says gpu or is unset; with cpu, or one set by the user, nothing
    changes."""
    from kubeps.runtime.local import launcher

    monkeypatch.setattr(launcher, "cupy_available", lambda: (True, ""))
    script = tmp_path / "job.py"
    script.write_text("")

    def gpu_tasks(**env: str) -> str | None:
        cluster = launcher.LocalCluster(str(script), num_ps=1, num_workers=3, env=_env(**env))
        try:
            return cluster.task_env("worker", 0).get("KUBEPS_GPU_TASKS")
        finally:
            cluster.stop()

    assert gpu_tasks(KUBEPS_DEVICE="gpu") == gpu_tasks() == "3"
    assert gpu_tasks(KUBEPS_DEVICE="cpu") is None
    assert gpu_tasks(KUBEPS_DEVICE="gpu", KUBEPS_GPU_TASKS="8") == "8"
