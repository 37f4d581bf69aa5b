"""What the chief sends its workers: functions and their arguments pickled with cloudpickle (the user's own modules
by value, so workers need not import them), and the dataset functions a worker calls with its
:class:`~kubeps.runtime.data.options.InputContext`.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Callable

import cloudpickle
import numpy as np

from kubeps.runtime.data.dataset import Dataset
from kubeps.runtime.data.leases import ShardFeed, leased
from kubeps.runtime.data.options import InputContext
from kubeps.runtime.variables.context import current_input_context

__all__ = ["build_dataset", "build_leased", "call_dataset_fn", "dumps", "ship_by_value"]

#: modules :func:`ship_by_value` has decided on, by name, with the module object it saw: the decision resolves paths
#: (a few hundred microseconds), and ``schedule`` asks it for every function
_shipping_decided: dict[str, Any] = {}


def ship_by_value(fn: Any) -> None:
    """Pickle the user's own modules by value, so workers need not import them (``__main__`` always is)."""
    module_name = getattr(fn, "__module__", None)
    if not module_name or module_name == "__main__" or module_name.startswith(("kubeps.", "cloudpickle")):
        return
    module = sys.modules.get(module_name)
    if module is None or _shipping_decided.get(module_name) is module:
        return
    _shipping_decided[module_name] = module
    path = getattr(module, "__file__", None)
    if path is None:
        return
    path = os.path.realpath(path)
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    if any(path.startswith(p + os.sep) for p in prefixes) or "site-packages" in path:
        return  # installed: the worker image has it
    try:
        cloudpickle.register_pickle_by_value(module)
    except ValueError:
        pass


def dumps(obj: Any, what: str) -> np.ndarray:
    """``obj`` pickled, as the uint8 tensor a call carries; a ``TypeError`` naming ``what`` if it cannot be."""
    try:
        blob = cloudpickle.dumps(obj)
    except Exception as err:  # noqa: BLE001 - tell the user what could not be shipped
        raise TypeError(f"cannot send {what} to the workers: pickling failed with {type(err).__name__}: {err}") from err
    return np.frombuffer(blob, dtype=np.uint8)


def build_dataset(dataset_fn: Callable[..., Any], num_workers: int) -> Any:
    """Runs on a worker: call ``dataset_fn()`` or ``dataset_fn(input_context)``."""
    return call_dataset_fn(dataset_fn, lambda: current_input_context(num_workers))


def build_leased(dataset_fn: Callable[..., Any]) -> Dataset:
    """Runs on a worker: the exactly-once dataset, ``dataset_fn`` built whole (one input pipeline: the chief's
    leases split it) with its source reading the shards leased to this worker (:mod:`kubeps.runtime.data.leases`)."""
    dataset = call_dataset_fn(dataset_fn, lambda: InputContext(num_input_pipelines=1, input_pipeline_id=0))
    return Dataset(leased(dataset._node, ShardFeed()), dataset.options)


def call_dataset_fn(dataset_fn: Callable[..., Any], context: Callable[[], InputContext]) -> Any:
    """``dataset_fn()``, or ``dataset_fn(context())`` when it takes an argument."""
    try:
        params = [p for p in inspect.signature(dataset_fn).parameters.values()
                  if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    if params:
        return dataset_fn(context())
    return dataset_fn()
