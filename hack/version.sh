#!/usr/bin/env bash
# Print the version of kubeps (kubeps.runtime.contract.VERSION, its one source) or, with --revision, the git commit
# of the tree (with "-dirty" when it has uncommitted changes; "unknown" outside git). hack/release.sh and
# hack/kind.sh label the images with both (Dockerfile: KUBEPS_VERSION, KUBEPS_REVISION).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in
  "")
    version="$(sed -n 's/^VERSION = "\([^"]*\)"$/\1/p' "$root/runtime/contract.py")"
    [[ -n "$version" ]] || { echo "no VERSION = \"...\" line in runtime/contract.py" >&2; exit 1; }
    echo "$version" ;;
  --revision)
    if revision="$(git -C "$root" rev-parse HEAD 2>/dev/null)"; then
      git -C "$root" diff --quiet HEAD -- 2>/dev/null || revision="$revision-dirty"
      echo "$revision"
    else
      echo unknown
    fi ;;
  *) echo "usage: hack/version.sh [--revision]" >&2; exit 2 ;;
esac
