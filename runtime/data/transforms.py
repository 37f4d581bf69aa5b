"""The transformations of a pipeline's elements, as nodes: ``map``, ``filter``, ``interleave``, ``repeat``,
``batch``, ``shard``, ``take`` and ``skip`` (``shuffle`` and ``prefetch`` have modules of their own).

``repeat``, ``shard``, ``take`` and ``skip`` only pick, drop or reorder elements, so they pass blocks on;
``batch`` cuts batches out of blocks when its input has them.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

from kubeps.runtime.data import passes
from kubeps.runtime.data.node import Node, RowwiseNode
from kubeps.runtime.data.structure import call, close, closing, concat, num_rows, rows_of, slice_leaves, stack


class MapNode(Node):
    def __init__(self, parent: Node, fn: Callable):
        super().__init__(parent)
        self._fn = fn

    def iterate(self) -> Iterator[Any]:
        with closing(self.upstream.iterate()) as it:
            for element in it:
                yield call(self._fn, element)


class FilterNode(Node):
    def __init__(self, parent: Node, fn: Callable):
        super().__init__(parent)
        self._fn = fn

    def iterate(self) -> Iterator[Any]:
        with closing(self.upstream.iterate()) as it:
            for element in it:
                if call(self._fn, element):
                    yield element


class InterleaveNode(Node):
    """``open_pass`` turns what ``fn`` returns into an iterator over one pass: the dataset module gives one that
    reads a ``Dataset`` through its node (nodes do not know ``Dataset``)."""

    def __init__(
        self,
        parent: Node,
        fn: Callable,
        cycle_length: int,
        block_length: int,
        open_pass: Callable[[Any], Iterator[Any]],
    ):
        super().__init__(parent)
        self._fn = fn
        self._open_pass = open_pass
        self._cycle_length = cycle_length
        self._block_length = block_length

    def iterate(self) -> Iterator[Any]:
        # tf.data's InterleaveDataset: a cycle of ``cycle_length`` slots visited in turn, ``block_length``
        # elements from each; an exhausted iterator frees its slot and the cycle moves on to the next one; an
        # empty slot is filled from the input when the cycle reaches it
        outer = self.upstream.iterate()
        slots: list[Iterator[Any] | None] = [None] * self._cycle_length
        num_open = 0
        index = 0
        end_of_input = False
        try:
            while not end_of_input or num_open:
                it = slots[index]
                if it is not None:
                    for _ in range(self._block_length):
                        try:
                            element = next(it)
                        except StopIteration:
                            slots[index] = None
                            num_open -= 1
                            close(it)
                            break
                        yield element
                    index = (index + 1) % self._cycle_length
                elif not end_of_input:
                    try:
                        element = next(outer)
                    except StopIteration:
                        end_of_input = True
                        continue
                    slots[index] = self._open_pass(call(self._fn, element))
                    num_open += 1
                else:
                    index = (index + 1) % self._cycle_length
        finally:
            for it in slots:
                if it is not None:
                    close(it)
            close(outer)

    def describe(self) -> str:
        return f"interleave(cycle_length={self._cycle_length})"


def _one(element: Any) -> int:  # noqa: ARG001 - an unbatched element is one record
    return 1


class RepeatNode(RowwiseNode):
    def __init__(self, parent: Node, count: int | None):
        super().__init__(parent)
        self._count = count

    def _passes_of(self, first: Iterator[Any] | None, open_pass: Callable[[], Iterator[Any]],
                   rows: Callable[[Any], int]) -> Iterator[Any]:
        # the ledger of the worker's iterator opening this pipeline, if any: it learns where each pass starts
        # (kubeps.runtime.data.passes), taken now, in the opener's thread, not in a prefetch thread later
        ledger = passes.current()
        depth = len(self.chain())
        if ledger is not None:
            ledger.claim(depth)
        return self._each_pass(first, open_pass, rows, ledger, depth)

    def _each_pass(self, first: Iterator[Any] | None, open_pass: Callable[[], Iterator[Any]],
                   rows: Callable[[Any], int], ledger: passes.PassLedger | None, depth: int) -> Iterator[Any]:
        counts = itertools.count() if self._count is None else range(self._count)
        for n in counts:
            if n and ledger is not None:
                ledger.pass_started(depth)
            with closing(first if n == 0 and first is not None else open_pass()) as it:
                empty = True
                for item in it:
                    empty = False
                    if ledger is not None:
                        ledger.produced(depth, rows(item))
                    yield item
            if empty:
                return

    def _on_blocks(self, parent: Iterator[Any]) -> Iterator[Any]:
        return self._passes_of(parent, self._next_blocks, num_rows)

    def _on_elements(self) -> Iterator[Any]:
        return self._passes_of(None, self.upstream.iterate, rows_of if batched(self) else _one)

    def _next_blocks(self) -> Iterator[Any]:
        blocks = self.upstream.blocks()
        if blocks is None:  # a pipeline that gave blocks once gives them on every pass
            raise TypeError("repeat: the input stopped giving blocks between passes")
        return blocks

    def describe(self) -> str:
        return f"repeat({'' if self._count is None else self._count})"


class BatchNode(Node):
    def __init__(self, parent: Node, batch_size: int, drop_remainder: bool):
        super().__init__(parent)
        self._batch_size = batch_size
        self._drop_remainder = drop_remainder

    def iterate(self) -> Iterator[Any]:
        blocks = self.upstream.blocks()
        return self._from_elements() if blocks is None else self._from_blocks(blocks)

    def _from_blocks(self, blocks: Iterator[Any]) -> Iterator[Any]:
        """Batches cut out of blocks: a slice (no copy) when a batch lies inside one block, else concatenated."""
        b = self._batch_size
        pending: list[Any] = []
        have = 0
        with closing(blocks):
            for block in blocks:
                n, pos = num_rows(block), 0
                while pos < n:
                    if not pending and n - pos >= b:
                        yield slice_leaves(block, slice(pos, pos + b))
                        pos += b
                        continue
                    take = min(b - have, n - pos)
                    pending.append(slice_leaves(block, slice(pos, pos + take)))
                    have += take
                    pos += take
                    if have == b:
                        yield concat(pending)
                        pending, have = [], 0
        if pending and not self._drop_remainder:
            yield concat(pending)

    def _from_elements(self) -> Iterator[Any]:
        with closing(self.upstream.iterate()) as it:
            buf: list[Any] = []
            for element in it:
                buf.append(element)
                if len(buf) == self._batch_size:
                    yield stack(buf)
                    buf = []
            if buf and not self._drop_remainder:
                yield stack(buf)

    def describe(self) -> str:
        return f"batch({self._batch_size}{', drop_remainder' if self._drop_remainder else ''})"


def batched(node: Node) -> bool:
    """Whether ``node``'s elements are batches (a ``batch`` in its pipeline): they then hold several records."""
    return any(isinstance(step, BatchNode) for step in node.chain())


class ShardNode(RowwiseNode):
    def __init__(self, parent: Node, num_shards: int, index: int):
        super().__init__(parent)
        self._num_shards = num_shards
        self._index = index

    def _on_blocks(self, parent: Iterator[Any]) -> Iterator[Any]:
        seen = 0  # elements of the input before the current block
        with closing(parent):
            for block in parent:
                n = num_rows(block)
                first = (self._index - seen) % self._num_shards
                if first < n:
                    yield slice_leaves(block, slice(first, n, self._num_shards))
                seen += n

    def _on_elements(self) -> Iterator[Any]:
        with closing(self.upstream.iterate()) as it:
            for i, element in enumerate(it):
                if i % self._num_shards == self._index:
                    yield element

    def describe(self) -> str:
        return f"shard({self._num_shards}, {self._index})"


class TakeNode(RowwiseNode):
    def __init__(self, parent: Node, count: int | None):
        super().__init__(parent)
        self._count = count

    def _on_blocks(self, parent: Iterator[Any]) -> Iterator[Any]:
        left = self._count
        with closing(parent):
            if left == 0:
                return
            for block in parent:
                n = num_rows(block)
                if left is not None and n >= left:
                    yield slice_leaves(block, slice(0, left))
                    return
                yield block
                if left is not None:
                    left -= n

    def _on_elements(self) -> Iterator[Any]:
        if self._count == 0:
            return
        with closing(self.upstream.iterate()) as it:
            for i, element in enumerate(it, 1):
                yield element
                if self._count is not None and i >= self._count:
                    return


class SkipNode(RowwiseNode):
    def __init__(self, parent: Node, count: int):
        super().__init__(parent)
        self._count = count

    def _on_blocks(self, parent: Iterator[Any]) -> Iterator[Any]:
        left = self._count
        with closing(parent):
            for block in parent:
                n = num_rows(block)
                if left >= n:
                    left -= n
                    continue
                yield slice_leaves(block, slice(left, n)) if left else block
                left = 0

    def _on_elements(self) -> Iterator[Any]:
        with closing(self.upstream.iterate()) as it:
            for i, element in enumerate(it):
                if i >= self._count:
                    yield element


