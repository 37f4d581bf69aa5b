"""What a pipeline is configured with: ``InputContext`` (which worker builds it, for how many replicas) and the
dataset ``Options`` with TensorFlow's ``AutoShardPolicy``."""

from __future__ import annotations

import enum
import numbers
from typing import Any

from kubeps.runtime.checks import NonNegativeInt, PositiveInt, check, index_in


class InputContext:
    """What an input function needs to know to shard and batch, as ``tf.distribute.InputContext``.

    ``num_input_pipelines`` is the number of workers building a pipeline, ``input_pipeline_id`` this worker's
    index among them, ``num_replicas_in_sync`` how many replicas share one global batch. ``initial_step`` (not in
    TensorFlow's) is the training step the job resumed from, 0 on a fresh start: Keras ``fit`` sets it after
    ``BackupAndRestore`` restored a checkpoint, so a dataset function can skip what was consumed or reseed.
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1,
                 initial_step: int = 0):
        self._num_input_pipelines = check("num_input_pipelines", num_input_pipelines, PositiveInt)
        self._input_pipeline_id = check("input_pipeline_id", input_pipeline_id,
                                        index_in(self._num_input_pipelines, "num_input_pipelines"))
        self._num_replicas_in_sync = check("num_replicas_in_sync", num_replicas_in_sync, PositiveInt)
        self._initial_step = check("initial_step", initial_step, NonNegativeInt)

    @property
    def initial_step(self) -> int:
        return self._initial_step

    @property
    def num_input_pipelines(self) -> int:
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``; a ``ValueError`` when it does not divide evenly."""
        global_batch_size = check("global_batch_size", global_batch_size, PositiveInt)
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size!r} is not divisible by `num_replicas_in_sync` "
                f"{self._num_replicas_in_sync!r}"
            )
        return global_batch_size // self._num_replicas_in_sync

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InputContext):
            return NotImplemented
        return (self._num_input_pipelines, self._input_pipeline_id, self._num_replicas_in_sync,
                self._initial_step) == (
            other._num_input_pipelines,
            other._input_pipeline_id,
            other._num_replicas_in_sync,
            other._initial_step,
        )

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, num_replicas_in_sync={self._num_replicas_in_sync}"
            + (f", initial_step={self._initial_step})" if self._initial_step else ")")
        )


# -- options ------------------------------------------------------------------------------------------------------
class AutoShardPolicy(enum.IntEnum):
    """How :func:`auto_shard` splits a dataset across workers (TensorFlow's values)."""

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2


class DistributeOptions:
    """``options.experimental_distribute``: the auto-shard policy."""

    def __init__(self, auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO):
        self.auto_shard_policy = auto_shard_policy

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        return self._auto_shard_policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, value: Any) -> None:
        self._auto_shard_policy = as_policy(value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DistributeOptions) and other.auto_shard_policy == self.auto_shard_policy

    def __repr__(self) -> str:
        return f"DistributeOptions(auto_shard_policy={self._auto_shard_policy.name})"


class Options:
    """Dataset options, as ``tf.data.Options``; only the distribution options matter to kubeps."""

    def __init__(self) -> None:
        self.experimental_distribute = DistributeOptions()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Options) and other.experimental_distribute == self.experimental_distribute

    def __repr__(self) -> str:
        return f"Options(experimental_distribute={self.experimental_distribute!r})"


def as_policy(value: Any) -> AutoShardPolicy:
    """``value`` as an :class:`AutoShardPolicy`: the enum itself, its name (any case) or its integer value."""
    if isinstance(value, AutoShardPolicy):
        return value
    if isinstance(value, str) and value.upper() in AutoShardPolicy.__members__:
        return AutoShardPolicy[value.upper()]
    try:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return AutoShardPolicy(int(value))
    except ValueError:
        pass
    allowed = ", ".join(f"{p.name} ({p.value})" for p in AutoShardPolicy)
    raise ValueError(f"auto_shard_policy must be an AutoShardPolicy, one of {allowed}; got {value!r}")