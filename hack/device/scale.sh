#!/usr/bin/env bash
# The scaling curve on a many-core machine, in one run of about 5 minutes (docs/scaling.md):
#   1. bench/scaling.py: the CTR workload (numpy layers, batch 512, mutual TLS) as 2+2, 2+4, 4+8 ps+workers and
#      4+8 with 2 and 3 server processes per ps task; examples/s, CPU per task, cores per ps, efficiency vs 2+2,
#      context switches per step and, where py-spy is installed (hack/device/wheels.sh carries it), the share of
#      time ps-0 and worker-0 hold the GIL (SCALE_GIL_S seconds of each timed span, default 3; 0: not sampled);
#   2. bench/ps_capacity.py: one ps task's pulls+pushes/s given 1, 2, 4, 8 cores (taskset), as 1 process and as one
#      per core, its 6 clients sharing the cores;
#   3. bench/dispatch.py: one chief and 64, then 256 lightweight workers running 50 ms functions: closures/s, the
#      chief's CPU and context switches per closure (SCALE_DISPATCH=0 leaves it out).
# Writes the table to $OUT/scaling.txt (and prints it), the raw figures to $OUT/*.json and the runs' output to
# $OUT/*.log. Needs python3 with kubeps and its dependencies importable, numpy and grpcio; no TensorFlow.
#
#   OUT=/some/dir bash hack/device/scale.sh
#
# A dry run with tiny sizes: SCALE_STEPS=200 SCALE_EXAMPLES=20000 SCALE_SECONDS=1 SCALE_CORES=1,2 \
#   SCALE_JOBS=1+1,1+2x2 SCALE_DISPATCH_WORKERS=8,16 SCALE_CLOSURES=1000 OUT=/tmp/scale bash hack/device/scale.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
PY=${PYTHON:-python3}
: "${OUT:?set OUT to the folder the table goes to}"
mkdir -p "$OUT"
STEPS=${SCALE_STEPS:-2000}
EXAMPLES=${SCALE_EXAMPLES:-524288}
SECONDS_EACH=${SCALE_SECONDS:-4}
CORES=${SCALE_CORES:-1,2,4,8}
JOBS=${SCALE_JOBS:-2+2,2+4,4+8,4+8x2,4+8x3}
CLIENTS=${SCALE_CLIENTS:-6}
# the data set is written once, outside $OUT (which comes back)
export XDG_CACHE_HOME=${SCALE_CACHE:-/tmp/kubeps-scale-cache}
started=$(date +%s)

{
  echo "kubeps scaling, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $($PY -c 'import platform; print("Python", platform.python_version())'), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
} > "$OUT/scaling.txt"

GIL_S=${SCALE_GIL_S:-3}
if [ "$GIL_S" != 0 ] && ! command -v py-spy >/dev/null && [ ! -x "$(dirname "$(command -v "$PY")")/py-spy" ]; then
  echo "py-spy not found: the GIL is not sampled" >> "$OUT/scaling.txt"
  GIL_S=0
fi
timeout "${SCALE_SCALING_S:-150}" "$PY" bench/scaling.py --jobs "$JOBS" --steps "$STEPS" --train-examples "$EXAMPLES" \
  --eval-examples 20000 --gil-seconds "$GIL_S" --json "$OUT/scaling.json" > "$OUT/scaling.log" 2>&1
status_scaling=$?
timeout "${SCALE_CAPACITY_S:-80}" "$PY" bench/ps_capacity.py --cores "$CORES" --clients "$CLIENTS" --seconds "$SECONDS_EACH" \
  --json "$OUT/ps_capacity.json" > "$OUT/ps_capacity.log" 2>&1
status_capacity=$?
status_dispatch=skipped
if [ "${SCALE_DISPATCH:-1}" != 0 ]; then
  timeout "${SCALE_DISPATCH_S:-150}" "$PY" bench/dispatch.py --workers "${SCALE_DISPATCH_WORKERS:-64,256}" --hosts 12 \
    --closures "${SCALE_CLOSURES:-12000}" --closure-ms 50 --idle-s 1 > "$OUT/dispatch.log" 2>&1
  status_dispatch=$?
fi

{
  echo "== bench/scaling.py --jobs $JOBS --steps $STEPS --train-examples $EXAMPLES (exit status $status_scaling)"
  sed -n '/^ *ps + workers/,$p' "$OUT/scaling.log"
  [ "$status_scaling" = 0 ] || tail -n 30 "$OUT/scaling.log"
  echo
  echo "== bench/ps_capacity.py --cores $CORES --clients $CLIENTS --seconds $SECONDS_EACH (exit status $status_capacity)"
  sed -n '/^ *cores/,$p' "$OUT/ps_capacity.log"
  [ "$status_capacity" = 0 ] || tail -n 30 "$OUT/ps_capacity.log"
  echo
  if [ "$status_dispatch" != skipped ]; then
    # exit status 1: a goal line says MISSED (the figures are still there)
    echo "== bench/dispatch.py --workers ${SCALE_DISPATCH_WORKERS:-64,256} --closure-ms 50 (exit status $status_dispatch)"
    tail -n 8 "$OUT/dispatch.log"
    echo
  fi
  echo "took $(( $(date +%s) - started )) s"
} >> "$OUT/scaling.txt"
cat "$OUT/scaling.txt"
[ "$status_scaling" = 0 ] && [ "$status_capacity" = 0 ]
