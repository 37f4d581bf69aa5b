"""Reader processes: a file's blocks read and decoded in a child process, for readers whose work holds the GIL.

Reading TFRecord files is Python and protobuf's C parser from end to end (the framing walk, the CRC calls, the
``tf.Example`` decoding), all under the GIL: reader *threads* take turns instead of working at once. With
``num_parallel_reads`` > 1 such a reader (one whose class sets ``in_processes = True``) runs in child processes
instead: each open file is read by a child, which sends its blocks (dicts of numpy arrays) back through a pipe as it
decodes them, so it works ahead of the consumer by about a block while the consumer shuffles and batches.
:class:`~kubeps.runtime.data.file_blocks.FileBlocksNode` takes the blocks in the same deterministic interleave
order as with threads.

A child is ``python -m kubeps.runtime.data.reader_processes``, started with ``subprocess`` (fork and exec: nothing
of the parent -- its gRPC threads, its ``__main__`` -- is inherited; the child imports kubeps anew), given jobs
``(reader, path, environment)`` pickled on its standard input, one at a time, and answering on its standard output with
``("block", block)`` messages, then ``("end", None)`` or ``("error", exception)``. Children are kept for the next
file and the next pass (a pool per process, up to :data:`MAX_IDLE`), so a child's start (about half a second:
Python, numpy, protobuf) is paid once per reader, not per file. A child's glibc malloc keeps a block's memory
in its heap between blocks (:data:`_MALLOC`, unless the environment sets those variables). A child whose file is
abandoned mid-way (a pass closed early: ``take``, an error elsewhere) is killed, not drained. A child ends when its
standard input closes: when the parent exits, or dies, its children follow.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import pickle
import subprocess
import sys
import threading
from typing import IO, Any, Callable, Iterator

#: children kept for reuse once their file is done (the rest exit)
MAX_IDLE = 16
_PIPE_BYTES = 1 << 20  # a block of a few thousand CTR records fits: the child works a block ahead
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Linux), not named by every Python's fcntl

#: glibc's malloc in a child (values the environment already has are kept): a block's arrays (hundreds of KB each)
#: come from the heap, not an mmap each, and the heap keeps up to 128 MB free between blocks instead of handing
#: pages back to be faulted in again for the next block. Measured: about 5 % more TFRecord examples/s.
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 20)}

_idle: list["_Child"] = []
_lock = threading.Lock()


class _Child:
    """One child process and its two pipes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kubeps.runtime.data.reader_processes"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**_MALLOC, **os.environ},
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.to_child: IO[bytes] = self.proc.stdin
        self.from_child: IO[bytes] = self.proc.stdout
        try:
            fcntl.fcntl(self.from_child.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:
            pass  # a smaller pipe (pipe-max-size): the child runs less far ahead

    def start(self, reader: Callable[[str], Iterator[Any]], path: str) -> None:
        # the environment as it is now (object-store credentials and endpoints may have been set since the child
        # started)
        pickle.dump((reader, path, dict(os.environ)), self.to_child, protocol=pickle.HIGHEST_PROTOCOL)
        self.to_child.flush()

    def receive(self) -> tuple[str, Any]:
        try:
            return pickle.load(self.from_child)
        except EOFError:
            code = self.proc.wait()
            raise RuntimeError(f"a TFRecord reader process (pid {self.proc.pid}) ended with status {code} "
                               "before its file was read") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, by its Popen handle
        self.proc.wait()
        for stream in (self.to_child, self.from_child):
            try:
                stream.close()
            except OSError:
                pass


def _take() -> _Child:
    with _lock:
        while _idle:
            child = _idle.pop()
            if child.proc.poll() is None:
                return child
            child.kill()
    return _Child()


def _give_back(child: _Child) -> None:
    with _lock:
        if len(_idle) < MAX_IDLE and child.proc.poll() is None:
            _idle.append(child)
            return
    child.kill()


@atexit.register
def _stop_idle() -> None:
    with _lock:
        children, _idle[:] = list(_idle), []
    for child in children:
        child.kill()


class RemoteBlocks:
    """An iterator over the blocks of ``reader(path)``, read in a child process (started at once: the child reads
    ahead from now on). ``close()`` hands the child back, or kills it if the file was not read to its end."""

    def __init__(self, reader: Callable[[str], Iterator[Any]], path: str):
        self._child: _Child | None = _take()
        try:
            self._child.start(reader, path)
        except BaseException:
            self._child.kill()
            self._child = None
            raise

    def __iter__(self) -> "RemoteBlocks":
        return self

    def __next__(self) -> Any:
        child = self._child
        if child is None:
            raise StopIteration
        try:
            kind, value = child.receive()
        except BaseException:
            self._child = None
            child.kill()
            raise
        if kind == "block":
            return value
        self._child = None
        _give_back(child)  # "end" or "error": the child has finished this job
        if kind == "error":
            raise value
        raise StopIteration

    def close(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()


def _portable(err: BaseException) -> BaseException:
    """``err`` if it pickles (and unpickles), else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any failure to pickle: the message still travels
        return RuntimeError(f"{type(err).__name__}: {err}")


def serve(jobs: IO[bytes], answers: IO[bytes]) -> None:
    """The child's loop: a job at a time until ``jobs`` closes."""
    dump = pickle.Pickler(answers, protocol=pickle.HIGHEST_PROTOCOL)
    while True:
        try:
            reader, path, environ = pickle.load(jobs)
        except EOFError:
            return
        if environ != os.environ:
            os.environ.clear()
            os.environ.update(environ)
        try:
            for block in reader(path):
                dump.dump(("block", block))
                dump.clear_memo()
                answers.flush()
            message: tuple[str, Any] = ("end", None)
        except Exception as err:  # noqa: BLE001 - the reader's error, raised in the parent where its block would be
            message = ("error", _portable(err))
        dump.dump(message)
        dump.clear_memo()
        answers.flush()


def main() -> None:
    # the answers go to the pipe that was standard output; anything printed goes to standard error instead
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        serve(sys.stdin.buffer, answers)
    except (BrokenPipeError, KeyboardInterrupt):
        pass  # the parent went away


if __name__ == "__main__":
    main()
