#!/usr/bin/env bash
# The wheels hack/device/gpu.sh installs where the GPU machine's Python lacks kubeps's pure dependencies (that
# machine reaches no package index): downloaded here for its Python (3.12 unless PYVER says otherwise) into
# .gpu-deps/ (git ignores it), to carry there beside the tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYVER=${PYVER:-3.12}
python3 -m pip download --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .gpu-deps 'pydantic>=2.5' 'cryptography>=42' 'cloudpickle>=3.0' 'prometheus-client>=0.19' \
  'threadpoolctl>=3.1' 'pytest-timeout>=2.2' 'py-spy>=0.4'
