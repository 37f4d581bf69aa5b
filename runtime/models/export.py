"""Export for serving: the latest checkpoint's weights put into artifacts a serving system loads without kubeps.

Two artifacts, for two kinds of model:

* **a Keras model** (functional or ``Sequential``, as trained by :func:`kubeps.runtime.models.keras_fit.fit`):
  :func:`keras_serving_model` clones it with every ``KubepsEmbedding`` replaced by a plain
  ``keras.layers.Embedding`` of the same name and size, and loads every weight from the checkpoint (the tables
  assembled from all their shards); :func:`export_keras` saves that model as a ``.keras`` file
  (``keras.saving.save_model``), which ``keras.saving.load_model`` loads with Keras alone;
* **an ONNX model** run by onnxruntime, for the same Keras model or for a model written with ``jax.numpy``
  (:class:`ServingFunction`: the forward pass ``fn(params, *inputs)`` and which checkpoint variable each parameter
  is): :func:`export_onnx`. Both are JAX functions with the trained weights as constants -- the Keras model
  through its own ``stateless_call`` -- converted by ``jax2onnx`` (the ``export`` extra). Keras's own
  ``model.export(format="onnx")`` goes through TensorFlow (``jax2tf`` and ``tf2onnx``) under the JAX backend.

The checkpoint is read with :class:`~kubeps.runtime.checkpoint.CheckpointReader`, straight from its files: no
parameter server runs. ``checkpoint`` is a checkpoint directory (``ckpt-N``) or a directory of them, whose latest
committed checkpoint is used (:func:`resolve_checkpoint`).

Rule: keras, jax and jax2onnx are imported inside the functions that use them (``import kubeps.runtime`` and the
``kubeps`` command never load them); nothing of the runtime imports this module but the CLI.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from kubeps.runtime.checkpoint.format import (
    MANIFEST_NAME, CheckpointMismatchError, CheckpointNotFoundError, latest_checkpoint, list_checkpoints,
)
from kubeps.runtime.checkpoint.reader import CheckpointReader
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.util.storage import normalize_path, storage_for

__all__ = ["ServingFunction", "dynamic_tables", "export_keras", "export_onnx", "keras_serving_model", "load_params",
           "resolve_checkpoint"]

#: the size from which an ONNX model keeps its weights in a ``.data`` file beside it (protobuf's 2 GiB limit)
_ONNX_ONE_FILE_LIMIT = (2 << 30) - (64 << 20)
#: what ``ServingFunction`` inputs may be (the dtypes ONNX serving takes without 64-bit JAX)
_INPUT_DTYPES = ("float32", "int32", "bool")


# -- the checkpoint -------------------------------------------------------------------------------------------------
def resolve_checkpoint(path: str) -> str:
    """``path`` itself when it is a committed checkpoint (it holds ``manifest.json``), else the latest committed
    checkpoint in the directory ``path``; :class:`CheckpointNotFoundError` when there is none."""
    if not isinstance(path, str) or not path:
        raise RuntimeConfigError("checkpoint", path, "must be a checkpoint directory (ckpt-N) or a directory of them")
    path = normalize_path(path)
    storage = storage_for(path)
    if storage.exists(storage.join(path, MANIFEST_NAME)):
        return path
    if not storage.exists(path):
        raise CheckpointNotFoundError(f"checkpoint {path!r}: no such directory")
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointNotFoundError(
            f"checkpoint {path!r}: no committed checkpoint in this directory (allowed: a ckpt-N directory holding "
            f"{MANIFEST_NAME}, or a directory of them; found {len(list_checkpoints(path))} committed)")
    return latest


def _reader(checkpoint: str | CheckpointReader) -> CheckpointReader:
    return checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(resolve_checkpoint(checkpoint))


def dynamic_tables(checkpoint: str | CheckpointReader) -> list[str]:
    """The dynamic embedding tables of a checkpoint: an export skips them (a serving model's weights have fixed
    shapes; a table's rows are keyed by id), and a parameter naming one is refused naming it."""
    return _reader(checkpoint).tables()


def _checked_value(reader: CheckpointReader, name: str, shape: Sequence[int], what: str) -> np.ndarray:
    value = reader.get(name)  # CheckpointMismatchError naming the variable and what the checkpoint holds
    if tuple(value.shape) != tuple(shape):
        raise CheckpointMismatchError(
            f"{what}: checkpoint variable {name!r} in {reader.path} has shape {list(value.shape)}; the model's "
            f"weight has shape {list(shape)} (build the model with the flags it was trained with)")
    return value


# -- Keras ----------------------------------------------------------------------------------------------------------
def _keras() -> Any:
    from kubeps.runtime.models.keras_layers import import_keras  # noqa: PLC0415 - keras loads for a Keras export only

    return import_keras()


def keras_serving_model(model: Any, checkpoint: str | CheckpointReader, prefix: str = "model/") -> Any:
    """A copy of the built Keras ``model`` (functional or ``Sequential``) made of Keras layers only -- every
    ``KubepsEmbedding`` becomes a ``keras.layers.Embedding`` of the same name and size -- with every weight read
    from the checkpoint (``prefix`` + the weight's Keras path, as :class:`ModelCheckpoint` and
    :class:`BackupAndRestore` name them). Every trainable weight must be in the checkpoint, and every checkpoint
    variable under ``prefix`` must be a weight of the model."""
    keras = _keras()
    from kubeps.runtime.models.keras_layers import KubepsEmbedding  # noqa: PLC0415 - imports keras
    from keras.src.models.functional import Functional  # noqa: PLC0415 - no public name for "built from a graph"

    if not isinstance(model, keras.Model):
        raise RuntimeConfigError("model", type(model).__name__, "must be a keras.Model (functional or Sequential)")
    if not model.built:
        raise RuntimeConfigError("model", model.name, "must be built (a functional model, or call it on a batch)")
    if not isinstance(model, (keras.Sequential, Functional)):
        raise RuntimeConfigError(
            "model", f"{type(model).__name__} (a subclassed keras.Model)",
            "allowed: a functional model (keras.Model(inputs, outputs)) or keras.Sequential: a subclassed model is "
            "its Python class, which a .keras file cannot carry and export cannot rewrite without kubeps")
    reader = _reader(checkpoint)

    def plain(layer: Any) -> Any:
        if isinstance(layer, KubepsEmbedding):
            return keras.layers.Embedding(layer.input_dim, layer.output_dim, name=layer.name, dtype=layer.dtype_policy)
        return layer.__class__.from_config(layer.get_config())

    serving = keras.models.clone_model(model, clone_function=plain)
    wanted = {prefix + v.path: v for v in serving.trainable_variables}
    have = {name for name in reader.names() if name.startswith(prefix)}
    extra = sorted(have - set(wanted))
    if extra:
        raise CheckpointMismatchError(
            f"checkpoint {reader.path} holds {extra[:5]} under {prefix!r}, which model {model.name!r} lacks (its "
            f"weights: {sorted(wanted)[:8]}): build the model the way the chief built it")
    for name, variable in wanted.items():
        variable.assign(_checked_value(reader, name, variable.shape, f"model {model.name!r}"))
    return serving


def export_keras(model: Any, checkpoint: str | CheckpointReader, path: str, prefix: str = "model/") -> str:
    """Save :func:`keras_serving_model` as a ``.keras`` file at ``path``; returns ``path``."""
    if not isinstance(path, str) or not path.endswith(".keras"):
        raise RuntimeConfigError("path", path, "must be a file name ending in '.keras' (Keras's saving format)")
    keras = _keras()
    serving = keras_serving_model(model, checkpoint, prefix)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keras.saving.save_model(serving, path)
    return path


# -- models written with jax.numpy ----------------------------------------------------------------------------------
class ServingFunction:
    """A model written with ``jax.numpy``, as served: ``fn(params, *inputs)`` returns the predictions;
    ``params`` maps each parameter name of ``fn`` to the checkpoint variable that holds it (a table is passed
    whole: gather its rows with ``params[name][ids]``); ``inputs`` is ``[(name, shape, dtype), ...]`` with
    ``None`` for the batch (and any other free) dimension; dtypes: float32, int32, bool."""

    def __init__(self, fn: Callable[..., Any], params: Mapping[str, str],
                 inputs: Sequence[tuple[str, Sequence[int | None], str]]):
        if not callable(fn):
            raise RuntimeConfigError("fn", type(fn).__name__, "must be a function fn(params, *inputs)")
        if not isinstance(params, Mapping) or not params or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
            raise RuntimeConfigError("params", params, "must map parameter names to checkpoint variable names "
                                     "(strings), at least one")
        checked = []
        for i, item in enumerate(inputs):
            if not (isinstance(item, (tuple, list)) and len(item) == 3 and isinstance(item[0], str)):
                raise RuntimeConfigError(f"inputs[{i}]", item, "must be (name, shape, dtype)")
            name, shape, dtype = item
            if np.dtype(dtype).name not in _INPUT_DTYPES:
                raise RuntimeConfigError(f"inputs[{i}] dtype", dtype, f"allowed: {', '.join(_INPUT_DTYPES)}")
            if not all(d is None or (isinstance(d, int) and d >= 0) for d in shape):
                raise RuntimeConfigError(f"inputs[{i}] shape", shape, "dimensions are integers >= 0 or None")
            checked.append((name, tuple(shape), np.dtype(dtype).name))
        if not checked:
            raise RuntimeConfigError("inputs", inputs, "must name at least one input")
        self.fn, self.params, self.inputs = fn, dict(params), checked


def load_params(function: ServingFunction, checkpoint: str | CheckpointReader) -> dict[str, np.ndarray]:
    """The values of ``function``'s parameters, read from the checkpoint (tables assembled from every shard)."""
    reader = _reader(checkpoint)
    return {name: reader.get(variable) for name, variable in function.params.items()}


# -- ONNX -----------------------------------------------------------------------------------------------------------
def _symbolic(shape: Sequence[int | None]) -> tuple[int | str, ...]:
    return tuple(("batch" if i == 0 else f"dim{i}") if d is None else int(d) for i, d in enumerate(shape))


def _keras_forward(model: Any, checkpoint: str | CheckpointReader, prefix: str) -> tuple[Callable[..., Any], list]:
    serving = keras_serving_model(model, checkpoint, prefix)
    trainable = [np.asarray(v.value) for v in serving.trainable_variables]
    non_trainable = [np.asarray(v.value) for v in serving.non_trainable_variables]
    single = len(serving.inputs) == 1

    def forward(*inputs: Any) -> Any:
        x = inputs[0] if single else list(inputs)
        return serving.stateless_call(trainable, non_trainable, x, training=False)[0]

    spec = [(t.name, tuple(t.shape), np.dtype(t.dtype).name) for t in serving.inputs]
    return forward, spec


def export_onnx(model: Any, checkpoint: str | CheckpointReader, path: str, prefix: str = "model/",
                opset: int = 17) -> str:
    """Convert ``model`` -- a Keras model (as :func:`keras_serving_model` takes) or a :class:`ServingFunction` --
    with the checkpoint's weights as constants into an ONNX model at ``path`` (jax2onnx); returns ``path``. The
    inputs keep their names (a Keras model's ``Input`` names), their batch dimension is free. The model is one
    file, its weights inside, up to protobuf's 2 GiB; a bigger one keeps them in ``<path>.data`` beside it."""
    if not isinstance(path, str) or not path.endswith(".onnx"):
        raise RuntimeConfigError("path", path, "must be a file name ending in '.onnx'")
    if isinstance(model, ServingFunction):
        import jax.numpy as jnp  # noqa: PLC0415 - jax loads for an export only

        params = {name: jnp.asarray(value) for name, value in load_params(model, checkpoint).items()}
        fn = model.fn

        def forward(*inputs: Any) -> Any:
            return fn(params, *inputs)

        spec = model.inputs
    else:
        forward, spec = _keras_forward(model, checkpoint, prefix)
    try:
        import jax  # noqa: PLC0415 - jax loads for an export only
        from jax2onnx import to_onnx  # noqa: PLC0415 - the `export` extra, loaded for an ONNX export only
    except ImportError as err:
        raise RuntimeConfigError("format", "onnx", f"needs the export extra: pip install 'kubeps[export]' ({err})") \
            from None
    for name, _, dtype in spec:
        if dtype not in _INPUT_DTYPES:
            raise RuntimeConfigError(f"input {name!r} dtype", dtype, f"allowed for ONNX: {', '.join(_INPUT_DTYPES)}")
    shapes = [jax.ShapeDtypeStruct(_symbolic(shape), dtype) for _, shape, dtype in spec]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    proto = to_onnx(forward, shapes, model_name="kubeps_export", opset=opset,
                    input_names=[name for name, _, _ in spec], output_names=["predictions"], return_mode="proto")
    import onnx  # noqa: PLC0415 - the `export` extra (jax2onnx needs it)

    data = path + ".data"
    if os.path.exists(data):
        os.remove(data)  # a sidecar an earlier export left: the model written now does not name it
    # one self-contained file, as a serving system expects; protobuf caps a file at 2 GiB, so a bigger model keeps
    # its weights in `<path>.data` beside it (both files are then shipped together)
    big = proto.ByteSize() >= _ONNX_ONE_FILE_LIMIT
    onnx.save_model(proto, path, save_as_external_data=big, all_tensors_to_one_file=True,
                    location=os.path.basename(data))
    return path
