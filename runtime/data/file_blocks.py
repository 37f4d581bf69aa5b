"""Reading files block by block: the source node of the file formats (Parquet, TFRecord, CSV), with
``tf.data``'s parallel ``interleave`` semantics.

:class:`FileBlocksNode` sits on a file list (``list_files``: the node ``AutoShardPolicy.FILE`` splits between
workers) and hands out *blocks* -- a Parquet row group, a chunk of CSV lines or of TFRecord records, as a
structure of arrays -- so ``batch``, ``shard`` and ``shuffle`` above it work with array slicing, never one Python
step per record. ``cycle_length`` files are open at once and one block is taken from each in turn (``tf.data``'s
``interleave`` with ``block_length`` = one block); with ``num_parallel_calls`` > 1 a thread pool reads the next
blocks of every open file, and of the next files to open, while the consumer works: as many as the reader's
``read_ahead`` attribute says (1 if it has none; CSV reads 3 blocks of ``block_rows`` rows ahead, so a reader that
is done with a block goes on with the next while the consumer waits on another file's). The order is deterministic:
exactly the order of the single-threaded interleave, whatever the thread timing (as ``tf.data`` with
``deterministic=True``, its default). Readers release the GIL in their bulk work (pyarrow's decoding, file reads,
numpy's parsing), which is where the threads overlap. A reader whose work holds the GIL (its class sets
``in_processes = True``: TFRecord) is run in child processes instead, one per open file
(:mod:`~kubeps.runtime.data.reader_processes`), in the same order. The thread pool lives for one pass: the node
holds none, so a pipeline still pickles.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

from kubeps.runtime.data.node import Node
from kubeps.runtime.data.structure import close, unblock

_END = object()  # a file's blocks are exhausted

#: threads for ``num_parallel_calls=AUTOTUNE``: the CPUs this process may use, at most 8
AUTOTUNE_READERS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def _advance(it: Iterator[Any]) -> Any:
    try:
        return next(it)
    except StopIteration:
        return _END


class _Now:
    """An executor that runs a call at once (``num_parallel_calls`` <= 1): one code path for both cases."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, at the block where it happened
            future.set_exception(err)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


class _Later:
    """A call made when its result is asked for (a child process works ahead instead of a thread)."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]):
        self._call: tuple[Callable[..., Any], tuple[Any, ...]] | None = (fn, args)
        self._value: Any = None

    def result(self) -> Any:
        if self._call is not None:
            fn, args = self._call
            self._call = None
            self._value = fn(*args)
        return self._value


class _OnDemand:
    """An executor of :class:`_Later` calls."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Later:
        return _Later(fn, args)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


class _Reads:
    """One open file's blocks, the next one read ahead by ``pool`` (in the consumer's thread for :class:`_Now`, by
    a child process for :class:`_OnDemand`)."""

    def __init__(self, blocks: Iterator[Any], pool: Any):
        self.blocks = blocks
        self._pool = pool
        self._next = pool.submit(_advance, blocks)

    def take(self) -> Any:
        """The file's next block, or ``_END``; a reader's error is raised here, where its block would be."""
        block = self._next.result()
        if block is not _END:
            self._next = self._pool.submit(_advance, self.blocks)
        return block

    def stop(self) -> None:
        """Nothing to stop: no thread reads ahead."""


class _ThreadReads:
    """One open file read ahead by a thread pool, ``depth`` blocks ahead of the consumer. A file's blocks come from
    one generator, so they are read one after another by one task at a time (never two threads in it), which goes
    on while blocks are asked for and not yet read."""

    def __init__(self, blocks: Iterator[Any], pool: ThreadPoolExecutor, depth: int):
        self.blocks = blocks
        self._pool = pool
        self._depth = depth
        self._lock = threading.Lock()
        self._unread: collections.deque[Future] = collections.deque()  # asked for, not read yet (oldest first)
        self._untaken: collections.deque[Future] = collections.deque()  # asked for, not taken yet
        self._working = False  # a task of the pool is reading this file
        self._stopped = False
        for _ in range(depth):
            self._ask()

    def _ask(self) -> None:
        future: Future = Future()
        self._untaken.append(future)
        with self._lock:
            self._unread.append(future)
            start, self._working = not self._working, True
        if start:
            self._pool.submit(self._work)

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._unread or self._stopped:
                    self._working = False
                    return
                future = self._unread[0]
            error: BaseException | None = None
            try:
                block = _advance(self.blocks)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer, at the block where it happened
                error = err
            with self._lock:
                self._unread.popleft()
            if error is None:
                future.set_result(block)
            else:
                future.set_exception(error)

    def take(self) -> Any:
        """The file's next block, or ``_END``; a reader's error is raised here, where its block would be."""
        block = self._untaken.popleft().result()
        if block is not _END:
            while len(self._untaken) < self._depth:
                self._ask()
        return block

    def stop(self) -> None:
        """No more reads after the one under way (the pass is ending)."""
        with self._lock:
            self._stopped = True


class FileBlocksNode(Node):
    """Blocks of ``read_blocks(path)`` for every path of the parent node, interleaved over ``cycle_length`` open
    files, read ahead by ``num_parallel_calls`` threads (1: in the consumer's thread)."""

    def __init__(
        self,
        parent: Node,
        read_blocks: Callable[[str], Iterator[Any]],
        cycle_length: int,
        num_parallel_calls: int,
        name: str,
    ):
        super().__init__(parent)
        self._read_blocks = read_blocks
        self._cycle_length = cycle_length
        self._num_parallel_calls = num_parallel_calls
        self._name = name

    @property
    def read_blocks(self) -> Callable[[str], Iterator[Any]]:
        """The reader: one file's path -> its blocks."""
        return self._read_blocks

    def iterate(self) -> Iterator[Any]:
        return unblock(self.blocks())

    def blocks(self) -> Iterator[Any]:
        cycle = self._cycle_length
        threads = self._num_parallel_calls
        read_blocks = self._read_blocks
        opened_ahead = cycle if threads > 1 else 1  # files opened (their first block read) before their turn
        pool: Any
        reads: Callable[[Iterator[Any]], Any]
        if threads > 1 and getattr(read_blocks, "in_processes", False):
            from kubeps.runtime.data.reader_processes import RemoteBlocks  # noqa: PLC0415 - only for such readers

            # a child per open file, and one for the next file to open: cycle + 1 processes
            pool, read_blocks, opened_ahead = _OnDemand(), functools.partial(RemoteBlocks, read_blocks), 1
            reads = functools.partial(_Reads, pool=pool)
        elif threads > 1:
            pool = ThreadPoolExecutor(threads, thread_name_prefix="kubeps-read")
            reads = functools.partial(_ThreadReads, pool=pool, depth=max(1, int(getattr(read_blocks, "read_ahead", 1))))
        else:
            pool = _Now()
            reads = functools.partial(_Reads, pool=pool)
        outer = self.upstream.iterate()
        ahead: collections.deque[Any] = collections.deque()  # files opened early, their first block asked for
        slots: list[Any] = [None] * cycle
        end_of_input = False

        def open_ahead() -> None:
            # the next files are opened (and their first block read) before the cycle reaches them; they are
            # handed to the slots in input order, so the order stays that of the sequential interleave
            nonlocal end_of_input
            while not end_of_input and len(ahead) < opened_ahead:
                try:
                    path = next(outer)
                except StopIteration:
                    end_of_input = True
                    return
                ahead.append(reads(read_blocks(path)))

        num_open = 0
        index = 0
        try:
            open_ahead()
            while ahead or num_open:
                slot = slots[index]
                if slot is not None:
                    block = slot.take()
                    if block is _END:
                        slots[index] = None
                        num_open -= 1
                        close(slot.blocks)
                    else:
                        yield block
                    index = (index + 1) % cycle
                elif ahead:
                    slots[index] = ahead.popleft()
                    num_open += 1
                    open_ahead()
                else:
                    index = (index + 1) % cycle
        finally:
            opened = [entry for entry in [*slots, *ahead] if entry is not None]
            for entry in opened:
                entry.stop()
            pool.shutdown(wait=True, cancel_futures=True)  # no reader thread is inside a file after this
            for entry in opened:
                close(entry.blocks)
            close(outer)

    def describe(self) -> str:
        return f"{self._name}(cycle_length={self._cycle_length}, num_parallel_calls={self._num_parallel_calls})"
