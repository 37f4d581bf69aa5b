"""``prefetch``: a producer thread runs the pipeline up to ``buffer_size`` elements ahead of the consumer.

Errors reach the consumer at the element where they happened; closing or dropping the consumer's iterator stops
and joins the thread. The thread is started per pass, so the node itself holds no thread and still pickles.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

from kubeps.runtime.data.node import Node
from kubeps.runtime.data.structure import close

#: How long closing a prefetching iterator waits for its producer thread (it exits at its next element).
PREFETCH_JOIN_TIMEOUT_S = 10.0

_ITEM, _ERROR, _END = "item", "error", "end"



def _put(q: "queue.Queue", item: tuple, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterator[Any], q: "queue.Queue", stop: threading.Event) -> None:
    # A plain function (not a method) so the thread holds no reference to the consumer's iterator, which can
    # therefore be garbage-collected -- and its finaliser stop this thread.
    try:
        for element in source:
            if not _put(q, (_ITEM, element), stop):
                return
        _put(q, (_END, None), stop)
    except BaseException as err:  # noqa: BLE001 - handed to the consumer, which re-raises it
        _put(q, (_ERROR, err), stop)
    finally:
        close(source)


class PrefetchNode(Node):
    def __init__(self, parent: Node, buffer_size: int):
        super().__init__(parent)
        self._buffer_size = buffer_size

    def iterate(self) -> Iterator[Any]:
        if self._buffer_size == 0:
            it = self.upstream.iterate()
            try:
                yield from it
            finally:
                close(it)
            return
        q: queue.Queue = queue.Queue(maxsize=self._buffer_size)
        stop = threading.Event()
        thread = threading.Thread(
            target=_produce, args=(self.upstream.iterate(), q, stop), name="kubeps-prefetch", daemon=True
        )
        thread.start()
        try:
            while True:
                kind, value = q.get()
                if kind is _ITEM:
                    yield value
                elif kind is _ERROR:
                    raise value
                else:
                    return
        finally:
            stop.set()
            while True:  # unblock a producer waiting on a full queue
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            thread.join(PREFETCH_JOIN_TIMEOUT_S)

    def describe(self) -> str:
        return f"prefetch({self._buffer_size})"
