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
