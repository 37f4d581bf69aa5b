"""kubeps runtime: TensorFlow-style parameter-server training without TensorFlow.

The public names below mirror ``tf.distribute.experimental.ParameterServerStrategy`` and
``tf.distribute.experimental.coordinator.ClusterCoordinator`` and their friends. They are imported lazily, on
first use, so that a light user of one module (the operator imports only ``kubeps.runtime.cluster``) does not
pay for grpc, cloudpickle and numpy at import time; the ``TYPE_CHECKING`` block below shows type checkers and IDEs
the same names.

Where things live (each package's docstring states its rule): ``cluster``, ``contract`` and ``certs`` (TF_CONFIG,
the pod contract and the job's certificates, shared with the operator), ``settings`` (a task's settings: the
contract's variables, parsed once), ``checks`` (the one validation dialect), ``lifecycle`` (which exit restarts what, shared too), ``errors``, ``util``,
``data`` (input), ``rpc`` (everything on the network), ``variables`` (what a program holds and pushes), ``observe``
(TensorBoard event files: ``kp.summary``; tensorboardX loads only when a writer is created), ``ops`` (kernels,
optimizers, layers), ``models`` (gradients of models written with JAX; jax loads only when used), ``ps`` and
``worker`` (what runs on those tasks), ``checkpoint``, ``coordinator`` (the chief), ``server`` (a task's process),
``local`` (``kubeps local``) and ``cli``.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from kubeps.runtime.contract import VERSION

__version__ = VERSION  # kubeps.runtime.contract holds the one source of the version

# gRPC's C core reads GRPC_VERBOSITY once, when grpc is imported; unset, grpcio logs at INFO, which writes one line
# to stderr for every failed TLS handshake (~440 bytes: any client that reaches a port can write ~40 KB/s to the
# task's log). Before any module of this package imports grpc, its default becomes ERROR (gRPC's documented
# default); a user who sets it (GRPC_VERBOSITY=INFO to see the handshakes) keeps their value.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# public name -> module (relative to this package) that defines it
_EXPORTS: dict[str, str] = {}
for _module, _names in {
    "cluster": "ClusterSpec TFConfig TFConfigClusterResolver TFConfigError",
    "coordinator.strategy": "ParameterServerStrategy",
    "coordinator.cluster_coordinator": "ClusterCoordinator",
    "coordinator.values": "PerWorkerValues",
    "coordinator.closure_queue": "RemoteValue",
    "variables.variable": "Variable ShardedVariable embedding_lookup",
    "variables.indexed_slices": "IndexedSlices",
    "variables.dynamic": "DynamicEmbedding",
    "server.service": "Server register_ps_method register_worker_method",
    "variables.context": "get_current_worker_index",
    "errors": (
        "CancelledError ClosureError InsecureServerError OutOfRangeError PSUnavailableError RemoteError "
        "RuntimeConfigError "
        "UnauthenticatedError WorkerUnavailableError"
    ),
    "variables.partitioners": "Partitioner FixedShardsPartitioner MinSizePartitioner MaxSizePartitioner",
    "data": "AUTOTUNE AutoShardPolicy Dataset DistributeOptions DistributedDataset InputContext Options TextLineDataset auto_shard"
            " CsvDataset FixedLenFeature ParquetDataset TFRecordDataset TFRecordWriter VarLenFeature parse_example"
            " hash_bucket",
    "ops.optimizers": "Optimizer SGD Momentum Adagrad Adam AdamW Ftrl RMSprop Adadelta Nadam Adamax Lion "
                      "optimizer_from_config",
    "ops.schedules": (
        "LearningRateSchedule ExponentialDecay InverseTimeDecay PiecewiseConstantDecay PolynomialDecay CosineDecay "
        "CosineDecayRestarts "
        "schedule_from_config"
    ),
    "ops.kernels": "DeviceUnavailableError",
    "models.autodiff": "ValueAndGrad value_and_grad",
    "ops.nn": "Add Concatenate Dense DynamicEmbeddingLayer Embedding Flatten Sequential MLP SigmoidCrossEntropy SoftmaxCrossEntropy glorot_uniform",
    "checkpoint": (
        "Checkpoint CheckpointManager CheckpointReader StepCounter latest_checkpoint verify_checkpoint "
        "CheckpointError CheckpointCorruptError CheckpointMismatchError"
    ),
    "checkpoint.evaluator": "SidecarEvaluator",
    "observe.train_metrics": "TrainMetricsLogger",
    "coordinator.watchdog": "Watchdog",
    "contract": "EXIT_PS_UNAVAILABLE",
    "coordinator.supervisor": "install_excepthook run_coordinator",
    "local.policy": "RestartPolicy",
    "local.launcher": "LocalCluster run_local",
    "local.restarting": "RestartingLocalCluster",
}.items():
    for _name in _names.split():
        _EXPORTS[_name] = _module

#: submodules users import by their old short names (``from kubeps.runtime import nn, kernels``)
_SUBMODULES: dict[str, str] = {"nn": "ops.nn", "kernels": "ops.kernels", "summary": "observe.summary"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what type checkers and IDEs see; kept equal to _EXPORTS by tests/code_checks/test_public_api.py
    from kubeps.runtime.checkpoint import (
        Checkpoint as Checkpoint, CheckpointCorruptError as CheckpointCorruptError,
        CheckpointError as CheckpointError, CheckpointManager as CheckpointManager,
        CheckpointMismatchError as CheckpointMismatchError, CheckpointReader as CheckpointReader,
        latest_checkpoint as latest_checkpoint, StepCounter as StepCounter, verify_checkpoint as verify_checkpoint,
    )
    from kubeps.runtime.checkpoint.evaluator import SidecarEvaluator as SidecarEvaluator
    from kubeps.runtime.cluster import (
        ClusterSpec as ClusterSpec, TFConfig as TFConfig, TFConfigClusterResolver as TFConfigClusterResolver,
        TFConfigError as TFConfigError,
    )
    from kubeps.runtime.contract import EXIT_PS_UNAVAILABLE as EXIT_PS_UNAVAILABLE
    from kubeps.runtime.coordinator.closure_queue import RemoteValue as RemoteValue
    from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator as ClusterCoordinator
    from kubeps.runtime.coordinator.strategy import ParameterServerStrategy as ParameterServerStrategy
    from kubeps.runtime.coordinator.supervisor import (
        install_excepthook as install_excepthook, run_coordinator as run_coordinator,
    )
    from kubeps.runtime.coordinator.values import PerWorkerValues as PerWorkerValues
    from kubeps.runtime.coordinator.watchdog import Watchdog as Watchdog
    from kubeps.runtime.data import (
        auto_shard as auto_shard, AutoShardPolicy as AutoShardPolicy, AUTOTUNE as AUTOTUNE, Dataset as Dataset,
        DistributedDataset as DistributedDataset, DistributeOptions as DistributeOptions,
        InputContext as InputContext, Options as Options, TextLineDataset as TextLineDataset,
        CsvDataset as CsvDataset, FixedLenFeature as FixedLenFeature, ParquetDataset as ParquetDataset,
        TFRecordDataset as TFRecordDataset, TFRecordWriter as TFRecordWriter, VarLenFeature as VarLenFeature,
        parse_example as parse_example, hash_bucket as hash_bucket,
    )
    from kubeps.runtime.errors import (
        CancelledError as CancelledError, ClosureError as ClosureError, InsecureServerError as InsecureServerError,
        OutOfRangeError as OutOfRangeError, PSUnavailableError as PSUnavailableError, RemoteError as RemoteError,
        RuntimeConfigError as RuntimeConfigError, UnauthenticatedError as UnauthenticatedError,
        WorkerUnavailableError as WorkerUnavailableError,
    )
    from kubeps.runtime.local.launcher import LocalCluster as LocalCluster, run_local as run_local
    from kubeps.runtime.local.policy import RestartPolicy as RestartPolicy
    from kubeps.runtime.local.restarting import RestartingLocalCluster as RestartingLocalCluster
    from kubeps.runtime.models.autodiff import ValueAndGrad as ValueAndGrad, value_and_grad as value_and_grad
    from kubeps.runtime.ops.kernels import DeviceUnavailableError as DeviceUnavailableError
    from kubeps.runtime.ops.nn import (
        Add as Add, Concatenate as Concatenate, Dense as Dense, DynamicEmbeddingLayer as DynamicEmbeddingLayer,
        Embedding as Embedding, Flatten as Flatten,
        glorot_uniform as glorot_uniform, MLP as MLP, Sequential as Sequential, SigmoidCrossEntropy as SigmoidCrossEntropy,
        SoftmaxCrossEntropy as SoftmaxCrossEntropy,
    )
    from kubeps.runtime.ops.optimizers import (
        Adadelta as Adadelta, Adagrad as Adagrad, Adam as Adam, Adamax as Adamax, AdamW as AdamW, Ftrl as Ftrl,
        Lion as Lion, Momentum as Momentum, Nadam as Nadam, Optimizer as Optimizer,
        optimizer_from_config as optimizer_from_config, RMSprop as RMSprop, SGD as SGD,
    )
    from kubeps.runtime.ops.schedules import (
        CosineDecay as CosineDecay, CosineDecayRestarts as CosineDecayRestarts, ExponentialDecay as ExponentialDecay, InverseTimeDecay as InverseTimeDecay,
        LearningRateSchedule as LearningRateSchedule, PiecewiseConstantDecay as PiecewiseConstantDecay,
        PolynomialDecay as PolynomialDecay, schedule_from_config as schedule_from_config,
    )
    from kubeps.runtime.server.service import (
        register_ps_method as register_ps_method, register_worker_method as register_worker_method,
        Server as Server,
    )
    from kubeps.runtime.variables.context import get_current_worker_index as get_current_worker_index
    from kubeps.runtime.variables.dynamic import DynamicEmbedding as DynamicEmbedding
    from kubeps.runtime.variables.indexed_slices import IndexedSlices as IndexedSlices
    from kubeps.runtime.variables.partitioners import (
        FixedShardsPartitioner as FixedShardsPartitioner, MaxSizePartitioner as MaxSizePartitioner,
        MinSizePartitioner as MinSizePartitioner, Partitioner as Partitioner,
    )
    from kubeps.runtime.variables.variable import (
        embedding_lookup as embedding_lookup, ShardedVariable as ShardedVariable, Variable as Variable,
    )
    from kubeps.runtime.observe.train_metrics import TrainMetricsLogger as TrainMetricsLogger
    from kubeps.runtime.ops import kernels as kernels, nn as nn
    from kubeps.runtime.observe import summary as summary


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value: Any = importlib.import_module(f".{_SUBMODULES[name]}", __name__)
    else:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'kubeps.runtime' has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # cache: the next access is a plain attribute lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
