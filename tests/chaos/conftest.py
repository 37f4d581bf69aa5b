"""Chaos harness: runs the CTR example (``examples/ctr/train.py``, the README's showcase; or ``scale_program.py``, a
lightweight one for many workers, which prints the same lines) as a real local cluster
(RestartingLocalCluster) and records, with timestamps, every line the tasks print, so tests can measure failure
detection and recovery. The example's own output says what happened: ``no checkpoint in ...`` / ``resumed from step
N`` when the chief starts, ``step S/T ... saved ckpt-K`` after each checkpoint, ``RESULT {...}`` at the end; its
``--closure-log`` diagnostic records every start (``S``) and end (``E``) of a scheduled execution."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from kubeps.runtime.local.restarting import RestartingLocalCluster
from kubeps.runtime.local.policy import RestartPolicy

PROGRAM = str(Path(__file__).resolve().parents[2] / "examples" / "ctr" / "train.py")
STEPS_PER_EXECUTION = 20  # the example's default


class TimedLines:
    """A text stream that keeps every line with the time it was written (and a copy in a log file)."""

    def __init__(self, path: Path):
        self.lines: list[tuple[float, str]] = []
        self._buf = ""
        self._lock = threading.Lock()
        self._file = open(path, "a")

    def write(self, text: str) -> int:
        with self._lock:
            self._buf += text
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                now = time.time()
                self.lines.append((now, line))
                self._file.write(f"{now:.3f} {line}\n")
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._file.flush()

    def first(self, needle: str, after: float = 0.0) -> float | None:
        with self._lock:
            for t, line in self.lines:
                if t >= after and needle in line:
                    return t
        return None

    def matches(self, pattern: str) -> list[tuple[float, re.Match]]:
        """``(time, match)`` of every line that ``pattern`` matches (``re.search``), oldest first."""
        regex = re.compile(pattern)
        with self._lock:
            found = [(t, regex.search(line)) for t, line in self.lines]
        return [(t, m) for t, m in found if m]


class ChaosRun:
    """One run of the CTR example under a restarting local cluster, driven from a background thread."""

    def __init__(self, workdir: Path, *, num_ps=2, num_workers=3, evaluator=False, restart=True,
                 program_args: tuple[str, ...] = (), program: str = PROGRAM, tls: bool = True,
                 ps_processes: int | None = 1):
        workdir.mkdir(parents=True, exist_ok=True)
        self.dir = workdir
        self.ckpt = workdir / "ckpt"
        self.runs_log = workdir / "runs.log"
        self.metrics = workdir / "metrics.jsonl"
        self.stream = TimedLines(workdir / "cluster.log")
        args = ["--checkpoint-dir", str(self.ckpt), "--closure-log", str(self.runs_log), "--metrics",
                str(self.metrics), *program_args]
        policy = RestartPolicy(restart=restart, max_restarts=50, backoff_initial=0.2, backoff_max=2.0)
        self.cluster = RestartingLocalCluster(program, args, tls=tls, num_ps=num_ps, num_workers=num_workers,
                                              evaluator=evaluator, output=self.stream, log=self.stream,
                                              grace_period=3.0, policy=policy, ps_processes=ps_processes)
        self.status: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.cluster.start()
            self.status = self.cluster.wait(timeout=240)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.error = err

    def start(self) -> "ChaosRun":
        self._thread.start()
        return self

    def join(self, timeout: float) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the job did not finish within {timeout} s; see {self.dir / 'cluster.log'}")
        if self.error is not None:
            raise self.error
        return self.status

    def stop(self) -> None:
        self.cluster.stop()
        self._thread.join(timeout=30)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def task(self, task_type: str, index: int):
        return self.cluster.tasks.get((task_type, index))

    def starts(self) -> list[dict[str, Any]]:
        """Every start of the chief: ``time``, ``restored_step`` (0: fresh) and ``restore_seconds``."""
        out = []
        for t, m in self.stream.matches(r"^\[chief-0\] (?:no checkpoint in |resumed from step (\d+) \(.*restored "
                                        r"in ([0-9.]+) s\))"):
            out.append({"time": t, "restored_step": int(m.group(1) or 0), "restore_seconds": float(m.group(2) or 0)})
        return out

    def checkpoints(self) -> list[dict[str, Any]]:
        """Every checkpoint the chief reported: ``time`` (printed just after the save), ``step``, ``name``."""
        return [{"time": t, "step": int(m.group(1)), "name": m.group(2)}
                for t, m in self.stream.matches(r"^\[chief-0\] step +(\d+)/\d+ .* saved (ckpt-\d+)")]

    def runs(self, kind: str = "E") -> list[tuple[int, int, int, float]]:
        """``(closure index, worker index, pid, time)`` of every closure end (``E``) or start (``S``)."""
        if not self.runs_log.exists():
            return []
        out = []
        for line in self.runs_log.read_text().splitlines():
            k, i, w, pid, t = line.split()
            if k == kind:
                out.append((int(i), int(w), int(pid), float(t)))
        return out

    def result(self) -> dict[str, Any]:
        """The chief's last ``RESULT {...}`` line (eval log-loss, AUC, references, ``resumed_from_step``)."""
        found = self.stream.matches(r"^\[chief-0\] RESULT (\{.*\})$")
        assert found, f"the chief printed no RESULT line; see {self.dir / 'cluster.log'}"
        return json.loads(found[-1][1].group(1))

    def all_pids(self) -> list[int]:
        return [t.pid for t in self.cluster.tasks.values()]


class PSProcesses:
    """Parameter servers (``python -m kubeps.runtime.server``) on loopback, killed and restarted by PID."""

    TOKEN = "kubeps-chaos-token-0123456789abcdef"

    def __init__(self, num_ps: int, log_dir: Path):
        import socket
        import sys

        socks = [socket.socket() for _ in range(num_ps + 2)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        self.cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"],
                        "ps": [f"127.0.0.1:{p}" for p in ports[2:]]}
        self.log_dir = log_dir
        self.python = sys.executable
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEPS_") and k != "TF_CONFIG"}
        self.env.update(KUBEPS_BIND_HOST="127.0.0.1", KUBEPS_LOG_LEVEL="WARNING", KUBEPS_JOB_TOKEN=self.TOKEN)
        self.procs: dict[int, Any] = {}

    def start_all(self) -> None:
        import subprocess

        from kubeps.runtime.cluster import TFConfig

        for i in range(len(self.cluster["ps"])):
            proc = self.procs.get(i)
            if proc is not None and proc.poll() is None:
                continue
            env = dict(self.env, TF_CONFIG=TFConfig.for_task(self.cluster, "ps", i).to_json())
            with open(self.log_dir / f"ps-{i}.log", "ab") as log:
                self.procs[i] = subprocess.Popen([self.python, "-m", "kubeps.runtime.server"], env=env,
                                                 stdout=log, stderr=subprocess.STDOUT)

    def kill(self, index: int) -> None:
        proc = self.procs[index]
        proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def wait_until(cond, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def chaos_run(tmp_path: Path) -> Iterator:
    """Factory ``chaos_run(name, **options)``; every run is stopped (all its processes ended) after the test."""
    runs: list[ChaosRun] = []

    def make(name: str, **options: Any) -> ChaosRun:
        run = ChaosRun(tmp_path / name, **options)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.stop()
    for run in runs:
        for task in run.cluster.tasks.values():
            assert not task.running, f"{task.name} (pid {task.pid}) was left running"


def report(name: str, figures: dict[str, Any]) -> None:
    """Print figures (``pytest -s`` shows them) and keep them in $KUBEPS_CHAOS_REPORT (JSON lines) if set."""
    line = json.dumps({"test": name, **figures}, sort_keys=True)
    print(f"\nCHAOS {line}")
    target = os.environ.get("KUBEPS_CHAOS_REPORT")
    if target:
        with open(target, "a") as f:
            f.write(line + "\n")
