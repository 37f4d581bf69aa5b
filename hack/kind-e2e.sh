#!/usr/bin/env bash
# End-to-end test on a kind cluster, as users' CI runs it:
#   create a kind cluster, build the runtime and operator images and load them into it, install the operator
#   (Helm chart, or the plain manifests of deploy/), run the CTR example as a PSTrainingJob and wait for it to
#   succeed, then optionally run the pytest suite against the same cluster. The cluster is deleted on exit.
#
#   hack/kind-e2e.sh [--install helm|manifests] [--job FILE] [--pytest] [--keep]
#
# Needs docker, kind, kubectl and (for --install helm) helm on PATH.
# Environment: KIND_CLUSTER (default kubeps-e2e), KIND_NODE_IMAGE (optional kindest/node image),
#   E2E_TIMEOUT (seconds to wait for the job, default 900), PYTHON (for --pytest, default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLUSTER="${KIND_CLUSTER:-kubeps-e2e}"
TIMEOUT="${E2E_TIMEOUT:-900}"
PYTHON="${PYTHON:-python3}"
INSTALL=helm
JOB_FILE="$ROOT/examples/ctr/job.yaml"
RUN_PYTEST=0
KEEP=0
TAG=e2e
OPERATOR_IMAGE="kubeps-operator:$TAG"
RUNTIME_IMAGE="kubeps-runtime:$TAG"
NAMESPACE=kubeps-system
JOB_NAMESPACE=kubeps-e2e

log() { printf '[kind-e2e] %s\n' "$*" >&2; }
die() { printf '[kind-e2e] error: %s\n' "$*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --install) INSTALL="${2:?--install needs helm or manifests}"; shift 2 ;;
    --job) JOB_FILE="${2:?--job needs a file}"; shift 2 ;;
    --pytest) RUN_PYTEST=1; shift ;;
    --keep) KEEP=1; shift ;;
    -h|--help) sed -n '2,12p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
[[ "$INSTALL" == helm || "$INSTALL" == manifests ]] || die "--install must be helm or manifests, not $INSTALL"
[[ -f "$JOB_FILE" ]] || die "job manifest $JOB_FILE not found"
for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool not found on PATH"
done
if [[ "$INSTALL" == helm ]]; then command -v helm >/dev/null 2>&1 || die "helm not found on PATH"; fi

KUBECONFIG_FILE="$(mktemp -t kubeps-kind-XXXXXX.kubeconfig)"
export KUBECONFIG="$KUBECONFIG_FILE"
JOB_NAME="$(awk '/^metadata:/ {m=1; next} m && /^  name:/ {print $2; exit}' "$JOB_FILE")"
[[ -n "$JOB_NAME" ]] || die "no metadata.name in $JOB_FILE"

cleanup() {
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    diagnose || true
  fi
  if [[ $KEEP -eq 1 ]]; then
    log "keeping cluster $CLUSTER (KUBECONFIG=$KUBECONFIG_FILE)"
  else
    log "deleting cluster $CLUSTER"
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    rm -f "$KUBECONFIG_FILE"
  fi
  exit "$rc"
}

diagnose() {
  log "---- job $JOB_NAMESPACE/$JOB_NAME"
  kubectl -n "$JOB_NAMESPACE" get psjob "$JOB_NAME" -o yaml || true
  kubectl -n "$JOB_NAMESPACE" get pods,services -o wide || true
  kubectl -n "$JOB_NAMESPACE" get events --sort-by=.lastTimestamp || true
  local pod
  for pod in $(kubectl -n "$JOB_NAMESPACE" get pods -o name 2>/dev/null); do
    log "---- logs of $pod"
    kubectl -n "$JOB_NAMESPACE" logs "$pod" --all-containers --tail=200 || true
    kubectl -n "$JOB_NAMESPACE" logs "$pod" --all-containers --previous --tail=50 2>/dev/null || true
  done
  log "---- operator"
  kubectl -n "$NAMESPACE" get deploy,pods -o wide || true
  kubectl -n "$NAMESPACE" logs deploy/kubeps --tail=300 || true
}
trap cleanup EXIT

log "creating kind cluster $CLUSTER"
kind_args=(create cluster --name "$CLUSTER" --kubeconfig "$KUBECONFIG_FILE" --wait 120s)
if [[ -n "${KIND_NODE_IMAGE:-}" ]]; then kind_args+=(--image "$KIND_NODE_IMAGE"); fi
kind "${kind_args[@]}"

log "building images $RUNTIME_IMAGE and $OPERATOR_IMAGE"
docker build --target runtime -t "$RUNTIME_IMAGE" "$ROOT"
docker build --target operator -t "$OPERATOR_IMAGE" "$ROOT"
kind load docker-image --name "$CLUSTER" "$RUNTIME_IMAGE" "$OPERATOR_IMAGE"

log "installing the operator ($INSTALL)"
if [[ "$INSTALL" == helm ]]; then
  helm install kubeps "$ROOT/charts/kubeps" --namespace "$NAMESPACE" --create-namespace \
    --set image.repository=kubeps-operator --set image.tag="$TAG" --set image.pullPolicy=Never \
    --set runtimeImage.repository=kubeps-runtime --set runtimeImage.tag="$TAG" \
    --wait --timeout 180s
else
  kubectl apply --server-side -f "$ROOT/deploy/crd.yaml"
  # The plain manifests name the published images; point them at the ones just loaded.
  sed -e "s#image: \"[^\"]*kubeps-operator[^\"]*\"#image: \"$OPERATOR_IMAGE\"#" \
      -e "s#--default-image=.*#--default-image=$RUNTIME_IMAGE#" \
      -e "s#imagePullPolicy: IfNotPresent#imagePullPolicy: Never#" \
      "$ROOT/deploy/operator.yaml" | kubectl apply --server-side -f -
  kubectl -n "$NAMESPACE" rollout status deployment/kubeps --timeout=180s
fi

log "running $JOB_NAME from $JOB_FILE"
kubectl create namespace "$JOB_NAMESPACE"
kubectl -n "$JOB_NAMESPACE" apply -f "$JOB_FILE"
deadline=$((SECONDS + TIMEOUT))
state=""
while (( SECONDS < deadline )); do
  state="$(kubectl -n "$JOB_NAMESPACE" get psjob "$JOB_NAME" \
    -o jsonpath='{range .status.conditions[?(@.status=="True")]}{.type}{"\n"}{end}' 2>/dev/null || true)"
  if grep -qx Succeeded <<<"$state"; then break; fi
  if grep -qx Failed <<<"$state"; then die "job $JOB_NAME failed"; fi
  sleep 5
done
grep -qx Succeeded <<<"$state" || die "job $JOB_NAME did not succeed within ${TIMEOUT}s"
kubectl -n "$JOB_NAMESPACE" get psjob "$JOB_NAME"
log "job $JOB_NAME succeeded; chief's last lines:"
kubectl -n "$JOB_NAMESPACE" logs "$JOB_NAME-chief-0" --tail=20 || true

if [[ $RUN_PYTEST -eq 1 ]]; then
  log "running the pytest suite against the kind cluster"
  KUBEPS_TEST_KUBECONFIG="$KUBECONFIG_FILE" KUBEPS_REQUIRE_CONTROL_PLANE=1 \
    "$PYTHON" -m pytest -m kube "$ROOT/tests"
fi
log "e2e passed"
