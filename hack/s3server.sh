#!/usr/bin/env bash
# A real S3-compatible server for the object-storage tests of kubeps.runtime.data (tests/runtime/test_data_formats.py).
#
#   hack/s3server.sh build     compile versitygw (Versity's S3 gateway, Apache-2.0, serving a plain directory
#                              through its posix backend) from the Go module proxy into a cache outside the repo
#                              (instant when cached)
#   hack/s3server.sh bin       print the path of the binary (after build)
#
# The tests start it themselves, on 127.0.0.1 only, over a temporary directory, and stop it (a pytest fixture).
# Environment:
#   KUBEPS_S3_CACHE        binary cache root (default ${XDG_CACHE_HOME:-~/.cache}/kubeps/s3server)
#   GO                     go binary (default: go on PATH, else /usr/local/go/bin/go)
#   KUBEPS_S3_BUILD_JOBS   parallel go build jobs (default 2)
set -euo pipefail

VERSITYGW_VERSION="v1.8.0"
CACHE_ROOT="${KUBEPS_S3_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubeps/s3server}"
BIN="$CACHE_ROOT/versitygw-$VERSITYGW_VERSION"

log() { printf '[s3server] %s\n' "$*" >&2; }
die() { printf '[s3server] error: %s\n' "$*" >&2; exit 1; }

# find_go (and the other Go-module helpers)
# shellcheck source=hack/go-modules.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-modules.sh"

cmd_build() {
  if [[ -x "$BIN/versitygw" ]]; then log "cached in $BIN"; return 0; fi
  local go jobs start
  go="$(find_go)" || die "Go is needed to build versitygw (tried \$GO, PATH, /usr/local/go/bin/go)"
  jobs="${KUBEPS_S3_BUILD_JOBS:-2}"
  mkdir -p "$BIN"
  # One build at a time per cache entry; a second caller waits and then finds the binary.
  exec 8>"$BIN/.lock"
  flock 8
  if [[ -x "$BIN/versitygw" ]]; then log "cached in $BIN"; return 0; fi
  start=$SECONDS
  local partial="$BIN/.partial"
  mkdir -p "$partial"
  log "building versitygw $VERSITYGW_VERSION with $("$go" version) (-p $jobs)"
  (cd "$partial" && GOFLAGS=-trimpath CGO_ENABLED=0 GOMAXPROCS="$jobs" GOTOOLCHAIN=local GOBIN="$partial" \
    "$go" install -p "$jobs" -ldflags='-s -w' "github.com/versity/versitygw/cmd/versitygw@$VERSITYGW_VERSION")
  mv -f "$partial/versitygw" "$BIN/versitygw"
  rmdir "$partial" 2>/dev/null || true
  log "built in $((SECONDS - start)) s into $BIN"
}

case "${1:-}" in
  build) cmd_build ;;
  bin) echo "$BIN/versitygw" ;;
  *) die "usage: $0 build|bin" ;;
esac
