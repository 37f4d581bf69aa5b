"""``Checkpoint``: the objects a checkpoint holds, by name; ``write`` and ``restore`` one checkpoint directory."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import numpy as np

from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.observe import metrics as _metrics
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.util.storage import StorageError, checkpoint_roots, confine, normalize_path, storage_for
from kubeps.runtime.checkpoint.dynamic import TableSaveable, check_table, restore_tables, save_tables, verify_table
from kubeps.runtime.checkpoint.format import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointMismatchError,
    Manifest,
    SliceEntry,
    TensorEntry,
    VariableEntry,
    commit_manifest,
    dtype_name,
    manifest_version,
    overlapping,
    read_manifest,
    short_listing,
    tensor_rows,
)
from kubeps.runtime.checkpoint.incremental import IncrementalSave
from kubeps.runtime.checkpoint.saveables import (SAVEABLE_ADAPTERS, ArrayAccess, LocalExecutor, PSExecutor, Saveable,
                                                ShardExecutor, ShardRef, group_key)
from kubeps.runtime.checkpoint.shards import RestoreItem, SavedShard, SaveItem
from kubeps.runtime.variables.dynamic import DynamicEmbedding

log = logging.getLogger(__name__)


def _manifest_bytes(manifest: Manifest) -> int:
    """The bytes of the variables and their slots a manifest describes (dynamic tables apart)."""
    total = 0
    for entry in manifest.variables.values():
        tensors = [(entry.shape, entry.dtype)] + [(t.shape, t.dtype) for g in entry.slots.values() for t in g.values()]
        total += sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in tensors)
    return total


def _observe_checkpoint(operation: str, started: float, manifest: Manifest) -> None:
    _metrics.CHECKPOINT_SECONDS.labels(operation).observe(time.perf_counter() - started)
    _metrics.CHECKPOINT_BYTES.labels(operation).inc(_manifest_bytes(manifest))


def check_checkpoint_root(directory: str, field: str, settings: TaskSettings) -> None:
    """Refuse, before anything is written, a checkpoint directory the parameter servers would refuse at the first
    save: outside the job's checkpoint roots (``KUBEPS_CHECKPOINT_ROOT``, the task's settings; ``kubeps local`` and
    the operator give the chief the ps's), or relative."""
    roots = checkpoint_roots(settings.checkpoint_root)
    try:
        confine(normalize_path(directory), roots, field)
    except StorageError as err:
        raise RuntimeConfigError(field, directory, f"the parameter servers write only inside the job's checkpoint "
                                 f"roots {roots or '(any absolute path)'} (KUBEPS_CHECKPOINT_ROOT): {err}") from None


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None))


def _check_root_for(saveables: list[Saveable], tables: list[TableSaveable], directory: str, field: str) -> None:
    """:func:`check_checkpoint_root` when parameter servers write part of the checkpoint, under the settings of the
    chief whose strategy made their transport (``PSTransport.settings``; a transport made without settings knows
    no roots: only a relative directory is refused before the parameter servers see it)."""
    executors = [shard.executor for sv in saveables for shard in sv.shards if isinstance(shard.executor, PSExecutor)]
    if tables or executors:
        transports = [t.table.transport for t in tables if t.table.is_remote] + [e.transport for e in executors]
        known = [s for s in (getattr(t, "settings", None) for t in transports) if s is not None]
        check_checkpoint_root(directory, field, known[0] if known else TaskSettings())


def _rows(tensor: TensorEntry, start: int, stop: int) -> dict[str, Any]:
    """Rows ``start..stop-1`` of a checkpointed tensor: its entry with the slices that overlap them, as a
    ``RestoreItem`` carries it (JSON)."""
    slices = [s for s, _, _ in overlapping(tensor.slices, start, stop)] if tensor.shape else tensor.slices
    return TensorEntry(shape=tensor.shape, dtype=tensor.dtype, slices=slices).model_dump(mode="json")


def _saved(executor: ShardExecutor, path: str, items: list[SaveItem]) -> list[SavedShard]:
    saved = executor.save(path, items)
    if len(saved) != len(items):
        raise CheckpointError(f"{executor.label} saved {len(saved)} shards, {len(items)} were asked for")
    return saved


def _full_item(item: SaveItem) -> SaveItem:
    """``item`` asked for in full (a new base), its change record kept."""
    again = SaveItem(key=item["key"], name=item["name"], start=item["start"], stop=item["stop"], shape=item["shape"])
    again["since"] = None
    return again


def _full(saved: SavedShard) -> SliceEntry:
    """The slice of a shard saved in full (or a delta joined to its chain)."""
    if saved.value is None:
        raise CheckpointError(f"shard {saved.key!r} was saved as a delta, which this save did not ask for")
    return saved.value


class Checkpoint:
    """The objects a checkpoint holds, by name: ``Checkpoint(model=..., optimizer=..., step=StepCounter())``.

    Accepted objects: numpy arrays (restored in place), kubeps variables and sharded variables (any type with an
    adapter from :func:`register_saveable`), dynamic embedding tables (their live rows, :mod:`.dynamic`), objects
    with ``get_state()``/``set_state(state)`` (JSON state), and dicts, lists and objects with a ``variables``
    attribute holding any of these.
    """

    def __init__(self, **objects: Any):
        if not objects:
            raise CheckpointError("Checkpoint() needs at least one object, e.g. Checkpoint(model=model, step=step)")
        for key in objects:
            if "/" in key:
                raise CheckpointError(f"Checkpoint object name {key!r} must not contain '/'")
        self._objects = dict(objects)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_objects"][name]
        except KeyError:
            raise AttributeError(name) from None

    # -- flattening --------------------------------------------------------------------------------------------
    def _flatten(self) -> tuple[list[Saveable], dict[str, Any], ArrayAccess, list[TableSaveable]]:
        saveables: list[Saveable] = []
        tables: list[TableSaveable] = []
        stateful: dict[str, Any] = {}
        local = ArrayAccess()
        local_exec = LocalExecutor(local)
        seen: dict[int, str] = {}

        def visit(path: str, obj: Any) -> None:
            if id(obj) in seen and not isinstance(obj, (int, str)):
                return  # the same object reachable twice (an optimizer's and a model's reference)
            seen[id(obj)] = path
            if isinstance(obj, DynamicEmbedding):
                tables.append(TableSaveable(path, obj))
                return
            for cls in type(obj).__mro__:
                adapter = SAVEABLE_ADAPTERS.get(cls)
                if adapter is not None:
                    saveables.extend(adapter(obj, path))
                    return
            if isinstance(obj, np.ndarray):
                dtype = np.dtype(dtype_name(obj.dtype, f"checkpoint object {path!r}"))
                local.arrays[path] = obj
                rows = tensor_rows(obj.shape)
                shards = [ShardRef(0, rows, path, local_exec)] if rows else []
                saveables.append(Saveable(path, tuple(obj.shape), dtype, shards))
            elif _is_stateful(obj):
                stateful[path] = obj
            elif isinstance(obj, Mapping):
                for k, v in obj.items():
                    visit(f"{path}/{k}", v)
            elif isinstance(obj, (list, tuple)):
                # variables in a list are named by their own names (stable when the list order changes)
                labels = [getattr(v, "name", None) for v in obj]
                if not (all(isinstance(n, str) and n for n in labels) and len(set(labels)) == len(labels)):
                    labels = [str(i) for i in range(len(obj))]
                for label, v in zip(labels, obj):
                    visit(f"{path}/{label}", v)
            elif hasattr(obj, "variables") and not callable(obj.variables):
                visit(path, obj.variables)
            else:
                raise CheckpointError(
                    f"checkpoint object {path!r} of type {type(obj).__name__} cannot be checkpointed: give numpy "
                    "arrays, kubeps variables, objects with get_state()/set_state(), or dicts/lists of them"
                )

        for key, obj in self._objects.items():
            visit(key, obj)
        names = [s.name for s in saveables] + [t.name for t in tables]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise CheckpointError(f"two checkpoint variables share the name(s) {sorted(dup)}")
        return saveables, stateful, local, tables

    def _step_value(self) -> int | None:
        for key in ("step", "global_step", "iterations"):
            obj = self._objects.get(key)
            if obj is None:
                continue
            try:
                return int(obj.numpy() if hasattr(obj, "numpy") else obj)
            except (TypeError, ValueError):
                continue
        return None

    def check_root(self, directory: str, field: str) -> None:
        """When this checkpoint holds state on parameter servers (their variables' shards, dynamic tables), refuse
        a ``directory`` they would refuse (:func:`check_checkpoint_root`), before anything is written or read."""
        saveables, _, _, tables = self._flatten()
        _check_root_for(saveables, tables, directory, field)

    # -- save ------------------------------------------------------------------------------------------------
    def capture(self, step: int | None = None) -> tuple[int | None, dict[str, Any]]:
        """The step (``step``, or the checkpoint's ``step`` object's value) and the JSON states of its objects with
        ``get_state``, now: what :meth:`write` saves with them when given as ``taken`` (an asynchronous save)."""
        _, stateful, _, _ = self._flatten()
        objects = {}
        for key, obj in stateful.items():
            state = obj.get_state()
            try:
                json.dumps(state)
            except (TypeError, ValueError) as err:
                raise CheckpointError(f"checkpoint object {key!r}: get_state() is not JSON-serialisable ({err})") from None
            objects[key] = state
        return (self._step_value() if step is None else step), objects

    def write(self, path: str, *, checkpoint_number: int = 0, step: int | None = None, final: bool = False,
              incremental: IncrementalSave | None = None, taken: tuple[int | None, dict[str, Any]] | None = None
              ) -> str:
        """Write a complete checkpoint to the directory ``path`` (a ``ckpt-N`` directory); returns ``path``.
        With ``incremental`` (a :class:`~kubeps.runtime.checkpoint.manager.CheckpointManager` made with
        ``incremental=True`` passes it), the shards of parameter servers write only their rows changed since the
        parent checkpoint where its policy allows (:mod:`kubeps.runtime.checkpoint.incremental`). ``taken``: the
        step and object states :meth:`capture` took (an asynchronous save takes them when it is asked)."""
        started = time.perf_counter()
        path = normalize_path(path)
        storage = storage_for(path)
        saveables, _, _, tables = self._flatten()
        _check_root_for(saveables, tables, path, "Checkpoint.write path")
        if storage.exists(storage.join(path, MANIFEST_NAME)):
            raise CheckpointError(f"checkpoint {path} already exists; refusing to overwrite a committed checkpoint")
        storage.remove_tree(path)  # the remains of an interrupted save of the same number
        storage.makedirs(path)
        groups: dict[Any, tuple[ShardExecutor, list[tuple[SaveItem, Saveable]]]] = {}
        for sv in saveables:
            for shard in sv.shards:
                item = SaveItem(key=shard.key, name=sv.name, start=shard.start, stop=shard.stop, shape=list(sv.shape))
                if incremental is not None:
                    item["since"] = incremental.since(sv.name, shard.start, shard.stop)
                groups.setdefault(group_key(shard.executor), (shard.executor, []))[1].append((item, sv))
        results: dict[tuple[str, int], SavedShard] = {}

        def run(group):
            executor, pairs = group
            items = [item for item, _ in pairs]
            saved = _saved(executor, path, items)
            if incremental is not None:  # deltas joined to their chains; one that does not fit is saved again in full
                joined = [incremental.resolve(sv.name, s, item["start"], item["stop"]) for (item, sv), s in
                          zip(pairs, saved)]
                again = [i for i, s in enumerate(joined) if s is None]
                redone = _saved(executor, path, [_full_item(items[i]) for i in again]) if again else []
                saved = [s if s is not None else redone[again.index(i)] for i, s in enumerate(joined)]
            return [((sv.name, item["start"]), s) for (item, sv), s in zip(pairs, saved)]

        if groups:
            with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="ckpt-shards") as pool:
                for pairs in pool.map(run, list(groups.values())):
                    results.update(pairs)
        variables: dict[str, VariableEntry] = {}
        for sv in saveables:
            parts = sorted((results[(sv.name, sh.start)] for sh in sv.shards), key=lambda s: _full(s).start)
            slot_keys = {(ok, sn) for p in parts for ok, g in p.slots.items() for sn in g}
            slots: dict[str, dict[str, TensorEntry]] = {}
            for okey, sname in sorted(slot_keys):
                found = [p.slots.get(okey, {}).get(sname) for p in parts]
                have = [h for h in found if h is not None]
                if len(have) < len(found):
                    # some shards never received an update with this optimizer: their slots do not exist yet
                    log.warning("variable %r: slot %r exists on only some shards; not saved", sv.name, sname)
                    continue
                tail, dt = have[0][2], have[0][1]
                slots.setdefault(okey, {})[sname] = TensorEntry(
                    shape=[tensor_rows(sv.shape)] + list(tail) if sv.shape else [], dtype=dt,
                    slices=[h[0] for h in have],
                )
            dtype = parts[0].dtype if parts else np.dtype(sv.dtype).name
            variables[sv.name] = VariableEntry(
                shape=list(sv.shape), dtype=dtype, slices=[_full(p) for p in parts], slots=slots
            )
        dynamic = save_tables(tables, path) if tables else {}
        step, objects = taken if taken is not None else self.capture(step)
        manifest = Manifest(format_version=manifest_version(variables, bool(dynamic)),
                            checkpoint_number=checkpoint_number, step=step, final=final, created=time.time(),
                            variables=variables, dynamic=dynamic, objects=objects)
        commit_manifest(path, manifest)
        if _metrics.ENABLED:
            _observe_checkpoint("save", started, manifest)
            if step is not None:
                _metrics.CHECKPOINT_STEP.set(step)
        return path

    # -- restore ---------------------------------------------------------------------------------------------
    def restore(self, path: str) -> int | None:
        """Restore every object from the checkpoint at ``path``; returns the checkpoint's training step."""
        started = time.perf_counter()
        path = normalize_path(path)
        saveables, stateful, _, tables = self._flatten()
        _check_root_for(saveables, tables, path, "Checkpoint.restore path")
        manifest = read_manifest(path)
        entries = {t.name: check_table(t, manifest.dynamic.get(t.name), path, manifest.dynamic) for t in tables}
        groups: dict[Any, tuple[ShardExecutor, list[RestoreItem]]] = {}
        for sv in saveables:
            entry = manifest.variables.get(sv.name)
            if entry is None:
                also = f" (and dynamic tables {short_listing(manifest.dynamic)})" if manifest.dynamic else ""
                raise CheckpointMismatchError(
                    f"variable {sv.name!r} is not in checkpoint {path}; it holds {short_listing(manifest.variables)}"
                    + also
                )
            dtype = np.dtype(sv.dtype).name
            if list(sv.shape) != entry.shape or dtype != entry.dtype:
                raise CheckpointMismatchError(
                    f"variable {sv.name!r}: expected shape {list(sv.shape)} dtype {dtype}, checkpoint {path} has "
                    f"shape {entry.shape} dtype {entry.dtype}"
                )
            for okey, group in entry.slots.items():
                for sname, t in group.items():
                    if t.shape != entry.shape:
                        raise CheckpointMismatchError(
                            f"variable {sv.name!r}: {okey} slot {sname!r} in checkpoint {path} has shape {t.shape}; "
                            f"expected the variable's shape {entry.shape} (slots are shaped like their variable)"
                        )
            for shard in sv.shards:
                a, b = shard.start, shard.stop
                item = RestoreItem(key=shard.key, name=sv.name, start=a, stop=b, value=_rows(entry, a, b),
                                   slots={okey: {sname: _rows(t, a, b) for sname, t in group.items()}
                                          for okey, group in entry.slots.items()})
                groups.setdefault(group_key(shard.executor), (shard.executor, []))[1].append(item)
        for key in stateful:
            if key not in manifest.objects:
                raise CheckpointMismatchError(
                    f"object {key!r} is not in checkpoint {path}; it holds objects {short_listing(manifest.objects)}"
                )
        for table in tables:  # a corrupt table is refused before any variable or table changes
            verify_table(path, table.name, entries[table.name])
        if groups:
            with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="ckpt-shards") as pool:
                list(pool.map(lambda g: g[0].restore(path, g[1]), list(groups.values())))
        if tables:
            restore_tables(tables, entries, path, verify=False)
        for key, obj in stateful.items():
            obj.set_state(manifest.objects[key])
        if _metrics.ENABLED:
            _observe_checkpoint("restore", started, manifest)
        return manifest.step
