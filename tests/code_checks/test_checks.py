"""Checks on the code itself, so `make test` and CI fail when one breaks: ruff (pyflakes plus the rules the code's
``noqa`` comments cite, configured in pyproject.toml), the import contracts of ``.importlinter`` (the runtime's
layers, no import cycle, the operator importing only ``kubeps.runtime.cluster``; see docs/architecture.md), and
the ``>>>`` examples in docstrings, run as doctests."""

from __future__ import annotations

import doctest
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

def _module_name(root: str, path: Path) -> str:
    """``runtime/rpc/wire.py`` -> ``kubeps.runtime.rpc.wire``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(REPO / root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kubeps", root, *parts])


#: every module of both source roots, sub-packages included (``__main__`` modules run when imported: not these)
MODULES = sorted(
    _module_name(root, path)
    for root in ("runtime", "operator")
    for path in (REPO / root).rglob("*.py")
    if path.stem != "__main__"
)


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    executable = BIN / tool
    assert executable.exists(), f"{tool} is missing: install the test extra (pip install -e '.[operator,test]')"
    return subprocess.run([str(executable), *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_clean():
    proc = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_contracts_kept():
    proc = _run("lint-imports", "--no-cache")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of the {result.attempted} docstring examples of {name} failed"


def test_docstring_examples_are_found():
    """The examples above are really collected (partitioners.py documents its rules with them)."""
    module = importlib.import_module("kubeps.runtime.variables.partitioners")
    assert sum(len(t.examples) for t in doctest.DocTestFinder().find(module)) >= 7


def test_every_module_is_checked():
    """The doctest sweep walks sub-packages: a module in a folder of its own is not skipped."""
    on_disk = {p for root in ("runtime", "operator") for p in (REPO / root).rglob("*.py") if p.stem != "__main__"}
    assert len(MODULES) == len(on_disk)
    for name in ("kubeps.runtime.rpc.protocol", "kubeps.runtime.contract", "kubeps.runtime.server.methods",
                 "kubeps.runtime.coordinator"):
        assert name in MODULES
