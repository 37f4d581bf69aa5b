"""``kubeps local scale --workers N``: how a running ``kubeps local`` is asked to change its worker count.

Every ``kubeps local`` keeps a private run directory (mode 0700) named ``kubeps-local-<launcher pid>-*`` in the
temporary directory. It holds the chief's membership document (``membership.json``, which the chief watches:
:mod:`kubeps.runtime.coordinator.membership`), the chief's acknowledgement (``membership-ack.json``) and, while
one is pending, a scale request (``scale-request.json``). ``kubeps local scale`` writes the request (atomically),
the launcher picks it up within a fraction of a second (its wait loop looks for the file), scales
(:meth:`kubeps.runtime.local.scaler.Scaler.scale`) and writes ``scale-result.json`` with the
request's id, which the command waits for and prints. The same path as the operator's: a membership document the
chief applies without a restart.

Pure file handling: no process is started here.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from kubeps.runtime.util.files import write_atomically

__all__ = [
    "MEMBERSHIP_ACK_FILE",
    "MEMBERSHIP_FILE",
    "RUN_DIR_PREFIX",
    "SCALE_REQUEST_FILE",
    "SCALE_RESULT_FILE",
    "ScaleRequest",
    "find_run_dir",
    "make_run_dir",
    "membership_files",
    "read_request",
    "request_scale",
]

#: the run directory's name starts with this, then the launcher's pid and a dash
RUN_DIR_PREFIX = "kubeps-local-"
MEMBERSHIP_FILE = "membership.json"
MEMBERSHIP_ACK_FILE = "membership-ack.json"
SCALE_REQUEST_FILE = "scale-request.json"
SCALE_RESULT_FILE = "scale-result.json"


@dataclass(frozen=True)
class ScaleRequest:
    """``workers``: the worker count asked for; ``id``: matches the request to its result."""

    workers: int
    id: str


def make_run_dir() -> str:
    """A new run directory for this launcher (mode 0700); whoever made it removes it."""
    return tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")


def membership_files(run_dir: str) -> tuple[str, str]:
    """The chief's membership document and its acknowledgement in ``run_dir``."""
    return os.path.join(run_dir, MEMBERSHIP_FILE), os.path.join(run_dir, MEMBERSHIP_ACK_FILE)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # someone else's process: not our launcher
    return True


def find_run_dir(pid: int | None = None, tmpdir: str | None = None) -> str:
    """The run directory of the running ``kubeps local`` with launcher pid ``pid``, or of the only one running;
    raises ``LookupError`` saying what was found otherwise."""
    base = tmpdir or tempfile.gettempdir()
    runs: dict[int, str] = {}
    for path in glob.glob(os.path.join(base, RUN_DIR_PREFIX + "*")):
        head = os.path.basename(path)[len(RUN_DIR_PREFIX):].split("-", 1)[0]
        if head.isdigit() and os.path.isdir(path) and os.stat(path).st_uid == os.getuid() and _alive(int(head)):
            runs[int(head)] = path
    if pid is not None:
        if pid not in runs:
            raise LookupError(f"--pid {pid}: no running kubeps local with that launcher pid "
                              f"(running: {sorted(runs) or 'none'})")
        return runs[pid]
    if len(runs) != 1:
        raise LookupError(f"{len(runs)} kubeps local runs found (launcher pids {sorted(runs) or 'none'}): "
                          + ("start one first" if not runs else "name one with --pid"))
    return next(iter(runs.values()))


def request_scale(run_dir: str, workers: int, timeout: float = 120.0) -> dict[str, Any]:
    """Ask the launcher of ``run_dir`` for ``workers`` workers and wait up to ``timeout`` seconds for its result
    (a dict: ``workers``, ``generation``, ``seconds``, ``message``); raises ``TimeoutError``."""
    request = ScaleRequest(workers=workers, id=secrets.token_hex(8))
    path = os.path.join(run_dir, SCALE_REQUEST_FILE)
    deadline = time.monotonic() + timeout
    while os.path.exists(path):  # one request at a time: the launcher takes it when the previous one is done
        if time.monotonic() > deadline:
            raise TimeoutError(f"a previous scale request in {run_dir} was not taken within {timeout:.0f} s")
        time.sleep(0.05)
    write_atomically(path, json.dumps({"workers": request.workers, "id": request.id}))
    result_path = os.path.join(run_dir, SCALE_RESULT_FILE)
    while time.monotonic() < deadline:
        try:
            with open(result_path) as fh:
                result = json.load(fh)
        except (OSError, ValueError):
            result = None
        if isinstance(result, dict) and result.get("id") == request.id:
            return result
        time.sleep(0.05)
    raise TimeoutError(f"kubeps local did not finish scaling to {workers} worker(s) within {timeout:.0f} s")


def read_request(run_dir: str) -> ScaleRequest | None:
    """The pending scale request of ``run_dir`` (removed from it), or None; a malformed one is removed and
    answered with ``ValueError``."""
    path = os.path.join(run_dir, SCALE_REQUEST_FILE)
    try:
        with open(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    os.unlink(path)
    try:
        data = json.loads(text)
        return ScaleRequest(workers=int(data["workers"]), id=str(data["id"]))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"malformed scale request {text[:80]!r}: {err}") from None
