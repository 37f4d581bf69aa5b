# syntax=docker/dockerfile:1
# kubeps images. Targets:
#   runtime       CPU runtime for chief/ps/worker/evaluator pods (numpy, grpcio, kubeps.runtime, tensorboardX)
#   runtime-keras runtime + Keras 3 and JAX (pip install kubeps[keras,tensorboard]): Keras models trained with fit
#   runtime-gpu   runtime + CuPy for CUDA 13 with its CUDA libraries from PyPI (pip install kubeps[gpu]); the driver
#                 comes from the node (NVIDIA container toolkit). --build-arg GPU_EXTRA=gpu-cuda12 for CUDA 12 drivers
#   operator      the kopf operator (pip install kubeps[operator]); ENTRYPOINT `kubeps operator`
# Build: docker build --target runtime -t kubeps-runtime .   (same for runtime-gpu, operator)
# Base images are pinned by tag and digest; override with --build-arg PYTHON_IMAGE=...
# (re-resolve a digest with `docker buildx imagetools inspect python:3.11-slim-bookworm`).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b
# OCI labels of the images (org.opencontainers.image.*): hack/release.sh and hack/kind.sh pass the version
# (kubeps.runtime.contract.VERSION) and the git revision; runtime-keras and runtime-gpu inherit runtime's.
ARG KUBEPS_VERSION=unknown
ARG KUBEPS_REVISION=unknown
ARG KUBEPS_SOURCE=https://github.com/kubeps/kubeps

# ---------------------------------------------------------------- builder: the kubeps wheel
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY operator/ operator/
COPY runtime/ runtime/
RUN python -m pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------- the venvs, built where they will live
# (/opt/venv: a venv's scripts name their interpreter by absolute path, so it is never moved).
FROM ${PYTHON_IMAGE} AS runtime-venv
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
# The dependencies first, from pyproject.toml alone (images/requirements.py): this layer stays cached while only the
# source changes. The tensorboard extra (tensorboardX, ~1 MB with protobuf): a job that sets KUBEPS_LOGDIR writes
# event files.
COPY pyproject.toml images/requirements.py /tmp/deps/
RUN python -m venv /opt/venv \
 && python /tmp/deps/requirements.py /tmp/deps/pyproject.toml tensorboard >/tmp/deps/requirements.txt \
 && /opt/venv/bin/pip install -r /tmp/deps/requirements.txt \
 && rm -rf /tmp/deps
COPY --from=builder /wheels /wheels
# kubeps_pid1: a pod's main process (PID 1) exits on SIGTERM instead of ignoring it (see the file).
COPY images/runtime/ /tmp/pid1/
# kubeps itself; `pip check`: the layer above holds what the wheel requires
RUN WHEEL="$(ls /wheels/kubeps-*.whl)" \
 && /opt/venv/bin/pip install --no-deps "${WHEEL}" \
 && /opt/venv/bin/pip check \
 && mv /tmp/pid1/kubeps_pid1.py /tmp/pid1/kubeps_pid1.pth "$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"

FROM ${PYTHON_IMAGE} AS operator-venv
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
COPY pyproject.toml images/requirements.py /tmp/deps/
RUN python -m venv /opt/venv \
 && python /tmp/deps/requirements.py /tmp/deps/pyproject.toml operator >/tmp/deps/requirements.txt \
 && /opt/venv/bin/pip install -r /tmp/deps/requirements.txt \
 && rm -rf /tmp/deps
COPY --from=builder /wheels /wheels
RUN WHEEL="$(ls /wheels/kubeps-*.whl)" \
 && /opt/venv/bin/pip install --no-deps "${WHEEL}" \
 && /opt/venv/bin/pip check

# ---------------------------------------------------------------- runtime (CPU)
# runtime-base is the runtime without its labels: runtime, runtime-keras and runtime-gpu are built on it, so a new
# revision (a label) rebuilds none of their layers.
FROM ${PYTHON_IMAGE} AS runtime-base
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN groupadd --gid 65532 kubeps \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kubeps
COPY --from=runtime-venv /opt/venv /opt/venv
# The example programs, so a PSTrainingJob can run them without building an image of its own.
COPY examples/ /opt/kubeps/examples/
WORKDIR /opt/kubeps
USER 65532:65532
# Pods of a PSTrainingJob that name no command start a task server from TF_CONFIG.
CMD ["python", "-m", "kubeps.runtime.server"]

FROM runtime-base AS runtime
ARG KUBEPS_VERSION
ARG KUBEPS_REVISION
ARG KUBEPS_SOURCE
LABEL org.opencontainers.image.title="kubeps-runtime" \
      org.opencontainers.image.version="${KUBEPS_VERSION}" \
      org.opencontainers.image.revision="${KUBEPS_REVISION}" \
      org.opencontainers.image.source="${KUBEPS_SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"

# ---------------------------------------------------------------- operator
FROM ${PYTHON_IMAGE} AS operator
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
RUN groupadd --gid 65532 kubeps \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kubeps
COPY --from=operator-venv /opt/venv /opt/venv
USER 65532:65532
EXPOSE 8080 9090
ARG KUBEPS_VERSION
ARG KUBEPS_REVISION
ARG KUBEPS_SOURCE
LABEL org.opencontainers.image.title="kubeps-operator" \
      org.opencontainers.image.version="${KUBEPS_VERSION}" \
      org.opencontainers.image.revision="${KUBEPS_REVISION}" \
      org.opencontainers.image.source="${KUBEPS_SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENTRYPOINT ["kubeps", "operator"]
CMD ["--all-namespaces"]

# ---------------------------------------------------------------- runtime-keras (runtime + Keras 3, JAX)
# Keras models trained with kubeps's fit, models written with jax.numpy (examples/keras, examples/ctr/train_jax.py).
# A stage of its own: jax's CPU wheel alone is ~350 MB installed, which jobs of numpy models need not pull. Built on
# runtime-base as the runtime image is, so a node holding both stores the shared layers once; this layer holds only the keras extra's
# packages (pyproject.toml's list for the extra, as the runtime's dependency layer; what is installed already is
# kept), checked against the installed kubeps.
FROM runtime-base AS runtime-keras
USER 0
COPY pyproject.toml images/requirements.py /tmp/deps/
RUN python /tmp/deps/requirements.py /tmp/deps/pyproject.toml keras >/tmp/deps/requirements.txt \
 && PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/venv/bin/pip install -r /tmp/deps/requirements.txt \
 && /opt/venv/bin/pip check \
 && rm -rf /tmp/deps
ENV KERAS_BACKEND=jax
USER 65532:65532
ARG KUBEPS_VERSION
ARG KUBEPS_REVISION
ARG KUBEPS_SOURCE
LABEL org.opencontainers.image.title="kubeps-runtime-keras" \
      org.opencontainers.image.version="${KUBEPS_VERSION}" \
      org.opencontainers.image.revision="${KUBEPS_REVISION}" \
      org.opencontainers.image.source="${KUBEPS_SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"

# ---------------------------------------------------------------- runtime-gpu (runtime + CuPy, CUDA 13)
# Built on runtime-base as runtime-keras is: the same Python, kubeps and pid-1 hook, one more layer. CUDA's
# user-space libraries come from PyPI with CuPy (cupy-cuda13x[ctk]: nvidia-cuda-runtime, cuBLAS, NVRTC ...), not from
# an nvidia/cuda base image; the driver (libcuda) is the node's, mounted by the NVIDIA container toolkit, which reads
# NVIDIA_VISIBLE_DEVICES and NVIDIA_DRIVER_CAPABILITIES. CUDA 13 (the default) needs a driver >= 580 on the node;
# GPU_EXTRA=gpu-cuda12 builds the CUDA 12 variant for older drivers. The last RUN imports CuPy and kubeps's kernels
# without a GPU (what CI can check): a wheel that does not load fails the build, not the first pod.
FROM runtime-base AS runtime-gpu
ARG GPU_EXTRA=gpu
USER 0
COPY pyproject.toml images/requirements.py /tmp/deps/
RUN python /tmp/deps/requirements.py /tmp/deps/pyproject.toml "${GPU_EXTRA}" >/tmp/deps/requirements.txt \
 && PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/venv/bin/pip install -r /tmp/deps/requirements.txt \
 && /opt/venv/bin/pip check \
 && rm -rf /tmp/deps \
 && python -c "import cupy, kubeps.runtime.ops.kernels as k; print('CuPy', cupy.__version__, k.cupy_available())"
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 65532:65532
ARG KUBEPS_VERSION
ARG KUBEPS_REVISION
ARG KUBEPS_SOURCE
LABEL org.opencontainers.image.title="kubeps-runtime-gpu" \
      org.opencontainers.image.version="${KUBEPS_VERSION}" \
      org.opencontainers.image.revision="${KUBEPS_REVISION}" \
      org.opencontainers.image.source="${KUBEPS_SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"
CMD ["python", "-m", "kubeps.runtime.server"]
