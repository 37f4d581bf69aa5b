#!/usr/bin/env bash
# The long fuzz profile on a many-core machine, in one run of at most ~8 minutes: $FUZZ_PROCS processes (default: one
# per core less 4, each drives its own ps and worker processes) run the RPC target (tests/fuzz/test_fuzz_rpc.py) with
# KUBEPS_FUZZ=long and their own hypothesis seed, $FUZZ_EXAMPLES inputs each, and one more process runs every other
# target of tests/fuzz with $FUZZ_OTHER_EXAMPLES inputs each. Each process's output goes to $OUT/fuzz-*.log; the summary (the inputs
# each ran, from hypothesis's statistics, and any failure: an INTERNAL or UNKNOWN answer fails the RPC target) to
# $OUT/fuzz.txt. Exit status: the number of processes that failed.
#
#   OUT=/some/dir bash hack/device/fuzz.sh                  # from the repository root
#   FUZZ_PROCS=1 FUZZ_EXAMPLES=50 OUT=/tmp/fz bash hack/device/fuzz.sh    # a dry run
set -uo pipefail
cd "$(dirname "$0")/../.." || exit
REPO=$PWD
: "${OUT:?set OUT to the folder the summary goes to}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WORK=${TMPDIR:-/tmp}/kubeps-fuzz
mkdir -p "$WORK"
# shellcheck source=hack/device/python.sh
source "$REPO/hack/device/python.sh"
PROCS=${FUZZ_PROCS:-$(( $(nproc) > 5 ? $(nproc) - 4 : 1 ))}
EXAMPLES=${FUZZ_EXAMPLES:-9000}
OTHER_EXAMPLES=${FUZZ_OTHER_EXAMPLES:-2500}
LIMIT=${FUZZ_SECONDS:-420}
SUMMARY=$OUT/fuzz.txt
started=$(date +%s)
echo "kubeps long fuzz at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) CPUs, $(date -u +%FT%TZ): $PROCS x the RPC target ($EXAMPLES inputs each) + the other targets ($OTHER_EXAMPLES each), ${LIMIT}s limit" >"$SUMMARY"

run() {  # run NAME SEED INPUTS TARGET...: one pytest process in the background
  local name=$1 seed=$2 inputs=$3
  shift 3
  KUBEPS_FUZZ=long KUBEPS_FUZZ_EXAMPLES=$inputs timeout --kill-after=10 "$LIMIT" "$KPY" -m pytest -q -s \
    -p no:cacheprovider --hypothesis-show-statistics --hypothesis-seed="$seed" "$@" >"$OUT/fuzz-$name.log" 2>&1 &
}
for i in $(seq 1 "$PROCS"); do
  run "rpc-$i" "$((1000 + i))" "$EXAMPLES" tests/fuzz/test_fuzz_rpc.py
done
run other 7 "$OTHER_EXAMPLES" tests/fuzz/test_fuzz_parsers.py tests/fuzz/test_fuzz_hostile.py
failed=0
for job in $(jobs -p); do
  wait "$job" || failed=$((failed + 1))
done

# the inputs each process ran: hypothesis's statistics ("- N passing, M failing, and K invalid test cases"), and for
# the RPC target the status codes it prints
"$KPY" - "$OUT" >>"$SUMMARY" <<'PY'
import ast, pathlib, re, sys
total = 0
for log in sorted(pathlib.Path(sys.argv[1]).glob("fuzz-*.log")):
    text = log.read_text(errors="replace")
    runs = [int(n) for n in re.findall(r"(\d+) passing, ", text)]
    # the RPC target draws its calls inside one test and prints the status code of each
    codes = re.findall(r"status codes of the fuzzed calls: (\{.*\})", text)
    if codes:
        counts = ast.literal_eval(codes[-1])
        runs = [sum(counts.values())]
        print(f"{log.name}: status codes {counts}")
    failing = sum(int(n) for n in re.findall(r"(\d+) failing, ", text))
    outcome = re.findall(r"^=*\s*(\d+ (?:passed|failed|error).*?)\s*=*$", text, re.M)
    print(f"{log.name}: {sum(runs)} passing inputs, {failing} failing, {outcome[-1] if outcome else 'no pytest summary (killed?)'}")
    if "rpc" in log.name:
        total += sum(runs)
    for line in [ln for ln in text.splitlines() if "INTERNAL" in ln or "UNKNOWN" in ln][:5]:
        print("   ", line[:300])
print(f"RPC target: {total} passing inputs in all")
PY
echo "processes failed: $failed; took $(( $(date +%s) - started )) s" >>"$SUMMARY"
cat "$SUMMARY"
exit "$failed"
