"""Callbacks of :func:`kubeps.runtime.models.keras_fit.fit`, as Keras's: the protocol (:class:`Callback`), the
:class:`History` that ``fit`` returns, and checkpoints into kubeps checkpoints -- :class:`ModelCheckpoint` (save
every epoch or every N steps) and :class:`BackupAndRestore` (the same, and restore the latest checkpoint when
training starts, so a chief restarted after a lost parameter server continues from its step and epoch), and
:class:`TensorBoard` (train scalars as event files, through :mod:`kubeps.runtime.observe.summary`).

Keras's own callbacks (``keras.callbacks.Callback``) are called through their protocol by
:mod:`kubeps.runtime.models.keras_fit`; this module stays free of keras. The hooks are called on the chief. ``fit`` schedules ``steps_per_execution`` steps per function and waits for them
(``coordinator.join()``) at the end of every epoch and every ``sync_every`` steps a callback asks for;
``on_train_batch_end(step, logs)`` is called at each of those points, with ``logs``: ``loss`` (mean over the steps
since the last call), ``step``, ``examples``, ``examples_per_s``. ``on_epoch_end(epoch, logs)`` gets the epoch's
mean loss. That is the hook a TensorBoard writer uses.

Rule: no keras or jax import (callbacks see the trainer through its attributes: ``variables``, ``step``,
``steps_per_epoch``, ``total_steps``, ``model``, ``stop_training``).
"""

from __future__ import annotations

from typing import Annotated, Any, Iterator, Literal, Sequence

from kubeps.runtime.checkpoint.api import Checkpoint, check_checkpoint_root
from kubeps.runtime.checkpoint.manager import CheckpointManager
from kubeps.runtime.checks import Allowed, PositiveInt, check
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.observe.summary import SummaryWriter, create_file_writer, resolve_logdir
from kubeps.runtime.observe.train_metrics import TrainMetricsLogger

__all__ = ["BackupAndRestore", "Callback", "CallbackList", "History", "ModelCheckpoint", "TensorBoard",
           "check_checkpoint_root"]


class Callback:
    """Override any of the hooks. ``self.trainer`` is the :class:`~kubeps.runtime.models.keras_fit.KerasTrainer`
    (``self.model`` its Keras model, holding the weights of the step the hook reports: ``fit`` pulls them from the
    parameter servers before the hooks run); set ``self.trainer.stop_training = True`` (or
    ``self.model.stop_training``) to stop. A callback that needs to see a step (a checkpoint every N steps) sets
    ``sync_every = N``; one that never reads the model's weights sets ``reads_model = False`` (no pull for it)."""

    sync_every: int | None = None
    reads_model = True

    def __init__(self) -> None:
        self.trainer: Any = None

    def set_trainer(self, trainer: Any) -> None:
        self.trainer = trainer

    @property
    def model(self) -> Any:
        return self.trainer.model if self.trainer is not None else None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        pass

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        pass

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        pass

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        pass

    def on_train_batch_begin(self, step: int, logs: dict[str, Any] | None = None) -> None:
        pass

    def on_train_batch_end(self, step: int, logs: dict[str, Any] | None = None) -> None:
        pass


class History(Callback):
    """``history``: every ``on_epoch_end`` log by key (``loss``, the metrics, ``val_loss``, ``examples_per_s``,
    ...); ``epoch``: the epochs."""

    reads_model = False

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[Any]] = {}
        self.epoch: list[int] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)


class CallbackList:
    """The callbacks of one ``fit``, called in order."""

    def __init__(self, callbacks: Sequence[Callback], trainer: Any):
        for i, cb in enumerate(callbacks):
            if not isinstance(cb, Callback):
                raise RuntimeConfigError(f"callbacks[{i}]", type(cb).__name__,
                                         "must be a kubeps.runtime.models.keras_callbacks.Callback")
            cb.set_trainer(trainer)
        self.callbacks = list(callbacks)

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.callbacks)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        for cb in self.callbacks:
            cb.on_train_begin(logs)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        for cb in self.callbacks:
            cb.on_train_end(logs)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        for cb in self.callbacks:
            cb.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        for cb in self.callbacks:
            cb.on_epoch_end(epoch, logs)

    def on_train_batch_begin(self, step: int, logs: dict[str, Any] | None = None) -> None:
        for cb in self.callbacks:
            cb.on_train_batch_begin(step, logs)

    def on_train_batch_end(self, step: int, logs: dict[str, Any] | None = None) -> None:
        for cb in self.callbacks:
            cb.on_train_batch_end(step, logs)


#: how often a callback acts: at every epoch's end, or every N steps
_FREQ = Annotated[Literal["epoch"] | PositiveInt, Allowed("'epoch' or a number of steps >= 1")]


class ModelCheckpoint(Callback):
    """``ModelCheckpoint(directory, save_freq="epoch", max_to_keep=5)``: a kubeps checkpoint of every weight (on
    the parameter servers, with the optimizer's slots) and the step, at the end of every epoch or every
    ``save_freq`` steps (a multiple of ``steps_per_execution``); the checkpoint at the last step is saved ``final``
    (the sidecar evaluator stops after it), and so is the one where a callback stopped the training early. Objects: ``model`` (the weights by Keras path, the tables by name) and
    ``step``; :func:`kubeps.runtime.models.keras_fit.restore_weights` loads them into a Keras model."""

    restore = False
    reads_model = False

    def __init__(self, directory: str, save_freq: str | int = "epoch", max_to_keep: int | None = 5,
                 verbose: int = 1):
        super().__init__()
        check("save_freq", save_freq, _FREQ, owner=type(self).__name__)
        if not isinstance(directory, str) or not directory:
            raise RuntimeConfigError(f"{type(self).__name__} directory", directory,
                                     "must be a path (or an fsspec URL) every task sees")
        self.directory = directory
        self.save_freq = save_freq
        self.sync_every = save_freq if isinstance(save_freq, int) else None
        self.max_to_keep = max_to_keep
        self.verbose = verbose
        self.manager: CheckpointManager | None = None
        self.last_saved: int | None = None
        self.last_final = False
        self.saved: list[str] = []

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        check_checkpoint_root(self.directory, f"{type(self).__name__} directory", self.trainer.settings)
        checkpoint = Checkpoint(model=self.trainer.variables, step=self.trainer.step)
        self.manager = CheckpointManager(checkpoint, self.directory, max_to_keep=self.max_to_keep)
        if self.restore:
            path = self.manager.latest_checkpoint
            if path is None:
                self._say(f"no checkpoint in {self.directory}: starting from step {self.trainer.step.value}")
            else:
                step = self.manager.restore(path)
                self.last_saved = step
                self._say(f"resumed from step {step} ({path})")

    def _say(self, text: str) -> None:
        if self.verbose:
            print(text, flush=True)

    def _save(self, final: bool = False) -> None:
        step = self.trainer.step.value
        if self.manager is None or (step == self.last_saved and (self.last_final or not final)):
            return
        final = final or step == self.trainer.total_steps
        path = self.manager.save(step=step, final=final)
        self.last_saved, self.last_final = step, final
        self.saved.append(path)
        self._say(f"step {step}: saved {path}" + (" (final)" if final else ""))

    def on_train_batch_end(self, step: int, logs: dict[str, Any] | None = None) -> None:
        if self.sync_every and step % self.sync_every == 0:
            self._save()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.save_freq == "epoch":
            # Keras's callbacks ran first: an EarlyStopping that stopped here makes this the final checkpoint
            self._save(final=bool(getattr(self.trainer, "stopping", False)))

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self.trainer.step.value == self.trainer.total_steps or self.trainer.stop_training:
            # the final checkpoint, when the last interval ended between save points or a callback stopped early
            # (saved again as final if the epoch's end saved it already: the evaluator stops after a final one)
            self._save(final=True)


class BackupAndRestore(ModelCheckpoint):
    """``BackupAndRestore(directory, save_freq="epoch", max_to_keep=5)``: :class:`ModelCheckpoint` that also
    restores the latest checkpoint of ``directory`` when training begins -- the weights, the optimizer's slots and
    the step -- and ``fit`` continues from that step (and its epoch). With the chief under ``run_coordinator``, a
    lost parameter server ends it with status 133; restarted (``kubeps local --restart``, the operator), it goes on
    from the last checkpoint."""

    restore = True


class TensorBoard(Callback):
    """``TensorBoard(log_dir=None, update_freq="epoch")``, as Keras's: writes ``loss``, ``examples/sec`` and
    ``global_step/sec`` to ``<log_dir>/train`` (``log_dir`` defaults to ``$KUBEPS_LOGDIR`` of the chief's settings,
    those of the trainer's strategy, when training begins; unset: nothing is written) at every epoch's end, or every ``update_freq`` steps (a multiple of ``steps_per_execution``), plus
    ``epoch_<key>`` of every metric in the epoch's logs (``epoch_loss``, ``epoch_accuracy``, ``epoch_val_loss``,
    ...) at each epoch's end. A chief resumed from a checkpoint at step S purges the events the lost run
    wrote after S, so the curves do not overlap (TensorBoard's ``purge_step``)."""

    reads_model = False

    def __init__(self, log_dir: str | None = None, update_freq: str | int = "epoch"):
        super().__init__()
        check("update_freq", update_freq, _FREQ, owner="TensorBoard")
        #: ``<log_dir>/train``; without ``log_dir``, None until training begins (then from the chief's settings)
        self.logdir = resolve_logdir(log_dir, "train")
        self.update_freq = update_freq
        self.sync_every = update_freq if isinstance(update_freq, int) else None
        self.writer: SummaryWriter | None = None
        self.logger: TrainMetricsLogger | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.logdir is None:
            self.logdir = resolve_logdir(None, "train", self.trainer.settings)
        if self.logdir is None:
            return
        start = int(self.trainer.step.value)
        self.writer = create_file_writer(self.logdir, purge_step=start + 1 if start else None)
        self.logger = TrainMetricsLogger(self.writer, start_step=start)  # loss and global_step/sec per write

    def _log(self, step: int, logs: dict[str, Any]) -> None:
        if self.logger is not None:
            self.logger.log(step, loss=logs["loss"], **{"examples/sec": logs["examples_per_s"]})

    def on_train_batch_end(self, step: int, logs: dict[str, Any] | None = None) -> None:
        if self.sync_every is not None and logs:
            self._log(step, logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.writer is None or not logs:
            return
        step = int(logs["step"])
        if self.sync_every is None:
            self._log(step, logs)
        scalars = {f"epoch_{k}": float(v) for k, v in logs.items()
                   if k not in ("step", "examples", "examples_per_s") and isinstance(v, (int, float))}
        self.writer.scalars({**scalars, "epoch_examples/sec": logs["examples_per_s"]}, step)
        self.writer.flush()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer, self.logger = None, None
