"""The ``runtime-gpu`` image, built as a release builds it (``hack/kind.sh gpu-image``: the Dockerfile's runtime-gpu
target, CuPy for CUDA 13 and CUDA's libraries from PyPI) and run on a machine without a GPU, as CI and most nodes
are: CuPy and kubeps's kernels import, and a worker task asked for the GPU fails at start with the reason instead
of training on the CPU. kind's nodes have no GPU, so the image is run with ``docker run`` and not loaded into them
(3 GB each); on a GPU machine the same wheels run the GPU tests (``hack/device/gpu.sh``).

It runs last (``test_zz_``), after every test that times pods, because the cold build downloads 1.3 GB and
unpacks 3 GB; docker's layer cache makes the next build a few seconds."""

from __future__ import annotations

import json
import subprocess

from .conftest import KIND_SH, Kind, record, _step

GPU_IMAGE = "kubeps-runtime-gpu:e2e"


def _docker_run(kind: Kind, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    flags = [word for key, value in (env or {}).items() for word in ("-e", f"{key}={value}")]
    return subprocess.run(["docker", "run", "--rm", "--network", "none", *flags, GPU_IMAGE, *args], env=kind.env,
                          capture_output=True, text=True, timeout=300)


def test_zz_the_gpu_image_imports_cupy_and_its_worker_refuses_to_train_without_a_gpu(kind: Kind):
    record("kind.sh gpu-image (runtime-gpu build)",
           _step("hack/kind.sh gpu-image", str(KIND_SH), "gpu-image", env=kind.env, timeout=1800))
    probe = _docker_run(kind, "python", "-c", "import json, cupy, kubeps.runtime.ops.kernels as k; "
                                              "print(json.dumps([cupy.__version__, *k.cupy_available()]))")
    assert probe.returncode == 0, probe.stdout + probe.stderr
    version, usable, why = json.loads(probe.stdout.strip().splitlines()[-1])
    assert version.startswith("14."), version  # cupy-cuda13x, the pinned major
    assert usable is False and "no CUDA GPU is visible" in why, why  # CuPy loaded; the node has no GPU

    # The image's own command (python -m kubeps.runtime.server) as a worker pod would run it, asked for the GPU.
    tf_config = {"cluster": {"ps": ["127.0.0.1:2223"], "worker": ["127.0.0.1:2222"]},
                 "task": {"type": "worker", "index": 0}}
    worker = _docker_run(kind, env={"TF_CONFIG": json.dumps(tf_config), "KUBEPS_DEVICE": "gpu",
                                    "KUBEPS_JOB_TOKEN": "e2e-gpu-image-token", "KUBEPS_BIND_HOST": "127.0.0.1"})
    assert worker.returncode == 2, worker.stdout + worker.stderr
    assert "DeviceUnavailableError" in worker.stderr and "KUBEPS_DEVICE=gpu was requested but" in worker.stderr, \
        worker.stderr
    assert "no CUDA GPU is visible" in worker.stderr, worker.stderr
