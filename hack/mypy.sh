#!/usr/bin/env bash
# mypy on kubeps.runtime and kubeps.operator, with the configuration of pyproject.toml ([tool.mypy]); `make lint` and
# tests/code_checks/test_mypy.py run this. Extra arguments go to mypy.
#
# setuptools maps the source roots (`package-dir`: kubeps.runtime -> runtime/, kubeps.operator -> operator/) and the
# editable install finds them with an import hook mypy cannot follow, so this builds the tree mypy needs: a directory
# holding kubeps/runtime and kubeps/operator as symlinks to the source roots, kubeps/ without an __init__.py (a
# namespace package, as installed). mypy reports paths as kubeps/runtime/...: that is runtime/... in the repository.
#
# KUBEPS_MYPY_ROOT: where to build that tree (default: a temporary directory, removed afterwards)
# KUBEPS_MYPY_CACHE: mypy's cache (default ~/.cache/kubeps/mypy; a rerun then takes a few seconds)
# MYPY: the mypy to run (default: the venv's, .venv/bin/mypy)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mypy="${MYPY:-$repo/.venv/bin/mypy}"
case "$mypy" in */*) mypy="$(cd "$(dirname "$mypy")" && pwd)/$(basename "$mypy")" ;; esac  # the cd below
cache="${KUBEPS_MYPY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubeps/mypy}"
root="${KUBEPS_MYPY_ROOT:-}"
if [ -z "$root" ]; then
    root="$(mktemp -d)"
    trap 'rm -rf "$root"' EXIT
fi

mkdir -p "$root/kubeps" "$cache"
ln -sfn "$repo/runtime" "$root/kubeps/runtime"
ln -sfn "$repo/operator" "$root/kubeps/operator"
cd "$root"
"$mypy" --config-file "$repo/pyproject.toml" --cache-dir "$cache" -p kubeps.runtime -p kubeps.operator "$@"
