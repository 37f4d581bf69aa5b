"""``shuffle``: tf.data's shuffle buffer, element by element or, when the input comes in blocks, vectorised over
up to ``BLOCK_ROWS`` incoming elements at a time with the same random draws (so the same sequence)."""

from __future__ import annotations

import secrets
from typing import Any, Iterator

import numpy as np

from kubeps.runtime.data.node import Node, RowwiseNode
from kubeps.runtime.data.structure import BLOCK_ROWS, closing, concat, map_leaves, num_rows, slice_leaves


class ShuffleNode(RowwiseNode):
    """tf.data's shuffle buffer: fill it with ``buffer_size`` elements; then every input element takes the place of
    a uniformly picked one, which is output; at the end of the input the rest is output in random order.

    Both forms draw the same random numbers in the same order, so a seeded shuffle gives the same sequence whether
    its input comes in blocks or element by element."""

    def __init__(self, parent: Node, buffer_size: int, seed: int | None, reshuffle: bool):
        super().__init__(parent)
        self._buffer_size = buffer_size
        self._seed = seed if seed is not None else secrets.randbits(63)
        self._reshuffle = reshuffle
        self._passes = 0

    def _rng(self) -> np.random.Generator:
        epoch = self._passes if self._reshuffle else 0
        self._passes += 1
        return np.random.default_rng([self._seed, epoch])

    @staticmethod
    def _drain_order(rng: np.random.Generator, size: int) -> list[int]:
        """Positions in the buffer, in the order the end-of-input drain outputs them (swap the pick with the last
        element, pop the last)."""
        randoms = rng.random(size).tolist()
        slots = list(range(size))
        out = []
        for r in randoms:
            n = len(slots)
            j = min(int(r * n), n - 1)
            slots[j], slots[-1] = slots[-1], slots[j]
            out.append(slots.pop())
        return out

    def _on_elements(self) -> Iterator[Any]:
        rng = self._rng()
        size = self._buffer_size
        buf: list[Any] = []
        with closing(self.upstream.iterate()) as it:
            for element in it:
                if len(buf) < size:
                    buf.append(element)
                    continue
                j = min(int(rng.random() * size), size - 1)
                out, buf[j] = buf[j], element
                yield out
        for j in self._drain_order(rng, len(buf)):
            yield buf[j]

    def _on_blocks(self, parent: Iterator[Any]) -> Iterator[Any]:
        rng = self._rng()
        size = self._buffer_size
        filling: list[Any] = []  # blocks read while the buffer fills
        filled = 0
        buf = None  # once full: a writable block of `size` rows
        with closing(parent):
            for block in parent:
                n, pos = num_rows(block), 0
                if buf is None:
                    pos = min(size - filled, n)
                    filling.append(slice_leaves(block, slice(0, pos)))
                    filled += pos
                    if filled < size:
                        continue
                    buf = map_leaves(np.array, concat(filling))  # np.array copies: the buffer is written
                    filling = []
                while pos < n:
                    k = min(BLOCK_ROWS, n - pos)
                    yield self._exchange(buf, slice_leaves(block, slice(pos, pos + k)), rng, size)
                    pos += k
        if buf is None:  # the input ended before the buffer was full
            if not filling:
                return
            buf = concat(filling)
        order = np.asarray(self._drain_order(rng, num_rows(buf)), dtype=np.int64)
        for k in range(0, len(order), BLOCK_ROWS):
            yield map_leaves(lambda a, idx=order[k : k + BLOCK_ROWS]: a[idx], buf)

    @staticmethod
    def _exchange(buf: Any, incoming: Any, rng: np.random.Generator, size: int) -> Any:
        """``k`` incoming elements through the full buffer at once: element ``t`` goes to slot ``j[t]``, and the
        output ``t`` is what that slot held then -- the last earlier incoming element sent to the same slot in
        this block, or else the buffer's element from before the block."""
        k = num_rows(incoming)
        slots = np.minimum((rng.random(k) * size).astype(np.int64), size - 1)
        order = np.argsort(slots, kind="stable")  # by slot, then by arrival
        sorted_slots = slots[order]
        same = np.zeros(k, dtype=bool)
        same[1:] = sorted_slots[1:] == sorted_slots[:-1]
        previous_sorted = np.full(k, -1, dtype=np.int64)
        previous_sorted[1:] = order[:-1]
        previous_sorted[~same] = -1
        previous = np.empty(k, dtype=np.int64)
        previous[order] = previous_sorted  # the earlier incoming element in the same slot, or -1
        from_incoming = np.flatnonzero(previous >= 0)
        earlier = previous[from_incoming]
        last = np.ones(k, dtype=bool)
        last[:-1] = sorted_slots[1:] != sorted_slots[:-1]  # the last arrival per slot stays in the buffer
        kept_slots, kept = sorted_slots[last], order[last]

        # the indices above are the same for every leaf: computed once, used by each (a CSV row has a leaf per column)
        def exchange(b: np.ndarray, x: np.ndarray) -> np.ndarray:
            out = b[slots]
            out[from_incoming] = x[earlier]
            b[kept_slots] = x[kept]
            return out

        return map_leaves(exchange, buf, incoming)

    def describe(self) -> str:
        return f"shuffle({self._buffer_size})"
