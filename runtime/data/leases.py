"""Exactly-once input: a worker's pipeline reads the record ranges the chief leased to it, and says how far it got.

With ``create_per_worker_dataset(dataset_fn, exactly_once=True)`` the chief splits each epoch of the dataset's
source into shards (row ranges of ``from_tensor_slices``, files of ``from_files``) and leases them to the workers
with the functions it sends them (:mod:`kubeps.runtime.coordinator.leases`). On the worker, the source of the
pipeline ``dataset_fn`` builds is replaced by a node that reads the leased shards one after the other from a
:class:`ShardFeed`, and every function's answer carries the position the consumer reached in each shard
(:meth:`ShardFeed.positions`): what the chief commits as trained.

A position is a count of records from the shard's start, so the pipeline above the source must hand records to the
consumer in the order it read them, one row per record: ``map``, ``batch``, ``prefetch`` and ``repeat`` (the
number of epochs) are allowed; anything that drops, reorders or re-reads records is refused when the dataset is
created (:func:`plan`), naming the transformation.
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, NamedTuple

from kubeps.runtime.data.node import Node
from kubeps.runtime.data.prefetch import PrefetchNode
from kubeps.runtime.data.sources import FileListNode, TensorSlicesNode
from kubeps.runtime.data.structure import slice_leaves
from kubeps.runtime.data.transforms import BatchNode, InterleaveNode, MapNode, RepeatNode
from kubeps.runtime.errors import RuntimeConfigError

__all__ = ["InputPlan", "LeasedFilesNode", "LeasedSlicesNode", "NeedsInput", "ShardFeed", "feed_of", "leased", "plan"]

#: transformations that keep the records in the order the source read them, one row each
_ORDERED = (MapNode, BatchNode, PrefetchNode, RepeatNode)


class NeedsInput(Exception):
    """A function needed more records than the shards leased to its worker hold (the chief commits what its steps
    took, leases more and runs it again from there)."""


class InputPlan(NamedTuple):
    """What the chief needs to split a dataset's epochs into shards."""

    sizes: list[int | None]  #: records of each unit: one for the rows of an array source, one per file (None: unknown)
    epochs: int | None  #: the pipeline's ``repeat`` count (None: forever; 1 without ``repeat``)


def plan(dataset: Any) -> InputPlan:
    """The units and epochs of ``dataset`` (a kubeps ``Dataset``), or a ``RuntimeConfigError`` naming what the
    exactly-once input cannot read in order."""
    node = getattr(dataset, "_node", None)
    if not isinstance(node, Node):
        raise RuntimeConfigError("dataset_fn", type(dataset).__name__,
                                 "must return a kubeps Dataset (from_tensor_slices or from_files) for exactly_once")
    chain = node.chain()
    source, above = _source(chain)
    epochs: int | None = 1
    for step in above:
        if not isinstance(step, _ORDERED):
            raise RuntimeConfigError(
                "dataset_fn", step.describe(),
                "exactly_once reads records in order: only map, batch, prefetch and repeat may follow the source "
                "(shuffle the order of the shards instead of the records)")
        if isinstance(step, RepeatNode):
            epochs = None if step._count is None or epochs is None else epochs * step._count
    if isinstance(source, FileListNode):
        return InputPlan([None] * len(source.files), epochs)
    assert isinstance(source, TensorSlicesNode)  # what _source accepts
    return InputPlan([source._rows], epochs)


def _source(chain: list[Node]) -> tuple[Node, list[Node]]:
    root = chain[0]
    if isinstance(root, TensorSlicesNode):
        return root, chain[1:]
    if isinstance(root, FileListNode) and root._shuffle:
        raise RuntimeConfigError("dataset_fn", root.describe(),
                                 "exactly_once hands out the files in sorted order: list them with shuffle=False")
    if isinstance(root, FileListNode) and len(chain) > 1 and isinstance(chain[1], InterleaveNode) \
            and chain[1]._cycle_length == 1:
        return root, chain[2:]
    raise RuntimeConfigError("dataset_fn", root.describe(),
                             "exactly_once reads from_tensor_slices or from_files (cycle_length=1) datasets")


@dataclass
class _Segment:
    """A leased shard as the worker reads it."""

    epoch: int
    index: int
    start: int
    end: int | None  #: None: a file's end, known when it is reached
    produced: int = 0  #: records the source read of it
    finished: bool = False  #: the source reached its end

    def ends_at(self, position: int) -> bool:
        """Whether ``position`` is the shard's end (as far as the source knows)."""
        return self.finished or (self.end is not None and position >= self.end)


class ShardFeed:
    """The shards leased to one worker's dataset, in the order its source reads them, and the records its consumer
    took (the rows of the elements handed to functions)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._leased: deque[_Segment] = deque()
        self._reading: deque[_Segment] = deque()  # opened by the source, not yet reported done
        self._consumed = 0  # records taken by the consumer and not yet assigned to a reported segment
        self._written = 0  # what ``_consumed`` was when the running function last wrote to a variable
        self._final = False
        self._in_function = False
        self._closed = False
        self._generation = 0  # the iterator reading it: an older one's source ends

    # -- the chief's side ---------------------------------------------------------------------------------------
    def grant(self, shards: Iterable[list[int]], final: bool) -> None:
        """Shards ``[epoch, index, start, end]`` (end -1: a file's end) leased with a function, before it runs."""
        with self._cond:
            for epoch, index, start, end in shards:
                self._leased.append(_Segment(epoch, index, start, None if end < 0 else end))
            self._final = final
            self._cond.notify_all()

    def in_function(self, running: bool) -> None:
        """A function runs (no more shards come until it ends) or ended."""
        with self._cond:
            self._in_function = running
            if running:
                self._written = self._consumed
            self._cond.notify_all()

    def wrote(self) -> None:
        """The running function wrote to a variable (a step pushed): the records its consumer took so far are
        trained, even if the function does not finish."""
        with self._cond:
            self._written = self._consumed

    def positions(self, finished: bool = True) -> list[list[int]]:
        """``[epoch, index, position, done]`` of every shard the consumer took records of (or reached the end of)
        and not yet reported done; a position counts records from the shard's start. A function that did not
        ``finished`` trained the records taken up to its last write to a variable: those taken after it are not
        counted (they go back with the shards, and its re-run reads them)."""
        with self._cond:
            if not finished:
                self._consumed = self._written
            left, out = self._consumed, []
            for segment in self._reading:
                take = min(left, segment.produced)
                left -= take
                done = take == segment.produced and segment.ends_at(segment.start + take)
                if take or done:
                    out.append([segment.epoch, segment.index, segment.start + take, int(done)])
            while self._reading and self._consumed >= self._reading[0].produced \
                    and self._reading[0].ends_at(self._reading[0].start + self._reading[0].produced):
                self._consumed -= self._reading.popleft().produced  # reported done: never again
            return out

    def close(self) -> None:
        """The dataset was built again: a source still waiting for shards ends."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take_over(self) -> None:
        """A new iterator reads the feed from now on (the chief took its shards back when it had it built): what
        the old one had leased or read ahead is dropped, and its source ends."""
        with self._cond:
            self._leased.clear()
            self._reading.clear()
            self._consumed = 0
            self._generation += 1
            self._cond.notify_all()

    # -- the pipeline's side ----------------------------------------------------------------------------------------
    def consumed(self, rows: int) -> None:
        with self._cond:
            self._consumed += rows

    def generation(self) -> int:
        with self._cond:
            return self._generation

    def next_segment(self, generation: int) -> _Segment | None:
        """The next leased shard to read; None when there is none and none will come (the data ended, the dataset
        was built again, or another iterator took the feed over). Waits between functions; during one, a dry feed
        raises :class:`NeedsInput`."""
        with self._cond:
            while True:
                if self._closed or generation != self._generation:
                    return None
                if self._leased:
                    segment = self._leased.popleft()
                    self._reading.append(segment)
                    return segment
                if self._final:
                    return None
                if self._in_function:
                    raise NeedsInput("the records leased to this worker ran out during a function")
                self._cond.wait()

    def read(self, segment: _Segment) -> None:
        with self._cond:
            segment.produced += 1

    def reached_end(self, segment: _Segment) -> None:
        with self._cond:
            segment.finished = True


class LeasedSlicesNode(Node):
    """``from_tensor_slices`` reading the row ranges leased to its worker."""

    def __init__(self, source: TensorSlicesNode, feed: ShardFeed):
        super().__init__()
        self._structure, self.feed = source._structure, feed

    def iterate(self) -> Iterator[Any]:
        feed = self.feed
        generation = feed.generation()
        while (segment := feed.next_segment(generation)) is not None:
            for row in range(segment.start, segment.end if segment.end is not None else segment.start):
                feed.read(segment)
                yield slice_leaves(self._structure, row)
            feed.reached_end(segment)

    def describe(self) -> str:
        return "from_tensor_slices(leased rows)"


class LeasedFilesNode(Node):
    """``from_files`` reading the files leased to its worker, each from its leased position."""

    def __init__(self, files: list[str], reader: Callable[[str], Any], open_pass: Callable[[Any], Iterator[Any]],
                 feed: ShardFeed):
        super().__init__()
        self._files, self._reader, self._open_pass, self.feed = files, reader, open_pass, feed

    def iterate(self) -> Iterator[Any]:
        feed = self.feed
        generation = feed.generation()
        while (segment := feed.next_segment(generation)) is not None:
            records = self._open_pass(self._reader(self._files[segment.index]))
            try:
                for position, record in enumerate(records):
                    if position < segment.start:
                        continue
                    feed.read(segment)
                    yield record
            finally:
                getattr(records, "close", lambda: None)()
            feed.reached_end(segment)

    def describe(self) -> str:
        return f"from_files({len(self._files)} files, leased)"


def feed_of(dataset: Any) -> ShardFeed | None:
    """The feed of an exactly-once dataset built on this worker (None for any other resource)."""
    node = getattr(dataset, "_node", None)
    return getattr(node.root(), "feed", None) if isinstance(node, Node) else None


def leased(node: Node, feed: ShardFeed) -> Node:
    """The pipeline ending at ``node`` with its source replaced by one that reads ``feed`` (see :func:`plan`)."""
    chain = node.chain()
    source, above = _source(chain)
    new: Node
    if isinstance(source, TensorSlicesNode):
        new = LeasedSlicesNode(source, feed)
    else:
        interleave = chain[1]
        assert isinstance(source, FileListNode) and isinstance(interleave, InterleaveNode)
        new = LeasedFilesNode(source.files, interleave._fn, interleave._open_pass, feed)
    for step in above:  # the transformations above the source, copied onto the new one
        step = copy.copy(step)
        step.parent, new = new, step
    return new
