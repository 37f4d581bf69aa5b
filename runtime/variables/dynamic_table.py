"""``DynamicTable``: the rows of one dynamic embedding table held in one place (one parameter server, or this
process for a table made outside ``strategy.scope()``), with admission, eviction and optimizer slots.

Storage: live rows are packed in ``values[:size]`` (and the same rows of every slot array and of the metadata
``keys``, ``freqs``, ``steps``); a :class:`~kubeps.runtime.util.key_index.RowIndex` maps a key to its row (it holds
only rows: a probe reads the key from ``keys``). Counts are int32 (saturating at :data:`FREQ_MAX`). The arrays
grow by half when full (never past ``capacity`` when one is set); an evicted row's place is filled by the last rows,
so live rows stay packed and a checkpoint or an export is a slice.

* **Creation and admission.** A training lookup counts each key it sees (``freqs``). A key with a row reads it; an
  unknown key is admitted (gets a row, its values from the initializer, its slots at the optimizer's initial values)
  once it was seen ``filter_freq`` times; until then it reads ``default_value`` and takes no gradient. Counts of keys
  not yet admitted are kept exactly (DeepRec's ``CounterFilter``) in an index of at most ``max_pending`` keys
  (cleared when full), or approximately in a counting Bloom filter of fixed size (``bloom_counters``: DeepRec's
  ``CBFFilter``, memory independent of the stream).
* **Updates.** A push applies the optimizer's sparse update (``apply_sparse``: duplicates summed, touched rows only)
  to the rows of the pushed keys that have rows; other keys' gradients are dropped. The table counts its updates
  (``updates``, the ``step`` its optimizer sees, as a variable's) and stamps the updated rows (``steps``).
* **Eviction.** ``steps_to_live``: a sweep every ``sweep_every`` updates removes rows not updated in the last
  ``steps_to_live`` updates. ``capacity``: before admitted keys would pass it, the least recently updated (``lru``)
  or least often seen (``lfu``) rows go, never a row the same lookup reads.

Not thread-safe: its owner (a ps's table registry, or the local variable) holds :attr:`lock`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, cast

import numpy as np

from kubeps.runtime.rpc.protocol import EvictPolicy, InitializerSpec, TableConfigSpec, TableDtype
from kubeps.runtime.rpc.validation import RequestError, RequestShape
from kubeps.runtime.util.key_index import KeyIndex, RowIndex
from kubeps.runtime.util.keyhash import key_normal, key_uniform, mix64

__all__ = ["DynamicTable", "TableConfig"]

_INITIALIZERS = ("zeros", "constant", "uniform", "normal")
_DEFAULT_INITIALIZER = {"kind": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 0}
#: the shape of a config's JSON form
_SPEC = RequestShape(TableConfigSpec)
#: a row's count saturates here (counts are int32: 4 bytes a row, and LFU only compares them)
FREQ_MAX = int(np.iinfo(np.int32).max)


#: the most hash functions a table's Bloom filter may use (DeepRec uses 3 or 4)
MAX_BLOOM_HASHES = 16


@dataclass(frozen=True)
class TableConfig:
    """What a dynamic table is; crosses the wire as :meth:`as_dict` (``CreateDynamic``), declared there as
    :class:`~kubeps.runtime.rpc.protocol.TableConfigSpec`."""

    dim: int
    dtype: TableDtype = "float32"
    #: ``{"kind": "zeros" | "constant" (value) | "uniform" (minval, maxval, seed) | "normal" (mean, stddev, seed)}``
    initializer: dict[str, Any] = field(default_factory=lambda: dict(_DEFAULT_INITIALIZER))
    default_value: float = 0.0
    filter_freq: int = 1
    max_pending: int = 1 << 20
    bloom_counters: int = 0
    bloom_hashes: int = 3
    steps_to_live: int = 0
    capacity: int = 0
    evict_policy: EvictPolicy = "lru"
    sweep_every: int = 100

    def __post_init__(self) -> None:
        object.__setattr__(self, "initializer", _check_initializer(self.initializer, "initializer"))

    def as_dict(self) -> TableConfigSpec:
        # the initializer was checked (_check_initializer) when the config was made: it is an InitializerSpec
        return {"dim": self.dim, "dtype": self.dtype, "initializer": cast(InitializerSpec, dict(self.initializer)),
                "default_value": self.default_value, "filter_freq": self.filter_freq, "max_pending": self.max_pending,
                "bloom_counters": self.bloom_counters, "bloom_hashes": self.bloom_hashes,
                "steps_to_live": self.steps_to_live, "capacity": self.capacity, "evict_policy": self.evict_policy,
                "sweep_every": self.sweep_every}

    @classmethod
    def from_dict(cls, raw: Any, what: str = "config") -> "TableConfig":
        """A config from its JSON form (a user's settings, a pickled handle's): its shape checked against the
        protocol's :class:`~kubeps.runtime.rpc.protocol.TableConfigSpec` (numpy scalars taken as numbers), then
        :meth:`from_spec`; each refusal names the field, the value and what is allowed."""
        try:
            spec: TableConfigSpec = _SPEC.validate(_plain(raw))
        except RequestError as err:
            raise ValueError(f"{what}: {err}") from None
        return cls.from_spec(spec, what)

    @classmethod
    def from_spec(cls, spec: TableConfigSpec, what: str = "config") -> "TableConfig":
        """A config from its declared shape (validated: by the server, for a ``CreateDynamic`` request, or by
        :meth:`from_dict`): the ranges checked, each refusal naming the field, the value and what is allowed."""
        args: dict[str, Any] = dict(spec)
        for name, lo in (("dim", 1), ("filter_freq", 1), ("max_pending", 1), ("bloom_counters", 0),
                         ("bloom_hashes", 1), ("steps_to_live", 0), ("capacity", 0), ("sweep_every", 1)):
            value = args.get(name, lo)
            if value < lo:
                raise ValueError(f"{what}.{name}={value!r} is not allowed; allowed: an integer >= {lo}")
        if args.get("bloom_hashes", 1) > MAX_BLOOM_HASHES:  # each one is a pass over a lookup's keys
            raise ValueError(f"{what}.bloom_hashes={args['bloom_hashes']!r} is not allowed; allowed: an integer in "
                             f"[1, {MAX_BLOOM_HASHES}]")
        default = args.get("default_value", 0.0)
        if not math.isfinite(default):
            raise ValueError(f"{what}.default_value={default!r} is not allowed; allowed: a finite number")
        args["initializer"] = _check_initializer(args.get("initializer", dict(_DEFAULT_INITIALIZER)),
                                                 f"{what}.initializer")
        return cls(**args)


def _plain(raw: Any) -> Any:
    """``raw`` with numpy scalars (a user's ``np.int64(8)``) as the Python numbers they hold."""
    if isinstance(raw, np.generic):
        return raw.item()
    if isinstance(raw, Mapping):
        return {k: _plain(v) for k, v in raw.items()}
    return raw


def _check_initializer(raw: Any, what: str) -> dict[str, Any]:
    if not isinstance(raw, Mapping) or raw.get("kind") not in _INITIALIZERS:
        raise ValueError(f"{what}={raw!r} is not allowed; allowed: {{'kind': one of {list(_INITIALIZERS)}, ...}}")
    fields = {"zeros": {}, "constant": {"value": 0.0}, "uniform": {"minval": -0.05, "maxval": 0.05, "seed": 0},
              "normal": {"mean": 0.0, "stddev": 0.05, "seed": 0}}[raw["kind"]]
    unknown = sorted(set(raw) - set(fields) - {"kind"})
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {unknown} for kind {raw['kind']!r}; allowed: {sorted(fields)}")
    out: dict[str, Any] = {"kind": raw["kind"]}
    for name, default in fields.items():
        value = raw.get(name, default)
        if name == "seed":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
                raise ValueError(f"{what}.seed={value!r} is not allowed; allowed: an integer in [0, 2**63)")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{what}.{name}={value!r} is not allowed; allowed: a finite number")
        out[name] = value
    if out["kind"] == "uniform" and not out["minval"] <= out["maxval"]:
        raise ValueError(f"{what}: minval={out['minval']!r} > maxval={out['maxval']!r}; allowed: minval <= maxval")
    if out["kind"] == "normal" and out["stddev"] < 0:
        raise ValueError(f"{what}.stddev={out['stddev']!r} is not allowed; allowed: a number >= 0")
    return out


class DynamicTable:
    """One table's rows in one place (see the module docstring)."""

    def __init__(self, name: str, config: TableConfig):
        self.name = name
        self.config = config
        self.dtype = np.dtype(config.dtype)
        self.lock = threading.Lock()
        self.size = 0
        self.updates = 0
        self.evicted = 0
        #: keys looked up, of them found with a row, keys admitted (the metrics' hit rate and admissions)
        self.lookups = 0
        self.hits = 0
        self.admitted = 0
        self._cap = 0
        self.keys = np.zeros(0, dtype=np.int64)
        self.index = RowIndex(self.keys)  # key -> row, the keys read from ``keys``
        self.values = np.zeros((0, config.dim), dtype=self.dtype)
        self.freqs = np.zeros(0, dtype=np.int32)
        self.steps = np.zeros(0, dtype=np.int64)
        #: optimizer key -> slot name -> array shaped like ``values``; and the slots' initial row values
        self.slots: dict[str, dict[str, np.ndarray]] = {}
        self._slot_init: dict[str, dict[str, np.ndarray]] = {}
        self._pending = KeyIndex()  # keys seen but not admitted -> position in _pending_counts
        self._pending_counts = np.zeros(0, dtype=np.int64)
        self._bloom = np.zeros(config.bloom_counters, dtype=np.uint16)
        self._default = np.full(config.dim, config.default_value, dtype=self.dtype)

    # -- sizes -----------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held: rows, slots, metadata, the index and the admission filter."""
        arrays = [self.keys, self.values, self.freqs, self.steps, self._pending_counts, self._bloom]
        arrays += [a for group in self.slots.values() for a in group.values()]
        return sum(int(a.nbytes) for a in arrays) + self.index.nbytes + self._pending.nbytes

    def _grow(self, needed: int) -> None:
        if needed <= self._cap:
            return
        cap = max(needed, self._cap + self._cap // 2, 64)
        if self.config.capacity:
            cap = min(cap, self.config.capacity)
        n = self.size

        def grown(a: np.ndarray) -> np.ndarray:
            out = np.zeros((cap,) + a.shape[1:], dtype=a.dtype)
            out[:n] = a[:n]
            return out

        self.keys, self.values, self.freqs, self.steps = (grown(a) for a in (self.keys, self.values, self.freqs,
                                                                             self.steps))
        self.slots = {okey: {s: grown(a) for s, a in group.items()} for okey, group in self.slots.items()}
        self.index.store = self.keys
        self._cap = cap

    # -- initial rows ----------------------------------------------------------------------------------------
    def initial_rows(self, keys: np.ndarray) -> np.ndarray:
        init = self.config.initializer
        dim = self.config.dim
        if init["kind"] == "zeros":
            rows = np.zeros((keys.size, dim))
        elif init["kind"] == "constant":
            rows = np.full((keys.size, dim), init["value"])
        elif init["kind"] == "uniform":
            rows = key_uniform(keys, dim, init["seed"], init["minval"], init["maxval"])
        else:
            rows = key_normal(keys, dim, init["seed"], init["mean"], init["stddev"])
        return rows.astype(self.dtype)

    # -- lookups ---------------------------------------------------------------------------------------------
    def lookup(self, keys: np.ndarray, counts: np.ndarray | None, train: bool) -> np.ndarray:
        """Rows of ``keys`` (distinct int64). A training lookup (``train``) counts each key ``counts`` times and
        admits the keys that reach ``filter_freq``; any other lookup changes nothing. Keys without a row read
        ``default_value``."""
        rows = self.index.lookup(keys)
        self.lookups += keys.size
        self.hits += int(np.count_nonzero(rows >= 0))
        if train:
            counts = np.ones(keys.size, dtype=np.int64) if counts is None else counts
            hit = rows >= 0
            seen = rows[hit]
            self.freqs[seen] = np.minimum(self.freqs[seen] + counts[hit], FREQ_MAX)
            miss = np.flatnonzero(~hit)
            if miss.size:
                chosen, totals = self._admit(keys[miss], counts[miss])
                admitted = miss[chosen]
                if admitted.size:
                    rows[admitted] = self._create(keys[admitted], totals, protect=rows[hit])
                    self.admitted += int(np.count_nonzero(rows[admitted] >= 0))
        out = np.empty((keys.size, self.config.dim), dtype=self.dtype)
        found = rows >= 0
        out[found] = self.values[rows[found]]
        out[~found] = self._default
        return out

    def _admit(self, keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions of ``keys`` (unknown to the table) admitted after counting this sighting, and their counts."""
        need = self.config.filter_freq
        if need <= 1:
            return np.arange(keys.size), counts
        if self._bloom.size:
            estimate = self._bloom_add(keys, counts)
            chosen = np.flatnonzero(estimate >= need)
            return chosen, estimate[chosen]
        pos = self._pending.lookup(keys)
        new = np.flatnonzero(pos < 0)
        if new.size:
            if self._pending_counts.size + new.size > self.config.max_pending:
                self._pending.clear()  # bounded: counts of keys not seen again for a while start over
                self._pending_counts = np.zeros(0, dtype=np.int64)
                pos = np.full(keys.size, -1, dtype=np.int64)
                new = np.arange(keys.size)
            start = self._pending_counts.size
            self._pending_counts = np.concatenate([self._pending_counts, np.zeros(new.size, dtype=np.int64)])
            pos[new] = np.arange(start, start + new.size)
            self._pending.insert(keys[new], pos[new])
        self._pending_counts[pos] += counts
        totals = self._pending_counts[pos]
        admitted = np.flatnonzero(totals >= need)
        if admitted.size:
            self._pending.remove(keys[admitted])
        if self._pending.live == 0:
            self._pending_counts = np.zeros(0, dtype=np.int64)
        return admitted, totals[admitted]

    def _bloom_add(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Add ``counts`` to each key's counters in the counting Bloom filter; returns each key's estimate (the
        least of its counters: never below the true count)."""
        m = np.uint64(self._bloom.size)
        top = np.iinfo(self._bloom.dtype).max
        where = np.stack([(mix64(keys, 0x0B100 + h) % m).astype(np.int64) for h in range(self.config.bloom_hashes)])
        for h in range(where.shape[0]):  # one pass per hash function: duplicates across keys add up
            total = self._bloom.astype(np.int64)
            np.add.at(total, where[h], counts)
            self._bloom[...] = np.minimum(total, top)
        return self._bloom[where].min(axis=0).astype(np.int64)

    def _create(self, keys: np.ndarray, counts: np.ndarray, protect: np.ndarray) -> np.ndarray:
        """Rows for admitted keys (within ``capacity``: older rows evicted first, never those in ``protect``);
        returns each key's row, -1 for keys no room was found for."""
        out = np.full(keys.size, -1, dtype=np.int64)
        cap = self.config.capacity
        if cap:
            over = self.size + keys.size - cap
            if over > 0:
                self._evict_for_room(over, protect)
            room = cap - self.size
            if room < keys.size:
                keys, counts, out_pos = keys[:room], counts[:room], np.arange(room)
            else:
                out_pos = np.arange(keys.size)
        else:
            out_pos = np.arange(keys.size)
        if not keys.size:
            return out
        self._grow(self.size + keys.size)
        rows = np.arange(self.size, self.size + keys.size)
        self.keys[rows] = keys
        self.values[rows] = self.initial_rows(keys)
        self.freqs[rows] = np.minimum(counts, FREQ_MAX)
        self.steps[rows] = self.updates
        for okey, group in self.slots.items():
            for sname, arr in group.items():
                arr[rows] = self._slot_init[okey][sname]
        self.index.insert(keys, rows)
        self.size += keys.size
        out[out_pos] = rows
        return out

    # -- eviction --------------------------------------------------------------------------------------------
    def _evict_for_room(self, count: int, protect: np.ndarray) -> None:
        score = (self.steps if self.config.evict_policy == "lru" else self.freqs)[: self.size].astype(np.float64)
        score[protect] = np.inf
        count = min(count, int(np.count_nonzero(np.isfinite(score))))
        if count > 0:
            self.evict_rows(np.argpartition(score, count - 1)[:count])

    def sweep(self) -> int:
        """Remove rows not updated in the last ``steps_to_live`` updates; returns how many went."""
        ttl = self.config.steps_to_live
        if not ttl or not self.size:
            return 0
        stale = np.flatnonzero(self.updates - self.steps[: self.size] > ttl)
        self.evict_rows(stale)
        return int(stale.size)

    def evict_rows(self, rows: np.ndarray) -> None:
        """Remove rows (distinct): their keys leave the index and the last rows move into their places."""
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        if not rows.size:
            return
        self.index.remove(self.keys[rows])
        n = self.size - rows.size
        holes = rows[rows < n]  # places to fill, below the new end
        tail = np.setdiff1d(np.arange(n, self.size), rows, assume_unique=True)  # live rows past the new end
        if holes.size:
            for arr in [self.keys, self.values, self.freqs, self.steps] + [
                    a for group in self.slots.values() for a in group.values()]:
                arr[holes] = arr[tail]
            self.index.update(self.keys[holes], holes)
        self.size = n
        self.evicted += int(rows.size)

    def remove(self, keys: np.ndarray) -> int:
        rows = self.index.lookup(keys)
        rows = rows[rows >= 0]
        self.evict_rows(rows)
        return int(rows.size)

    # -- updates ---------------------------------------------------------------------------------------------
    def check_push(self, optimizer: Any, keys: np.ndarray, grads: Any, allow_nonfinite: bool = False) -> np.ndarray:
        """``grads`` checked (one row of ``dim`` per key, a float dtype, finite) and cast to the table's dtype;
        changes nothing."""
        g = np.asarray(grads)
        if g.shape != (keys.size, self.config.dim):
            raise ValueError(f"gradient for dynamic table {self.name!r} has shape {list(g.shape)}; expected "
                             f"{[keys.size, self.config.dim]} (one row of dim {self.config.dim} per key)")
        if g.dtype.kind != "f":
            raise ValueError(f"gradient for dynamic table {self.name!r} has dtype {g.dtype}; allowed: a float dtype")
        if not allow_nonfinite and g.size and not np.isfinite(g).all():
            raise ValueError(f"gradient for dynamic table {self.name!r} holds NaN or infinite values; allowed: "
                             "finite values")
        lr_at = getattr(optimizer, "lr_at", None)
        if lr_at is not None:
            lr = float(lr_at(self.updates + 1))
            if not math.isfinite(lr) or lr < 0:
                raise ValueError(f"optimizer: the learning rate of update {self.updates + 1} of dynamic table "
                                 f"{self.name!r} is {lr}; allowed: a finite number >= 0")
        return g.astype(self.dtype, copy=False)

    def apply_push(self, optimizer: Any, okey: str, keys: np.ndarray, grads: np.ndarray) -> int:
        """Apply checked gradients (:meth:`check_push`) to the rows of ``keys`` that have rows; returns the
        table's update count."""
        if okey not in self.slots:
            self._slot_init[okey] = {s: np.asarray(a)[0].copy() for s, a in
                                     optimizer.init_slots(np.zeros((1, self.config.dim), self.dtype)).items()}
            self.slots[okey] = {s: np.empty_like(self.values) for s in self._slot_init[okey]}
            for s, arr in self.slots[okey].items():
                arr[:] = self._slot_init[okey][s]
        self.updates += 1
        rows = self.index.lookup(keys)
        found = rows >= 0
        if found.any():
            n = self.size
            view = {s: a[:n] for s, a in self.slots[okey].items()}
            optimizer.apply_sparse(self.values[:n], rows[found], grads[found], view, self.updates)
            self.steps[rows[found]] = self.updates
        if self.config.steps_to_live and self.updates % self.config.sweep_every == 0:
            self.sweep()
        return self.updates

    # -- whole-table views -----------------------------------------------------------------------------------
    def export(self) -> tuple[np.ndarray, np.ndarray, dict[str, dict[str, np.ndarray]], np.ndarray, np.ndarray]:
        """Copies of the live rows: ``(keys, values, {optimizer key: {slot: rows}}, freqs, steps)``."""
        n = self.size
        slots = {okey: {s: a[:n].copy() for s, a in group.items()} for okey, group in self.slots.items()}
        return self.keys[:n].copy(), self.values[:n].copy(), slots, self.freqs[:n].copy(), self.steps[:n].copy()

    def clear(self) -> None:
        """Drop every row, count and slot (a restore starts here)."""
        fresh = DynamicTable(self.name, self.config)
        lock = self.lock
        self.__dict__.update(fresh.__dict__)
        self.lock = lock

    def load(self, keys: np.ndarray, values: np.ndarray, slots: dict[str, dict[str, np.ndarray]],
             freqs: np.ndarray, steps: np.ndarray, updates: int, slot_init: dict[str, dict[str, np.ndarray]]) -> None:
        """Add checkpointed rows (keys unknown to the table) with their slots and metadata."""
        if updates > self.updates:
            self.updates = int(updates)
        room = self.config.capacity - self.size if self.config.capacity else keys.size
        if keys.size > room:  # restored into less room than it was saved from: the most recently updated stay
            keep = np.sort(np.argsort(-steps, kind="stable")[:max(room, 0)])
            keys, values, freqs, steps = keys[keep], values[keep], freqs[keep], steps[keep]
            slots = {okey: {s: a[keep] for s, a in group.items()} for okey, group in slots.items()}
        if not keys.size:
            return
        for okey, init in slot_init.items():
            if okey not in self.slots:
                self._slot_init[okey] = {s: np.asarray(v, dtype=self.dtype) for s, v in init.items()}
                self.slots[okey] = {s: np.empty_like(self.values) for s in init}
                for s, arr in self.slots[okey].items():
                    arr[:] = self._slot_init[okey][s]
        self._grow(self.size + keys.size)
        rows = np.arange(self.size, self.size + keys.size)
        self.keys[rows] = keys
        self.values[rows] = values
        self.freqs[rows] = np.minimum(freqs, FREQ_MAX)
        self.steps[rows] = steps
        for okey, group in self.slots.items():
            for s, arr in group.items():
                saved = slots.get(okey, {}).get(s)
                arr[rows] = self._slot_init[okey][s] if saved is None else saved
        self.index.insert(keys, rows)
        self.size += keys.size

    def slot_init(self) -> dict[str, dict[str, np.ndarray]]:
        return {okey: {s: v.copy() for s, v in group.items()} for okey, group in self._slot_init.items()}

    # -- checkpoints -----------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """A copy of what a checkpoint holds of this table: the live rows (``keys``, ``values``, ``freqs``,
        ``steps``), ``slots`` and their initial rows (``slot_init``), the ``updates`` and ``evicted`` counts, and the
        admission state: ``pending_keys``/``pending_counts`` (exact counting) or ``bloom`` (counting Bloom filter),
        ``None`` where the table does not count that way."""
        keys, values, slots, freqs, steps = self.export()
        exact = self.config.filter_freq > 1 and not self._bloom.size
        pending_keys, pos = self._pending.items() if exact else (None, None)
        return {"keys": keys, "values": values, "slots": slots, "freqs": freqs, "steps": steps,
                "slot_init": self.slot_init(), "updates": self.updates, "evicted": self.evicted,
                "pending_keys": pending_keys,
                "pending_counts": None if pos is None else self._pending_counts[pos].astype(np.int64),
                "bloom": self._bloom.copy() if self._bloom.size else None}

    def restore_checkpoint(self, keys: np.ndarray, values: np.ndarray, slots: dict[str, dict[str, np.ndarray]],
                           freqs: np.ndarray, steps: np.ndarray, updates: int, evicted: int,
                           slot_init: dict[str, dict[str, np.ndarray]], pending_keys: np.ndarray | None,
                           pending_counts: np.ndarray | None, bloom: np.ndarray | None) -> None:
        """Replace everything with checkpointed state (keys distinct, arrays checked by the caller). Settings of
        this table win: rows past ``capacity`` go (the least recently updated first), pending counts past
        ``max_pending`` go (the lowest first), and a Bloom filter of another size than ``bloom_counters`` is not
        taken (counting starts again)."""
        self.clear()
        self.load(keys, values, slots, freqs, steps, updates, slot_init)
        self.updates = int(updates)
        self.evicted = int(evicted)
        if pending_keys is not None and pending_counts is not None and pending_keys.size \
                and self.config.filter_freq > 1 and not self._bloom.size:
            keep = np.argsort(-pending_counts, kind="stable")[: self.config.max_pending]
            self._pending_counts = pending_counts[keep].astype(np.int64)
            self._pending.insert(pending_keys[keep], np.arange(keep.size))
        if bloom is not None and bloom.shape == self._bloom.shape:
            self._bloom[...] = bloom
