"""``kubeps.runtime`` exports TensorFlow's names, lazily."""

import subprocess
import sys

import kubeps.runtime as runtime


def test_every_public_name_resolves():
    for name in runtime.__all__:
        assert getattr(runtime, name) is not None, name


def test_unknown_name_is_an_attribute_error():
    try:
        runtime.NoSuchThing  # noqa: B018
    except AttributeError as err:
        assert "NoSuchThing" in str(err)
    else:
        raise AssertionError("expected AttributeError")


def test_cluster_model_does_not_pull_in_the_transport():
    code = "import sys, kubeps.runtime.cluster; print('grpc' in sys.modules, 'cloudpickle' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_type_checkers_see_the_same_names():
    """The ``TYPE_CHECKING`` block of the facade (what IDEs and mypy read) imports exactly ``_EXPORTS``, each from
    the module the lazy lookup uses."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(runtime.__file__).read_text())
    seen: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module, ast.dump(stmt)
                for alias in stmt.names:
                    assert alias.asname == alias.name, f"{alias.name} must be re-exported as itself"
                    seen[alias.name] = stmt.module.removeprefix("kubeps.runtime.")
    expected = dict(runtime._EXPORTS) | runtime._SUBMODULES
    expected = {name: (mod.rpartition(".")[0] if name in runtime._SUBMODULES else mod) for name, mod in expected.items()}
    assert seen == expected


def test_short_submodule_names_still_import():
    """``from kubeps.runtime import nn, kernels`` (used before the regroup) still gives the modules."""
    from kubeps.runtime import kernels, nn

    assert nn.__name__ == "kubeps.runtime.ops.nn" and kernels.__name__ == "kubeps.runtime.ops.kernels"
