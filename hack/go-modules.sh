# shellcheck shell=bash
# Sourced by the hack scripts that take test infrastructure from the Go module proxy (hack/controlplane.sh,
# hack/kind.sh, hack/kueue.sh, hack/s3server.sh, hack/gang-crds.sh, hack/monitoring-crds.sh): find Go, find a
# module version's directory, generate CRDs with controller-gen.
# The caller defines log and die.

find_go() {
  if [[ -n "${GO:-}" ]]; then echo "$GO"; return; fi
  if command -v go >/dev/null 2>&1; then command -v go; return; fi
  if [[ -x /usr/local/go/bin/go ]]; then echo /usr/local/go/bin/go; return; fi
  return 1
}

# module_dir GO MODULE@VERSION: the directory of a module version in the module cache (downloaded if needed).
module_dir() {
  "$1" mod download -json "$2" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p'
}

# controller_gen_crds GO SRC CONTROLLER_TOOLS_VERSION PATHS OUT: the CRDs controller-gen generates from the
# kubebuilder markers of the API types under SRC (a module directory, copied: the module cache is read-only), the
# way the projects' own `make manifests` does, into OUT.
controller_gen_crds() {
  local go=$1 src=$2 version=$3 paths=$4 out=$5 work
  work="$(mktemp -d)"
  cp -r "$src/." "$work/apis"
  chmod -R u+w "$work/apis"
  (cd "$work/apis" && GOBIN="$work/bin" "$go" install "sigs.k8s.io/controller-tools/cmd/controller-gen@$version" &&
    "$go" mod download && "$work/bin/controller-gen" crd:crdVersions=v1,allowDangerousTypes=true \
      paths="$paths" output:crd:dir="$out") || { chmod -R u+w "$work"; rm -rf "$work"; return 1; }
  chmod -R u+w "$work"
  rm -rf "$work"
}

# cache_main ARGS...: the command line of a script that fills the cache directory $DIR from the Go module proxy:
# `build` runs the script's `fill GO` once per cache entry (under a lock; skipped while its `have_all` holds),
# `dir` prints $DIR.
cache_main() {
  case "${1:-}" in
    build)
      if have_all; then log "cached in $DIR"; return 0; fi
      local go
      go="$(find_go)" || die "Go is needed (tried \$GO, PATH, /usr/local/go/bin/go)"
      mkdir -p "$DIR"
      exec 8>"$DIR/.lock"
      flock 8
      if have_all; then log "cached in $DIR"; return 0; fi
      export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0
      fill "$go"
      log "cached in $DIR" ;;
    dir) echo "$DIR" ;;
    *) die "usage: $0 build|dir" ;;
  esac
}
