#!/usr/bin/env bash
# prometheus-operator's PodMonitor and ServiceMonitor CRDs, for the tests that validate the chart's monitors offline
# (tests/packaging/test_chart.py) and install them on the control plane (tests/packaging/test_install.py).
#
#   hack/monitoring-crds.sh build    generate them into a cache outside the repo (instant when cached)
#   hack/monitoring-crds.sh dir      print the directory holding podmonitors.yaml and servicemonitors.yaml
#
# The module proxy serves prometheus-operator's API types (github.com/prometheus-operator/prometheus-operator/
# pkg/apis/monitoring) but not the main module that carries the released CRD YAML, so the CRDs are generated the way
# prometheus-operator's own `make generate` does: controller-gen over the types' kubebuilder markers. Same schema
# generator and markers, not the byte-identical release file.
#
# Environment:
#   KUBEPS_MONITORING_CRDS_CACHE  cache root (default ${XDG_CACHE_HOME:-~/.cache}/kubeps/monitoring-crds)
#   GO                            go binary (default: go on PATH, else /usr/local/go/bin/go)
set -euo pipefail

MONITORING_VERSION="v0.95.2"
CONTROLLER_TOOLS_VERSION="v0.17.3"
CACHE_ROOT="${KUBEPS_MONITORING_CRDS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubeps/monitoring-crds}"
DIR="$CACHE_ROOT/prometheus-operator-$MONITORING_VERSION"

log() { printf '[monitoring-crds] %s\n' "$*" >&2; }
die() { printf '[monitoring-crds] error: %s\n' "$*" >&2; exit 1; }

# shellcheck source=hack/go-modules.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-modules.sh"

have_all() { [[ -s "$DIR/podmonitors.yaml" && -s "$DIR/servicemonitors.yaml" ]]; }

# fill GO: the cache directory's files
fill() {
  local go=$1 src module=github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring
  src="$(module_dir "$go" "$module@$MONITORING_VERSION")"
  [[ -n "$src" && -d "$src/v1" ]] || die "$module@$MONITORING_VERSION not served"
  log "generating the PodMonitor and ServiceMonitor CRDs with controller-gen $CONTROLLER_TOOLS_VERSION from $module@$MONITORING_VERSION"
  rm -rf "$DIR/.out"
  controller_gen_crds "$go" "$src" "$CONTROLLER_TOOLS_VERSION" ./v1/... "$DIR/.out" ||
    die "controller-gen failed on $module@$MONITORING_VERSION"
  for kind in podmonitors servicemonitors; do
    [[ -s "$DIR/.out/monitoring.coreos.com_$kind.yaml" ]] || die "controller-gen wrote no monitoring.coreos.com_$kind.yaml"
    mv -f "$DIR/.out/monitoring.coreos.com_$kind.yaml" "$DIR/$kind.yaml"
  done
  rm -rf "$DIR/.out"
}

cache_main "$@"
