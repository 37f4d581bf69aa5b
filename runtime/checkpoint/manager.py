"""``CheckpointManager``: numbered checkpoints in a directory, the latest restored, the oldest deleted.

The newest manager a process made is what the chief saves with when the operator asks it for a checkpoint
(:func:`newest_manager`; the membership document's ``checkpoint`` request, docs/elastic.md): a save may then come
from that thread while the program saves from its own, so saves of one manager are serialised.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from kubeps.runtime.checks import Flag, NonNegativeInt, PositiveInt, check
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.util.storage import is_temporary, normalize_path, storage_for
from kubeps.runtime.checkpoint.api import Checkpoint
from kubeps.runtime.checkpoint.format import (
    CHECKPOINT_PREFIX,
    MANIFEST_NAME,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    numbered_dirs,
    read_manifest,
)
from kubeps.runtime.checkpoint import preemption
from kubeps.runtime.checkpoint.incremental import IncrementalPolicy, IncrementalSave, referenced_checkpoints


log = logging.getLogger(__name__)

_newest: "weakref.ref[CheckpointManager] | None" = None


def newest_manager() -> "CheckpointManager | None":
    """The newest :class:`CheckpointManager` this process made and still holds, or None."""
    return _newest() if _newest is not None else None


class CheckpointManager:
    """Numbered checkpoints in one directory, keeping the newest ``max_to_keep``.

    With ``incremental=True`` a save writes, for the variables on parameter servers, only the rows changed since the
    newest committed checkpoint, as deltas over a full base written by an earlier save
    (:mod:`kubeps.runtime.checkpoint.incremental`; ``policy`` says when a chain is compacted by a full save). Every
    checkpoint stays complete in the sense that counts: it restores alone, into any number of parameter servers; it
    reads the files of the earlier checkpoints of its chain, which ``max_to_keep`` therefore never deletes while a
    kept one needs them. Off by default: a checkpoint directory then holds every file of its checkpoint, which
    copying one checkpoint elsewhere, or an older kubeps (format version 3 is needed), relies on.

    With ``save_on_sigterm`` (the default), a SIGTERM to the program saves a checkpoint with its newest manager
    before the process ends (:mod:`kubeps.runtime.checkpoint.preemption`)."""

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: int | None = 5, *,
                 incremental: bool = False, policy: IncrementalPolicy | None = None, save_on_sigterm: bool = True):
        if not isinstance(checkpoint, Checkpoint):
            raise CheckpointError(f"checkpoint must be a kubeps Checkpoint, got {type(checkpoint).__name__}")
        check("max_to_keep", max_to_keep, PositiveInt | None, owner="CheckpointManager",
              allowed="None (keep all) or an int >= 1")
        checkpoint.check_root(directory, "CheckpointManager directory")  # before the folder is made
        self.checkpoint = checkpoint
        self.directory = normalize_path(directory)
        self.storage = storage_for(self.directory)
        self.max_to_keep = max_to_keep
        self.incremental = check("incremental", incremental, Flag, owner="CheckpointManager")
        if policy is not None and not isinstance(policy, IncrementalPolicy):
            raise RuntimeConfigError("CheckpointManager.policy", policy, "an IncrementalPolicy, or None")
        self.policy = policy or IncrementalPolicy()
        self.storage.makedirs(self.directory)
        self._saving = threading.Lock()
        #: the save under way (``save(wait=False)``) and the error of the last one that failed
        self._pending: threading.Thread | None = None
        self._failed: BaseException | None = None
        #: the thread inside a save, and whether the process ends when that save is committed (SIGTERM came in it)
        self._saving_thread: int | None = None
        self.exit_after_save = False
        if check("save_on_sigterm", save_on_sigterm, Flag, owner="CheckpointManager"):
            preemption.install(newest_manager)
        global _newest
        _newest = weakref.ref(self)

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the committed checkpoints, oldest first."""
        return [p for _, p in list_checkpoints(self.directory)]

    @property
    def latest_checkpoint(self) -> str | None:
        return latest_checkpoint(self.directory)

    def save(self, checkpoint_number: int | None = None, *, step: int | None = None, final: bool = False,
             wait: bool = True) -> str:
        """Save a new checkpoint (number: given, or one more than the newest); returns its path.

        ``wait=False`` returns once the save is under way: the step and the states of the checkpoint's objects are
        taken now, the shards' rows as each ps handles its part, while training goes on; the checkpoint exists when
        its manifest is committed. The next ``save``, ``restore`` or :meth:`wait` waits for it first and raises its
        error, if it failed (the previous checkpoint is then still the newest)."""
        check("wait", wait, Flag, owner="CheckpointManager.save")
        self.wait()
        with self._saving:
            if wait:
                self._saving_thread = threading.get_ident()
                try:
                    path = self._save(checkpoint_number, step, final)
                finally:
                    self._saving_thread = None
                if self.exit_after_save:  # SIGTERM came during this save: it is committed, the process ends
                    preemption.terminate()
                return path
            path, number, committed = self._target(checkpoint_number)
            taken = self.checkpoint.capture(step)
            self._pending = threading.Thread(target=self._background, args=(path, number, committed, taken, final),
                                             name=f"kubeps-checkpoint-{number}")
            self._pending.start()  # not a daemon: the program's end waits for the write
            return path

    def saving_in_this_thread(self) -> bool:
        """Whether the calling thread is inside a save of this manager (a signal handler asks)."""
        return self._saving_thread == threading.get_ident()

    def wait(self) -> None:
        """Wait for the save under way (``save(wait=False)``), if any; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def _background(self, path: str, number: int, committed: list[tuple[int, str]],
                    taken: tuple[int | None, dict[str, Any]], final: bool) -> None:
        try:
            with self._saving:
                self._write(path, number, committed, taken, final)
        except BaseException as err:  # noqa: BLE001 - raised by the next save, restore or wait
            log.warning("the checkpoint save to %s failed (raised by the next save or wait): %s", path, err)
            self._failed = err

    def _save(self, checkpoint_number: int | None, step: int | None, final: bool) -> str:
        path, number, committed = self._target(checkpoint_number)
        return self._write(path, number, committed, self.checkpoint.capture(step), final)

    def _target(self, checkpoint_number: int | None) -> tuple[str, int, list[tuple[int, str]]]:
        """The path and number of the next checkpoint, and the committed ones; the remains of interrupted saves
        are deleted."""
        existing = numbered_dirs(self.directory)
        committed = list_checkpoints(self.directory)
        if checkpoint_number is None:
            checkpoint_number = (committed[-1][0] + 1) if committed else 0
        checkpoint_number = check("checkpoint_number", checkpoint_number, NonNegativeInt, owner="CheckpointManager")
        if committed and checkpoint_number < committed[-1][0]:
            # checkpoints are ordered by number (latest_checkpoint, max_to_keep, the evaluator): a lower one would
            # never be the latest, and once max_to_keep is reached the sweep would delete it right away
            raise CheckpointError(
                f"checkpoint_number={checkpoint_number} is invalid: the newest committed checkpoint is "
                f"{committed[-1][0]}; allowed is a number above it (or None for the next one)"
            )
        path = self.storage.join(self.directory, f"{CHECKPOINT_PREFIX}{checkpoint_number}")
        # partial checkpoints (no manifest) are the remains of interrupted saves: nobody reads them
        committed_paths = {p for _, p in committed}
        for _, p in existing:
            if p not in committed_paths and p != path:
                self.storage.remove_tree(p)
        return path, checkpoint_number, committed

    def _write(self, path: str, checkpoint_number: int, committed: list[tuple[int, str]],
               taken: tuple[int | None, dict[str, Any]], final: bool) -> str:
        try:
            self.checkpoint.write(path, checkpoint_number=checkpoint_number, final=final, taken=taken,
                                  incremental=self._incremental(checkpoint_number, committed))
        except BaseException:
            # what a failed save wrote goes at once (a full disk gets its space back); the previous checkpoint is
            # untouched, and the next save tries again
            if not self.storage.exists(self.storage.join(path, MANIFEST_NAME)):
                self.storage.remove_tree(path)
            raise
        self._sweep()
        return path

    def _incremental(self, number: int, committed: list[tuple[int, str]]) -> IncrementalSave | None:
        """The plan of an incremental save of checkpoint ``number`` (None: not incremental): its parent, the newest
        committed checkpoint, and the checkpoints the sweep after it keeps (its chains may name only those)."""
        if not self.incremental:
            return None
        parent = (committed[-1][0], read_manifest(committed[-1][1])) if committed else None
        keep = None
        if self.max_to_keep is not None:
            older = [n for n, _ in committed if n != number]
            keep = set(older[len(older) - (self.max_to_keep - 1):] if self.max_to_keep > 1 else []) | {number}
        return IncrementalSave(number, parent, keep, self.policy)

    def _sweep(self) -> None:
        if self.max_to_keep is None:
            return
        committed = list_checkpoints(self.directory)
        kept = committed[max(0, len(committed) - self.max_to_keep):]
        needed: set[int] = set()
        for number, p in kept:  # a checkpoint a kept one reads stays (a manager with another max_to_keep wrote it)
            needed |= referenced_checkpoints(read_manifest(p), number)
        for number, p in committed[: max(0, len(committed) - self.max_to_keep)]:
            if number in needed:
                continue
            # the manifest goes first: a sweep interrupted half-way leaves an uncommitted directory, not a broken one
            self.storage.remove(self.storage.join(p, MANIFEST_NAME))
            self.storage.remove_tree(p)
        for name in self.storage.listdir(self.directory):
            if is_temporary(name):
                self.storage.remove(self.storage.join(self.directory, name))

    def restore(self, path: str | None = None) -> int | None:
        """Restore ``path`` (default: the newest checkpoint); returns its step. No checkpoint: ``None``. A save
        under way is waited for first."""
        self.wait()
        if path is None:
            path = self.latest_checkpoint
            if path is None:
                return None
        return self.checkpoint.restore(path)

    def restore_or_initialize(self) -> int:
        """Restore the newest checkpoint if there is one; returns its step, or 0 for a fresh start."""
        step = self.restore()
        return 0 if step is None else int(step)
