"""Every package says what it holds: its ``__init__`` docstring names each of its modules and sub-packages, and so
does docs/architecture.md. A module added, renamed or removed without its package's docstring and the architecture
page following fails here, so the map a newcomer reads cannot drift from the tree again."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"


def _packages() -> list[Path]:
    return sorted(init.parent for root in ("runtime", "operator") for init in (REPO / root).rglob("__init__.py"))


def _members(package: Path) -> list[str]:
    """The package's modules and sub-packages, by name (``__main__`` counts: it is what ``python -m`` runs)."""
    modules = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
    packages = [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    return sorted(modules + packages)


def _named_in_rst(name: str, text: str) -> bool:
    """``name`` or :mod:`.name` / :mod:`kubeps.x.name` / :mod:`~kubeps.x.name` in a docstring."""
    literal = re.search(rf"``{re.escape(name)}``", text)
    role = re.search(rf":mod:`~?(?:[\w.]*\.)?{re.escape(name)}`", text)
    return bool(literal or role)


def _named_in_markdown(name: str, text: str) -> bool:
    """`name`, or `name/` for a package, in a Markdown page."""
    return bool(re.search(rf"`{re.escape(name)}/?`", text))


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(REPO)))
def test_the_package_docstring_names_each_of_its_modules(package: Path) -> None:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    missing = [m for m in _members(package) if not _named_in_rst(m, doc)]
    assert not missing, (f"{package.relative_to(REPO)}/__init__.py's docstring does not name {missing} "
                         "(as ``name`` or :mod:`.name`): say what each module holds")


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(REPO)))
def test_the_architecture_page_names_each_module(package: Path) -> None:
    text = ARCHITECTURE.read_text()
    missing = [m for m in _members(package) if not _named_in_markdown(m, text)]
    assert not missing, f"docs/architecture.md does not name {missing} of {package.relative_to(REPO)}/ (as `name`)"


def test_a_missing_module_is_caught() -> None:
    """The checks themselves: a name absent from a text is reported, a name present as a literal or a role is not."""
    assert not _named_in_rst("tls", "``security`` (the token)")
    assert _named_in_rst("tls", "``security`` and ``tls``")
    assert _named_in_rst("tls", "see :mod:`.tls`")
    assert _named_in_rst("tls", "see :mod:`~kubeps.runtime.rpc.tls`")
    assert not _named_in_rst("tls", "see :mod:`.mtls`")
    assert _named_in_markdown("util", "| 3 | `util/` | helpers |")
    assert not _named_in_markdown("util", "utilities")
