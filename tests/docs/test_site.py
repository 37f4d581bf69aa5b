"""The documentation site (mkdocs.yml) builds with warnings as errors, documents every public name of
``kubeps.runtime`` and reaches every page from its navigation.

``mkdocs build --strict`` fails on a broken link or anchor, a page left out of the navigation, a nav entry naming no
page, and an API entry mkdocstrings cannot collect (mkdocs.yml's ``validation``); the tests below check what a
successful build could still miss: a public name without a rendered entry, a page on disk outside the navigation.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 180

pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') builds the site")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # Material's end-of-life banner
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return out


def _nav_pages(nav: Any) -> list[str]:
    """Every page file named in a (nested) mkdocs nav."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    return []


def test_every_public_runtime_name_has_a_rendered_entry(site: Path) -> None:
    import kubeps.runtime as kp

    page = (site / "reference" / "python-api" / "index.html").read_text()
    ids = set(re.findall(r'<h3 id="(kubeps\.runtime\.[\w.]+)"', page))
    missing = [name for name in kp.__all__ if f"kubeps.runtime.{kp._EXPORTS[name]}.{name}" not in ids]
    assert not missing, f"public names of kubeps.runtime without an entry in the Python API page: {missing}"
    # rendered, not left as the `:::` directive or an empty heading: each entry carries its docstring's text
    assert ":::" not in page
    assert not re.search(r":(?:class|meth|func|mod|data|attr|exc):<code>", page), "a Sphinx role left in the text"
    for name in ("ParameterServerStrategy", "ClusterCoordinator", "Variable"):
        entry = page.split(f'id="kubeps.runtime.{kp._EXPORTS[name]}.{name}"', 1)[1][:20000]
        assert 'class="doc doc-contents' in entry, f"{name}: heading without contents"


def test_every_page_is_in_the_navigation(site: Path) -> None:
    from mkdocs.config import load_config

    config = load_config(str(REPO / "mkdocs.yml"))
    in_nav = set(_nav_pages(config["nav"]))
    on_disk = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    generated = {"reference/python-api.md", "reference/cli.md"}
    assert on_disk - in_nav == set(), f"pages not in mkdocs.yml's nav: {sorted(on_disk - in_nav)}"
    assert in_nav - on_disk - generated == set(), f"nav entries without a page: {sorted(in_nav - on_disk - generated)}"
    for page in in_nav:
        built = site / (page.removesuffix(".md").removesuffix("index") + "/index.html").lstrip("/")
        assert built.is_file(), f"{page} was not built ({built})"


def test_the_cli_reference_lists_every_command(site: Path) -> None:
    from kubeps.runtime.cli import build_parser

    page = (site / "reference" / "cli" / "index.html").read_text()
    commands = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for command in commands:
        assert f'id="kubeps-{command}"' in page, f"kubeps {command} has no section in the CLI reference"
    assert "--node-lost-after" in page  # kubeps operator's own options, from the operator's parser
