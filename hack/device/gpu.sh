#!/usr/bin/env bash
# The GPU checks, run once on a GPU machine (about 4 minutes): results to $OUT/gpu.txt, printed as they come.
#
#   OUT=/some/dir bash hack/device/gpu.sh        # from the repository root
#
# 1. tests/kernels (the CuPy cases included) and the placement tests (tests/runtime/test_device_placement.py);
# 2. the dense-heavy CTR variant (head 1024-1024-512-256, batch 4096): GPU workers vs CPU workers, same run;
# 3. the standard CTR shape: CPU, CPU + overlap, GPU, GPU + overlap, same run;
# 4. 4 GPU worker processes on one GPU (numpy layers, then JAX), each given its memory share: no memory error.
# Where no GPU is visible (a dry run) the same steps run small on the CPU and step 4 checks that KUBEPS_DEVICE=gpu
# is refused, so the plumbing is exercised everywhere. The machine's Python needs numpy and grpcio (and CuPy, jax
# for the GPU parts); the other dependencies come from wheels in $KUBEPS_WHEELS (default .gpu-deps, made with
# hack/device/wheels.sh) when that Python lacks them. Each step has a time limit; a failing step is reported and
# the script goes on; the exit status is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
OUT=${OUT:-/tmp/kubeps-gpu-out}
mkdir -p "$OUT"
REPORT=$OUT/gpu.txt
: >"$REPORT"
PY=${PYTHON:-python3}
WORK=${TMPDIR:-/tmp}/kubeps-gpu
mkdir -p "$WORK"
FAILED=0

say() { echo "$*" | tee -a "$REPORT"; }
# step NAME SECONDS CMD...: run CMD with a time limit, its output into the report
step() {
  local name=$1 limit=$2 started rc
  shift 2
  say ""
  local shown="$*"
  say "=== $name (limit ${limit}s): ${shown:0:240}"
  started=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$REPORT"
  rc=${PIPESTATUS[0]}
  say "=== $name: exit $rc in $(( $(date +%s) - started ))s"
  [ "$rc" -eq 0 ] || FAILED=$((FAILED + 1))
}

# -- an interpreter that imports kubeps, with `kubeps` beside it (the benchmark starts `kubeps local` from there) --
# shellcheck source=hack/device/python.sh
source "$REPO/hack/device/python.sh"

say "kubeps GPU checks at $(git rev-parse --short HEAD 2>/dev/null || echo '?') on $(hostname), $(nproc) CPUs, $(date -u +%FT%TZ)"
say "python: $KPY ($("$KPY" -V 2>&1))"
"$KPY" - <<'PY' 2>&1 | tee -a "$REPORT"
import importlib
for name in ("numpy", "grpc", "cupy", "jax"):
    try:
        print(f"  {name} {importlib.import_module(name).__version__}")
    except Exception as err:  # noqa: BLE001
        print(f"  {name}: not importable ({type(err).__name__}: {err})")
from kubeps.runtime.ops.kernels import cupy_available
print("  CuPy GPU:", cupy_available())
PY
if "$KPY" -c 'from kubeps.runtime.ops.kernels import cupy_available as c; raise SystemExit(0 if c()[0] else 1)'; then
  GPU=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$REPORT"
else
  GPU=0
  say "no GPU visible to CuPy: a dry run (small sizes, CPU only)"
fi

DATA=$WORK/ctr-data
if [ "$GPU" = 1 ]; then
  TRAIN=262144 EVAL=20000 DENSE_STEPS=80 DENSE_BATCH=4096 STD_STEPS=1000 GPUFLAG=--gpu
else
  TRAIN=16384 EVAL=2000 DENSE_STEPS=40 DENSE_BATCH=256 STD_STEPS=40 GPUFLAG=
fi
HEAD=1024,1024,512,256
# --timeout: the benchmark stops a run of its own that takes longer (and its tasks with it)
COMMON=(--rounds 1 --train-examples "$TRAIN" --eval-examples "$EVAL" --data "$DATA" --warmup-executions 2 --timeout 60)

step "1. kernel and placement tests" 120 "$KPY" -m pytest -q -p no:cacheprovider tests/kernels \
  tests/runtime/test_device_placement.py

# the CPU workers' side of the dense-heavy run is the slow one (~45 GFLOP a step): it gets 100 s
step "2. dense-heavy CTR: head $HEAD, batch $DENSE_BATCH" 140 "$KPY" bench/ctr_vs_tf.py "${COMMON[@]}" --timeout 100 \
  $GPUFLAG --head "$HEAD" --batch-size "$DENSE_BATCH" --steps "$DENSE_STEPS" --json "$OUT/dense_heavy.json"

step "3. standard CTR shape, batch 512: overlap on and off" 100 "$KPY" bench/ctr_vs_tf.py "${COMMON[@]}" $GPUFLAG \
  --overlap --steps "$STD_STEPS" --json "$OUT/standard.json"

four_workers() {  # 4 workers of PROGRAM sharing the GPU, with GPU memory sampled meanwhile
  local program=$1 smi=
  if [ "$GPU" = 1 ]; then
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader -lms 500 >"$OUT/memory-$2.csv" &
    smi=$!
  fi
  KUBEPS_DEVICE=gpu timeout 50 kubeps local --ps 2 --workers 4 "$program" -- --data "$DATA" --steps 80 --batch-size 8192 \
    --head "$HEAD" --steps-per-execution 10 --warmup-executions 1 2>&1 | tee "$OUT/four-$2.log"
  local rc=${PIPESTATUS[0]}
  [ -n "$smi" ] && kill "$smi" 2>/dev/null
  if grep -qiE "out of memory|RESOURCE_EXHAUSTED|OutOfMemory" "$OUT/four-$2.log"; then
    echo "a memory error in the log"; return 1
  fi
  if [ "$GPU" = 1 ]; then
    [ -f "$OUT/memory-$2.csv" ] && echo "peak GPU memory used: $(sort -n "$OUT/memory-$2.csv" | tail -1)"
    return "$rc"
  fi
  # dry run: no GPU, so KUBEPS_DEVICE=gpu must have been refused before any task started
  [ "$rc" -ne 0 ] && grep -q "no task was started" "$OUT/four-$2.log"
}
export GPU DATA HEAD OUT
export -f four_workers
step "4a. 4 GPU workers on one GPU: numpy layers on CuPy" 60 \
  bash -c "four_workers bench/ctr/kubeps_ctr.py numpy"
if "$KPY" -c 'import jax' 2>/dev/null; then
  step "4b. 4 GPU workers on one GPU: JAX" 60 \
    bash -c "four_workers bench/ctr/jax_ctr.py jax"
fi

say ""
say "failed steps: $FAILED; report: $REPORT"
exit "$FAILED"
