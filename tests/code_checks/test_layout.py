"""The source roots operator/ and runtime/ must never shadow a top-level module when Python runs from the
repository root (``python -m pip``, ``python -m pytest`` in a fresh venv put the working directory first on
sys.path). operator/ is therefore a namespace portion without ``__init__.py``: a regular module later on
sys.path (the standard library's ``operator``) always wins over it, while ``kubeps.operator`` still maps to it."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_stdlib_operator_wins_from_the_repository_root():
    # -S: no site, so nothing has imported ``operator`` yet, as in a bare venv running ``python -m pip``
    code = "import collections, operator; print(operator.__file__)"
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not result.stdout.strip().startswith(str(REPO)), result.stdout


def test_no_init_in_the_operator_source_root():
    assert not (REPO / "operator" / "__init__.py").exists()


def test_kubeps_operator_still_imports():
    import kubeps.operator.main  # noqa: F401
    import kubeps.operator.core.planner as planner

    assert Path(planner.__file__).parent == REPO / "operator" / "core"


def test_every_runtime_package_is_in_the_distribution():
    """A sub-package (a folder with ``__init__.py``) missing from pyproject's explicit ``packages`` works in the
    editable install the tests use, and is missing from every wheel and image (the kind e2e caught
    ``kubeps.runtime.checkpoint``)."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    for name, root in config["package-dir"].items():
        for init in (REPO / root).rglob("__init__.py"):
            package = ".".join([name, *init.parent.relative_to(REPO / root).parts])
            assert package in listed, f"{package} ({init.parent}) is not in pyproject's [tool.setuptools] packages"


#: The longest class the operator's functional core may hold: past it, a class has taken in a second concern
#: (the planner was split by concern at ~760 lines: restarts, timeline, security, scale).
CORE_CLASS_LIMIT = 300


def _classes_over(source: str, limit: int) -> list[tuple[str, int]]:
    """The classes of ``source`` (nested ones too) longer than ``limit`` lines, with their lengths."""
    import ast

    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > limit]


def test_the_class_length_check_finds_a_long_class():
    body = "\n".join(f"    x{i} = {i}" for i in range(CORE_CLASS_LIMIT))
    assert _classes_over(f"class Long:\n{body}\n\nclass Short:\n    pass\n", CORE_CLASS_LIMIT) == [
        ("Long", CORE_CLASS_LIMIT + 1)]


def test_no_class_of_the_operator_core_is_longer_than_the_limit():
    core = REPO / "operator" / "core"
    too_long = {f"{path.name}:{name}": length for path in sorted(core.glob("*.py"))
                for name, length in _classes_over(path.read_text(), CORE_CLASS_LIMIT)}
    assert not too_long, (f"classes of operator/core longer than {CORE_CLASS_LIMIT} lines: {too_long}; split them "
                          f"by concern (see operator/core/planner.py's docstring)")


#: Rooms stay small everywhere (docs/architecture.md, "Rooms"): a class past this many lines has taken in a second
#: concept, a constructor past INIT_LIMIT lines does work that belongs to its collaborators.
CLASS_LIMIT = 350
INIT_LIMIT = 60


def _inits_over(source: str, limit: int) -> list[tuple[str, int]]:
    """``Class.__init__`` of ``source`` longer than ``limit`` lines, with their lengths."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "__init__"
                        and item.end_lineno is not None and item.end_lineno - item.lineno + 1 > limit):
                    found.append((node.name, item.end_lineno - item.lineno + 1))
    return found


def test_the_init_length_check_finds_a_long_constructor():
    body = "\n".join(f"        self.x{i} = {i}" for i in range(INIT_LIMIT))
    source = f"class Big:\n    def __init__(self):\n{body}\n\nclass Small:\n    def __init__(self):\n        pass\n"
    assert _inits_over(source, INIT_LIMIT) == [("Big", INIT_LIMIT + 1)]


@pytest.mark.parametrize("root", ["runtime", "operator"])
def test_no_class_or_constructor_is_a_room_for_two(root):
    too_long: dict[str, int] = {}
    for path in sorted((REPO / root).rglob("*.py")):
        source = path.read_text()
        where = path.relative_to(REPO)
        too_long.update({f"{where}:{name}": n for name, n in _classes_over(source, CLASS_LIMIT)})
        too_long.update({f"{where}:{name}.__init__": n for name, n in _inits_over(source, INIT_LIMIT)})
    assert not too_long, (f"classes over {CLASS_LIMIT} lines or constructors over {INIT_LIMIT} lines in {root}/: "
                          f"{too_long}; split them by concept (the coordinator's worker set, membership and metrics "
                          f"are the model: docs/architecture.md)")
