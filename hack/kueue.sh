#!/usr/bin/env bash
# Real Kueue for the kubeps Kueue tests (tests/kueue), built from the Go module proxy.
#
#   hack/kueue.sh build   compile Kueue's manager (sigs.k8s.io/kueue/cmd/kueue) and copy its CRDs and webhook
#                         manifests from the same module into a cache outside the repo (instant when cached)
#   hack/kueue.sh dir     print the cache directory: kueue (the binary), crds/*.yaml, webhook/manifests.yaml
#
# The tests start Kueue themselves against the loopback control plane of hack/controlplane.sh (a pytest fixture:
# certificates of their own, webhooks addressed by URL on 127.0.0.1, so no Service or kube-proxy is needed) and stop
# it again. `go install sigs.k8s.io/kueue/cmd/kueue@v0.19.2` does not work offline (it asks the proxy for the
# module's version list), so the module is downloaded and built inside a copy of it, with its own go.mod and go.sum.
# Environment:
#   KUBEPS_KUEUE_CACHE       cache root (default ${XDG_CACHE_HOME:-~/.cache}/kubeps/kueue)
#   GO                       go binary (default: go on PATH, else /usr/local/go/bin/go)
#   KUBEPS_KUEUE_BUILD_JOBS  parallel go build jobs (default 2)
set -euo pipefail

KUEUE_VERSION="v0.19.2"
CACHE_ROOT="${KUBEPS_KUEUE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubeps/kueue}"
DIR="$CACHE_ROOT/kueue-$KUEUE_VERSION"

log() { printf '[kueue] %s\n' "$*" >&2; }
die() { printf '[kueue] error: %s\n' "$*" >&2; exit 1; }

# find_go (and the other Go-module helpers)
# shellcheck source=hack/go-modules.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-modules.sh"

built() { [[ -x "$DIR/kueue" && -f "$DIR/webhook/manifests.yaml" && -f "$DIR/crds/kueue.x-k8s.io_workloads.yaml" ]]; }

cmd_build() {
  if built; then log "cached in $DIR"; return 0; fi
  local go jobs start src partial
  go="$(find_go)" || die "Go is needed to build Kueue (tried \$GO, PATH, /usr/local/go/bin/go)"
  jobs="${KUBEPS_KUEUE_BUILD_JOBS:-2}"
  mkdir -p "$DIR"
  # One build at a time per cache entry; a second caller waits and then finds the result.
  exec 8>"$DIR/.lock"
  flock 8
  if built; then log "cached in $DIR"; return 0; fi
  start=$SECONDS
  export GOFLAGS=-trimpath CGO_ENABLED=0 GOMAXPROCS="$jobs" GOTOOLCHAIN=local
  src="$("$go" mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  [[ -n "$src" && -d "$src" ]] || die "go mod download sigs.k8s.io/kueue@$KUEUE_VERSION gave no module directory"
  partial="$DIR/.partial"
  rm -rf "$partial"
  mkdir -p "$partial/crds" "$partial/webhook"
  log "building Kueue $KUEUE_VERSION with $("$go" version) (-p $jobs)"
  (cd "$src" && "$go" build -p "$jobs" -ldflags="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
    -o "$partial/kueue" ./cmd/kueue)
  cp "$src"/config/components/crd/bases/*.yaml "$partial/crds/"
  cp "$src/config/components/webhook/manifests.yaml" "$partial/webhook/manifests.yaml"
  chmod -R u+w "$partial"
  mv -f "$partial"/crds/* "$DIR/crds/" 2>/dev/null || { mkdir -p "$DIR/crds"; mv -f "$partial"/crds/* "$DIR/crds/"; }
  mkdir -p "$DIR/webhook"
  mv -f "$partial/webhook/manifests.yaml" "$DIR/webhook/manifests.yaml"
  mv -f "$partial/kueue" "$DIR/kueue"
  rm -rf "$partial"
  log "built in $((SECONDS - start)) s into $DIR"
}

case "${1:-}" in
  build) cmd_build ;;
  dir) echo "$DIR" ;;
  *) die "usage: $0 build|dir" ;;
esac
