#!/usr/bin/env bash
# The PodGroup CRDs of the two out-of-tree gang schedulers kubeps can drive, for the tests that check the operator's
# PodGroups against them (tests/operator/test_gang.py).
#
#   hack/gang-crds.sh build    fetch them from the Go module proxy into a cache outside the repo (instant when cached)
#   hack/gang-crds.sh dir      print the directory holding scheduler-plugins.yaml and volcano.yaml (after build)
#
# * scheduler-plugins (coscheduling): manifests/coscheduling/crd.yaml of sigs.k8s.io/scheduler-plugins, the file its
#   install docs apply, as released.
# * Volcano: the module that serves Volcano's API types (volcano.sh/apis) ships no CRD YAML, and the module with the
#   YAML (volcano.sh/volcano) is not served by the proxy. So the CRD is generated the way Volcano's own `make
#   manifests` does: controller-gen over volcano.sh/apis' pkg/apis/scheduling/v1beta1 (its kubebuilder markers).
#   Same schema generator and markers, not the byte-identical release file.
#
# Environment:
#   KUBEPS_GANG_CRDS_CACHE  cache root (default ${XDG_CACHE_HOME:-~/.cache}/kubeps/gang-crds)
#   GO                      go binary (default: go on PATH, else /usr/local/go/bin/go)
set -euo pipefail

SCHEDULER_PLUGINS_VERSION="v0.34.7"
VOLCANO_APIS_VERSION="v1.12.1"
CONTROLLER_TOOLS_VERSION="v0.17.3"
CACHE_ROOT="${KUBEPS_GANG_CRDS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubeps/gang-crds}"
DIR="$CACHE_ROOT/scheduler-plugins-$SCHEDULER_PLUGINS_VERSION-volcano-apis-$VOLCANO_APIS_VERSION"

log() { printf '[gang-crds] %s\n' "$*" >&2; }
die() { printf '[gang-crds] error: %s\n' "$*" >&2; exit 1; }

# shellcheck source=hack/go-modules.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-modules.sh"

have_all() { [[ -s "$DIR/scheduler-plugins.yaml" && -s "$DIR/volcano.yaml" ]]; }

# fill GO: the cache directory's files
fill() {
  local go=$1 src
  src="$(module_dir "$go" "sigs.k8s.io/scheduler-plugins@$SCHEDULER_PLUGINS_VERSION")"
  [[ -n "$src" && -s "$src/manifests/coscheduling/crd.yaml" ]] ||
    die "sigs.k8s.io/scheduler-plugins@$SCHEDULER_PLUGINS_VERSION has no manifests/coscheduling/crd.yaml"
  install -m 644 "$src/manifests/coscheduling/crd.yaml" "$DIR/scheduler-plugins.yaml.partial"
  mv -f "$DIR/scheduler-plugins.yaml.partial" "$DIR/scheduler-plugins.yaml"

  src="$(module_dir "$go" "volcano.sh/apis@$VOLCANO_APIS_VERSION")"
  [[ -n "$src" && -d "$src/pkg/apis/scheduling/v1beta1" ]] || die "volcano.sh/apis@$VOLCANO_APIS_VERSION not served"
  log "generating Volcano's PodGroup CRD with controller-gen $CONTROLLER_TOOLS_VERSION from volcano.sh/apis@$VOLCANO_APIS_VERSION"
  rm -rf "$DIR/.out"
  controller_gen_crds "$go" "$src" "$CONTROLLER_TOOLS_VERSION" ./pkg/apis/scheduling/v1beta1/... "$DIR/.out" ||
    die "controller-gen failed on volcano.sh/apis@$VOLCANO_APIS_VERSION"
  [[ -s "$DIR/.out/scheduling.volcano.sh_podgroups.yaml" ]] || die "controller-gen wrote no scheduling.volcano.sh_podgroups.yaml"
  mv -f "$DIR/.out/scheduling.volcano.sh_podgroups.yaml" "$DIR/volcano.yaml"
  rm -rf "$DIR/.out"
}

cache_main "$@"
