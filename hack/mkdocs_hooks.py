"""MkDocs hooks (``mkdocs.yml``: ``hooks``): the reference pages that are generated from the code at build time.

- ``reference/python-api.md``: one mkdocstrings entry for every public name of ``kubeps.runtime``
  (``kubeps.runtime._EXPORTS``, the lazy facade's table, which ``__all__`` is made from), grouped by the module
  that defines it, so a name added to the facade is documented without editing a page.
  The docstrings are written for Sphinx as much as for readers of the source: ``on_page_content`` drops the
  roles (``:class:``, ``:meth:`` ...) and the ``~`` of a shortened name in front of the code they mark.
- ``reference/cli.md``: the ``kubeps`` command's help, from its argparse parsers (``kubeps.runtime.cli``, and
  ``kubeps.operator.main`` for ``kubeps operator``).

And the source tree mkdocstrings reads: setuptools maps the source roots (``kubeps.runtime`` -> ``runtime/``,
``kubeps.operator`` -> ``operator/``) and the editable install finds them with an import hook griffe cannot
follow, so ``on_startup`` (before mkdocstrings reads its configuration) links them as ``build/docs-src/kubeps/{runtime,operator}`` (``kubeps/`` a namespace
package, as installed; hack/mypy.sh builds the same tree for mypy), the handler's ``paths`` in mkdocs.yml.

Nothing is written to ``docs/``: the pages exist only in the build (``mkdocs build --strict`` fails on an entry
mkdocstrings cannot render; tests/docs/test_site.py checks every name has one).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

import kubeps.runtime as kp
from kubeps.operator.main import build_parser as build_operator_parser
from kubeps.runtime.cli import build_parser

API_PAGE = "reference/python-api.md"
CLI_PAGE = "reference/cli.md"


def api_markdown() -> str:
    by_module: dict[str, list[str]] = {}
    for name, module in sorted(kp._EXPORTS.items()):
        by_module.setdefault(module, []).append(name)
    lines = [
        "# Python API: `kubeps.runtime`",
        "",
        "Every public name of `kubeps.runtime` (`import kubeps.runtime as kp`), generated from the docstrings.",
        "The names are imported lazily: `kp.Variable` loads `kubeps.runtime.variables.variable` on first use.",
        "Grouped by the module that defines each name; the modules may move, the `kp.` names stay.",
        "The submodules `kp.nn` (layers and losses), `kp.kernels` and `kp.summary` are listed under the modules that",
        "define them (`ops.nn`, `ops.kernels`, `observe.summary`).",
        "",
    ]
    for module in sorted(by_module):
        lines += [f"## `kubeps.runtime.{module}`", ""]
        for name in by_module[module]:
            lines += [f"::: kubeps.runtime.{module}.{name}", "    options:", "      heading_level: 3", ""]
    return "\n".join(lines)


#: the help's width, fixed so the page does not follow the terminal that builds it
HELP_COLUMNS = "100"


def _help(parser: argparse.ArgumentParser) -> str:
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS  # argparse's formatter reads it
    try:
        return parser.format_help().rstrip()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def cli_markdown() -> str:
    parser = build_parser()
    lines = [
        "# The `kubeps` command",
        "",
        "Generated from the command's own parser (`kubeps --help`, `kubeps COMMAND --help`).",
        "",
        "```text",
        _help(parser),
        "```",
        "",
    ]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        # `kubeps operator` hands its arguments to the operator's own parser: show that one
        shown = build_operator_parser() if name == "operator" else sub
        lines += [f"## `kubeps {name}`", "", "```text", _help(shown), "```", ""]
    return "\n".join(lines)


REPO = Path(__file__).resolve().parents[1]
SOURCE_TREE = REPO / "build" / "docs-src"


def on_startup(command: str, dirty: bool) -> None:  # noqa: ARG001  # mkdocs' hook signature
    (SOURCE_TREE / "kubeps").mkdir(parents=True, exist_ok=True)
    for root in ("runtime", "operator"):
        link = SOURCE_TREE / "kubeps" / root
        if not link.is_symlink():
            link.symlink_to(REPO / root, target_is_directory=True)


#: a Sphinx role left in front of the code it marks (``:class:`~x.Y``` renders as ``:class:<code>~x.Y</code>``)
SPHINX_ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|exc|obj|const):(<code>)~?")


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:  # noqa: ARG001  # mkdocs' signature
    return SPHINX_ROLE.sub(r"\1", html) if page.file.src_uri == API_PAGE else html


def on_files(files: Files, config: Any) -> Files:
    for uri, content in ((API_PAGE, api_markdown()), (CLI_PAGE, cli_markdown())):
        files.append(File.generated(config, uri, content=content))
    return files
