# shellcheck shell=bash
# Sourced by the hack/device scripts: sets KPY to an interpreter that imports kubeps from this tree, with `kubeps`
# beside it (on PATH). The device machine's Python has numpy, grpcio, hypothesis, pytest (and CuPy, jax) but not
# kubeps's pure dependencies and reaches no package index: where it lacks them, a venv that sees the image's
# packages gets them from the wheels in $KUBEPS_WHEELS (default .gpu-deps, made with hack/device/wheels.sh).
# Needs REPO (the repository root), PY (the machine's python) and WORK (a scratch folder).
if "$PY" -c 'import kubeps.runtime, pydantic, cryptography, cloudpickle, threadpoolctl' 2>/dev/null \
    && [ -x "$(dirname "$(command -v "$PY")")/kubeps" ]; then
  KPY=$(command -v "$PY")
else
  VENV=$WORK/venv
  rm -rf "$VENV" "$WORK/src"
  "$PY" -m venv --system-site-packages "$VENV"
  # and the interpreter's own site folders by name (an image may keep its packages where the venv does not look);
  # the venv's own packages stay first on the path
  "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' \
    >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/image-site.pth"
  WHEELS=${KUBEPS_WHEELS:-$REPO/.gpu-deps}
  if ! "$VENV/bin/python" -c 'import pydantic, cryptography, cloudpickle, threadpoolctl, prometheus_client' 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl
  fi
  # kubeps from this tree: its source roots linked under one kubeps/ folder that a .pth file puts on the path
  mkdir -p "$WORK/src/kubeps"
  ln -s "$REPO/runtime" "$WORK/src/kubeps/runtime"
  ln -s "$REPO/operator" "$WORK/src/kubeps/operator"
  echo "$WORK/src" >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kubeps-src.pth"
  printf '#!%s\nimport sys\nfrom kubeps.runtime.cli import main\nsys.exit(main())\n' "$VENV/bin/python" >"$VENV/bin/kubeps"
  chmod +x "$VENV/bin/kubeps"
  KPY=$VENV/bin/python
fi
PATH=$(dirname "$KPY"):$PATH
export PATH
