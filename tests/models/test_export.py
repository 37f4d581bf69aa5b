"""``kubeps export``: the CTR examples trained under ``kubeps local`` (a few steps, tables sharded over 2 ps),
exported from their latest checkpoint, and the artifacts run where kubeps cannot be imported -- the ``.keras``
file with Keras, the ONNX model with onnxruntime -- on the held-out set: their predictions equal the example's own
evaluation of the same checkpoint within 1e-5."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
pytest.importorskip("jax")
pytest.importorskip("keras")
pytest.importorskip("jax2onnx")
pytest.importorskip("onnxruntime")

from kubeps.runtime.checkpoint import CheckpointNotFoundError, CheckpointReader, CheckpointMismatchError  # noqa: E402
from kubeps.runtime.errors import RuntimeConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KERAS_EXAMPLE = ROOT / "examples" / "keras" / "train.py"
JAX_EXAMPLE = ROOT / "examples" / "ctr" / "train_jax.py"
TOLERANCE = 1e-5

#: the model's flags, for training and for the export (the model must be built the same way)
MODEL_FLAGS = ["--eval-examples", "4000", "--train-examples", "20000"]  # a 65536 x 8 table: 2 shards

#: runs the exported artifacts where kubeps cannot be imported: a serving process with Keras and onnxruntime only
SERVE = textwrap.dedent("""
    import os, sys
    os.environ["KERAS_BACKEND"] = "jax"

    class NoKubeps:
        def find_spec(self, name, path=None, target=None):
            if name == "kubeps" or name.startswith("kubeps."):
                raise ImportError("kubeps is not installed in this serving process")

    sys.meta_path.insert(0, NoKubeps())
    try:
        import kubeps.runtime
    except ImportError:
        pass
    else:
        raise SystemExit("kubeps is importable")
    import numpy as np
    import onnxruntime

    out, inputs, kinds = sys.argv[1], np.load(sys.argv[2]), sys.argv[3:]
    ids, dense = inputs["ids"].astype(np.int32), inputs["dense"].astype(np.float32)
    results = {}
    if "keras" in kinds:
        import keras
        model = keras.saving.load_model(os.path.join(out, "model.keras"))
        results["keras"] = np.asarray(model.predict([ids, dense], batch_size=1024, verbose=0))
        results["keras_layers"] = np.array([type(layer).__name__ for layer in model.layers])
    session = onnxruntime.InferenceSession(os.path.join(out, "model.onnx"))
    results["onnx"] = session.run(None, {"ids": ids, "dense": dense})[0]
    np.savez(os.path.join(out, "served.npz"), **results)
""")


def load_example(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def kubeps(*args: str, timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "kubeps.runtime.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def serve(out: Path, ids: np.ndarray, dense: np.ndarray, *kinds: str) -> dict[str, np.ndarray]:
    np.savez(out / "held_out.npz", ids=ids, dense=dense)
    done = subprocess.run([sys.executable, "-c", SERVE, str(out), str(out / "held_out.npz"), *kinds],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(np.load(out / "served.npz"))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def train_and_export(tmp_path: Path, example: Path, builder: str, *train_flags: str) -> tuple[Path, str, str]:
    """The example trained under kubeps local with checkpoints, then ``kubeps export``: ``(out, latest, stdout)``;
    ``latest`` is the second checkpoint (numbered from 0), the one the export must have read."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "export"
    kubeps("local", "--ps", "2", "--workers", "2", str(example), "--", *MODEL_FLAGS, *train_flags,
           "--checkpoint-dir", str(ckpt), timeout=400)
    done = kubeps("export", str(ckpt), "--model", f"{example}:{builder}", "--output", str(out), "--", *MODEL_FLAGS,
                  timeout=400)
    latest = str(ckpt / "ckpt-1")
    assert f"exporting {latest}" in done.stdout, done.stdout
    return out, latest, done.stdout


def compare(name: str, example, labels: np.ndarray, p: np.ndarray, expected: np.ndarray, expected_logloss: float):
    diff = float(np.max(np.abs(p - expected)))
    logloss = example.ctr.log_loss(labels, p)
    print(f"EXPORT {name}: max |p - eval p| {diff:.2e}, log-loss {logloss:.6f} vs the example's "
          f"{expected_logloss:.6f} (diff {abs(logloss - expected_logloss):.1e})")
    assert diff <= TOLERANCE
    assert abs(logloss - expected_logloss) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_keras_example_exported_as_keras_and_onnx_predicts_as_its_own_evaluation(tmp_path):
    out, latest, _ = train_and_export(tmp_path, KERAS_EXAMPLE, "serving_model", "--epochs", "2",
                                      "--steps-per-epoch", "40", "--steps-per-execution", "20")

    # the example's own evaluation of that checkpoint: its model rebuilt, restore_weights, its Predictor
    example = load_example(KERAS_EXAMPLE, "kubeps_test_keras_example")
    from kubeps.runtime.models.keras_fit import restore_weights

    args = example.parse_args(MODEL_FLAGS)
    reader = CheckpointReader(latest)
    assert len(reader.manifest.variables["model/embedding/embeddings"].slices) == 2  # a table in two shards
    model = example.build_model(args)
    restore_weights(model, reader.values())
    values, dense, _, labels = example.ctr.held_out_set(args)
    ids = example.ctr.hash_ids(values, args.vocab_size)
    expected = example.Predictor(model).predict(ids, dense)
    expected_eval = example.ctr.evaluate(example.Predictor(model), args)

    served = serve(out, ids, dense, "keras")
    assert "KubepsEmbedding" not in set(served["keras_layers"]) and "Embedding" in set(served["keras_layers"])
    for kind in ("keras", "onnx"):
        compare(f"Keras model via {kind}", example, labels, sigmoid(served[kind][:, 0]), expected,
                expected_eval["logloss"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_jax_example_exported_as_onnx_predicts_as_its_own_evaluation(tmp_path):
    out, latest, stdout = train_and_export(tmp_path, JAX_EXAMPLE, "serving_function", "--steps", "80",
                                           "--steps-per-execution", "20", "--checkpoint-every", "40")
    assert "model.onnx" in stdout and not (out / "model.keras").exists()

    example = load_example(JAX_EXAMPLE, "kubeps_test_jax_example")
    import kubeps.runtime as kp

    args = example.ctr.parse_args(MODEL_FLAGS)
    model = example.build_model(args)  # outside a scope: local variables
    assert kp.latest_checkpoint(str(tmp_path / "ckpt")) == latest
    kp.Checkpoint(model=model).restore(latest)  # what the example's evaluator does
    values, dense, _, labels = example.ctr.held_out_set(args)
    ids = example.ctr.hash_ids(values, args.vocab_size)
    expected_eval = example.ctr.evaluate(model, args)
    expected = model.predict(ids, dense)

    compare("jax.numpy model via onnx", example, labels, serve(out, ids, dense)["onnx"].astype(np.float64),
            expected, expected_eval["logloss"])


# -- errors: the field, the value and what is allowed ------------------------------------------------------------
def test_export_errors_name_what_is_wrong(tmp_path):
    import keras

    import kubeps.runtime as kp
    from kubeps.runtime.models import export

    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint in this directory"):
        export.resolve_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointNotFoundError, match="no such directory"):
        export.resolve_checkpoint(str(tmp_path / "missing"))

    inputs = keras.Input((3,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(inputs))
    only_kernel = {"out/kernel": kp.Variable(np.ones((3, 1), np.float32), name="out/kernel")}
    kp.CheckpointManager(kp.Checkpoint(model=only_kernel), str(tmp_path / "a")).save()
    with pytest.raises(CheckpointMismatchError, match="'model/out/bias' is not in checkpoint"):
        export.keras_serving_model(model, str(tmp_path / "a"))

    more = {**only_kernel, "out/bias": kp.Variable(np.zeros(1, np.float32), name="out/bias"),
            "other/kernel": kp.Variable(np.zeros(2, np.float32), name="other/kernel")}
    kp.CheckpointManager(kp.Checkpoint(model=more), str(tmp_path / "b")).save()
    with pytest.raises(CheckpointMismatchError, match=r"holds \['model/other/kernel'\].*which model"):
        export.keras_serving_model(model, str(tmp_path / "b"))

    wide = {"out/kernel": kp.Variable(np.ones((4, 1), np.float32), name="out/kernel"),
            "out/bias": kp.Variable(np.zeros(1, np.float32), name="out/bias")}
    kp.CheckpointManager(kp.Checkpoint(model=wide), str(tmp_path / "c")).save()
    with pytest.raises(CheckpointMismatchError, match=r"'model/out/kernel'.*shape \[4, 1\].*shape \[3, 1\]"):
        export.keras_serving_model(model, str(tmp_path / "c"))

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    sub = Subclassed()
    sub(np.zeros((1, 3), np.float32))
    with pytest.raises(RuntimeConfigError, match="subclassed keras.Model.*allowed: a functional model"):
        export.keras_serving_model(sub, str(tmp_path / "a"))
    with pytest.raises(RuntimeConfigError, match="'path'.*ending in '.keras'"):
        export.export_keras(model, str(tmp_path / "a"), str(tmp_path / "model.h5"))
    with pytest.raises(RuntimeConfigError, match="inputs\\[0\\] dtype"):
        export.ServingFunction(lambda p, x: x, {"w": "w"}, [("x", (None, 3), "float64")])


def test_export_command_reports_a_missing_checkpoint_and_a_bad_model_flag(tmp_path):
    import kubeps.runtime as kp

    cli = [sys.executable, "-m", "kubeps.runtime.cli", "export"]
    (tmp_path / "ckpt-1").mkdir()  # an interrupted save (no manifest) is no checkpoint
    done = subprocess.run([*cli, str(tmp_path), "--model", f"{KERAS_EXAMPLE}:serving_model", "--output",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "no committed checkpoint in this directory" in done.stderr, done.stderr

    variables = {"w": kp.Variable(np.ones(2, np.float32), name="w")}
    kp.CheckpointManager(kp.Checkpoint(model=variables), str(tmp_path / "good")).save()
    for flag, message in (("train.py", "--model must be FILE.py:FUNCTION or MODULE:FUNCTION, got 'train.py'"),
                          (f"{KERAS_EXAMPLE}:nothing", "has no function 'nothing'"),
                          ("missing.py:build", "file not found: missing.py")):
        done = subprocess.run([*cli, str(tmp_path / "good"), "--model", flag, "--output", str(tmp_path / "out")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_export_imports_a_program_from_its_folder_and_refuses_one_that_runs_on_import(tmp_path, capsys):
    """``--model FILE.py:FN`` imports FILE as a module with its folder on sys.path (a helper module beside it
    imports), calls a builder that takes no arguments without any, and refuses a program that runs (exits) on
    import with the ``__main__`` guard named."""
    import argparse

    from kubeps.runtime import cli

    (tmp_path / "helpers.py").write_text("WIDTH = 3\n")
    (tmp_path / "guarded.py").write_text(textwrap.dedent("""
        import sys
        import helpers

        def build_model():
            return ("model", helpers.WIDTH)

        if __name__ == "__main__":
            sys.exit(3)
    """))
    (tmp_path / "unguarded.py").write_text("import sys\nsys.exit(3)\ndef build_model():\n    return 1\n")
    parser = argparse.ArgumentParser(prog="kubeps export")
    builder = cli._load_builder(f"{tmp_path / 'guarded.py'}:build_model", parser)
    assert cli._call_builder(builder, [], parser) == ("model", 3)
    with pytest.raises(SystemExit):
        cli._call_builder(builder, ["--vocab-size", "8"], parser)
    assert "takes no arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli._load_builder(f"{tmp_path / 'unguarded.py'}:build_model", parser)
    assert 'ran the program (it exited with status 3)' in capsys.readouterr().err


def test_export_command_names_the_dynamic_tables_it_skips(tmp_path):
    """A checkpoint with a dynamic embedding table beside the model's weights: the Keras export writes the model and
    says which table it skipped (a serving model holds fixed-shape weights)."""
    import kubeps.runtime as kp
    from kubeps.runtime.models import export

    table = kp.DynamicEmbedding("ids", dim=2)
    table.lookup(np.array([1, 2**40]))
    weights = {"out/kernel": kp.Variable(np.ones((3, 1), np.float32), name="out/kernel"),
               "out/bias": kp.Variable(np.zeros(1, np.float32), name="out/bias"), "ids": table}
    path = kp.CheckpointManager(kp.Checkpoint(model=weights), str(tmp_path / "ckpt")).save()
    builder = tmp_path / "build.py"
    builder.write_text(textwrap.dedent("""
        import keras

        def model(args):
            inputs = keras.Input((3,), name="x")
            return keras.Model(inputs, keras.layers.Dense(1, name="out")(inputs))
    """))
    done = subprocess.run([sys.executable, "-m", "kubeps.runtime.cli", "export", path, "--model",
                           f"{builder}:model", "--output", str(tmp_path / "out"), "--format", "keras"],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "KERAS_BACKEND": "jax"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipping dynamic embedding table(s) model/ids: a serving model holds fixed-shape weights" in done.stdout
    assert (tmp_path / "out" / "model.keras").exists()
    assert export.dynamic_tables(path) == ["model/ids"]  # a parameter naming it is refused: test_dynamic_checkpoint
