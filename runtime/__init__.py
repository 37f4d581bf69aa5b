"""kubeps runtime: TensorFlow-style parameter-server training without TensorFlow.

The public names below mirror ``tf.distribute.experimental.ParameterServerStrategy`` and
``tf.distribute.experimental.coordinator.ClusterCoordinator`` and their friends. They are imported lazily, on
first use, so that a light user of one module (the operator imports only ``kubeps.runtime.cluster``) does not
pay for grpc, cloudpickle and numpy at import time.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module (relative to this package) that defines it
_EXPORTS: dict[str, str] = {}
for _module, _names in {
    "cluster": "ClusterSpec TFConfig TFConfigClusterResolver TFConfigError",
    "strategy": "ParameterServerStrategy",
    "coordinator": "ClusterCoordinator",
    "values": "PerWorkerValues",
    "closure_queue": "RemoteValue",
    "variables": "Variable ShardedVariable embedding_lookup",
    "indexed_slices": "IndexedSlices",
    "server": "Server register_ps_method register_worker_method",
    "context": "get_current_worker_index",
    "errors": (
        "CancelledError ClosureError InsecureServerError PSUnavailableError RemoteError RuntimeConfigError "
        "UnauthenticatedError WorkerUnavailableError"
    ),
    "partitioners": "Partitioner FixedShardsPartitioner MinSizePartitioner MaxSizePartitioner",
    "data": "AUTOTUNE AutoShardPolicy Dataset DistributeOptions DistributedDataset InputContext Options TextLineDataset auto_shard",
    "optimizers": (
        "Optimizer SGD Momentum Adagrad Adam Ftrl optimizer_from_config LearningRateSchedule ExponentialDecay "
        "InverseTimeDecay PiecewiseConstantDecay PolynomialDecay CosineDecay schedule_from_config"
    ),
    "kernels": "DeviceUnavailableError",
    "nn": "Dense Embedding Flatten Sequential MLP SigmoidCrossEntropy SoftmaxCrossEntropy glorot_uniform",
    "checkpoint": (
        "Checkpoint CheckpointManager CheckpointReader StepCounter latest_checkpoint verify_checkpoint "
        "CheckpointError CheckpointCorruptError CheckpointMismatchError"
    ),
    "evaluator": "SidecarEvaluator",
    "watchdog": "Watchdog",
    "supervisor": "EXIT_PS_UNAVAILABLE RestartPolicy install_excepthook run_coordinator",
    "launcher": "LocalCluster run_local",
    "restarting": "RestartingLocalCluster",
}.items():
    for _name in _names.split():
        _EXPORTS[_name] = _module

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kubeps.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # cache: the next access is a plain attribute lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
