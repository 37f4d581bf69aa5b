"""Restart policy (pure table) and its application to real local processes; the chief's exit-code contract."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kubeps.runtime.errors import PSUnavailableError
from kubeps.runtime.local.restarting import RestartingLocalCluster
from kubeps.runtime.contract import EXIT_PS_UNAVAILABLE, is_retryable_exit
from kubeps.runtime.coordinator.supervisor import ps_unavailable_cause
from kubeps.runtime.local.policy import Action, RestartPolicy

P = RestartPolicy(max_restarts=2, backoff_initial=0.5, backoff_max=1.5)


@pytest.mark.parametrize("task,status,restarts,expected", [
    (("chief", 0), 0, 0, [Action("finish", ("chief", 0), reason="the chief succeeded")]),
    (("chief", 0), 1, 0, [Action("fail", ("chief", 0), reason="the chief exited with permanent status 1")]),
    (("chief", 0), 133, 0, [Action("restart", ("chief", 0), 0.0, "the chief exited with retryable status 133")]),
    (("chief", 0), 137, 1, [Action("restart", ("chief", 0), 1.0, "the chief exited with retryable status 137")]),
    (("worker", 1), 137, 0, [Action("restart", ("worker", 1), 0.0, "worker-1 exited with status 137")]),
    (("worker", 1), 137, 2, [Action("report", ("worker", 1),
                                    reason="worker-1 was restarted 2 time(s) already (max_restarts=2); not restarting it")]),
    (("worker", 0), 0, 0, [Action("report", ("worker", 0), reason="worker-0 finished")]),
    (("evaluator", 0), 1, 0, [Action("restart", ("evaluator", 0), 0.0, "evaluator-0 exited with status 1")]),
])
def test_policy_table(task, status, restarts, expected):
    assert P.on_exit(task[0], task[1], status, restarts) == expected


def test_ps_failure_restarts_ps_and_chief():
    actions = P.on_exit("ps", 1, 137, 1)
    assert [(a.kind, a.task) for a in actions] == [("restart", ("ps", 1)), ("kill", ("chief", 0))]
    assert actions[0].delay == 1.0  # second restart of that ps: backoff_initial * 2
    assert P.on_exit("ps", 1, 137, 2)[0].kind == "fail"
    off = RestartPolicy(restart=False)
    assert [a.kind for a in off.on_exit("ps", 0, 137, 0)] == ["report"]
    assert [a.kind for a in off.on_exit("chief", 0, EXIT_PS_UNAVAILABLE, 0)] == ["fail"]


def test_backoff_and_exit_codes():
    assert [P.backoff(n) for n in range(5)] == [0.0, 1.0, 1.5, 1.5, 1.5]
    assert is_retryable_exit(EXIT_PS_UNAVAILABLE) and is_retryable_exit(137)
    assert not is_retryable_exit(1) and not is_retryable_exit(0) and not is_retryable_exit(127)
    with pytest.raises(ValueError, match=r"'RestartPolicy.max_restarts' has invalid value -1: an integer >= 0"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match=r"'RestartPolicy.backoff_max' has invalid value nan: a number of seconds >= 0"):
        RestartPolicy(backoff_max=float("nan"))


def test_ps_unavailable_found_in_exception_chain():
    err = PSUnavailableError(1, "127.0.0.1:1", "gone")
    try:
        try:
            raise err
        except PSUnavailableError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert ps_unavailable_cause(outer) is err
    assert ps_unavailable_cause(ValueError("x")) is None


def test_run_coordinator_exits_133_on_ps_loss(tmp_path):
    script = tmp_path / "chief.py"
    script.write_text(textwrap.dedent("""
        import threading, time
        from kubeps.runtime.errors import PSUnavailableError
        from kubeps.runtime.coordinator.supervisor import run_coordinator
        def main():
            # a non-daemon thread stuck forever must not keep the process alive
            threading.Thread(target=time.sleep, args=(600,)).start()
            raise PSUnavailableError(0, "127.0.0.1:9", "connection refused")
        run_coordinator(main)
    """))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_PS_UNAVAILABLE, proc.stderr
    assert "/job:ps/task:0 at 127.0.0.1:9 is unavailable" in proc.stderr
    assert "exits with status 133 (retryable)" in proc.stderr
    assert time.monotonic() - t0 < 30
    other = tmp_path / "other.py"
    other.write_text("from kubeps.runtime.coordinator.supervisor import run_coordinator\n"
                     "def main():\n    raise ValueError('bad input')\nrun_coordinator(main)\n")
    proc = subprocess.run([sys.executable, str(other)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "ValueError: bad input" in proc.stderr


TOY = textwrap.dedent("""
    import json, os, sys, time
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    state = sys.argv[1]
    name = f"{task['type']}-{task['index']}"
    with open(os.path.join(state, name), "a") as f:
        f.write(f"{os.getpid()}\\n")
    if task["type"] != "chief":
        time.sleep(120)
        sys.exit(0)
    runs = open(os.path.join(state, name)).read().split()
    if len(runs) == 1:
        sys.exit(133)                  # first run: 'lost a ps', retryable
    while not os.path.exists(os.path.join(state, "finish")):
        time.sleep(0.05)
    sys.exit(0)
""")


def _pids(state, name):
    path = state / name
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.mark.timeout(120)
def test_restarting_local_cluster_with_real_processes(tmp_path):
    pytest.importorskip("kubeps.runtime.local.launcher")
    script = tmp_path / "toy.py"
    script.write_text(TOY)
    state = tmp_path / "state"
    state.mkdir()
    out = io.StringIO()
    # the toy ps answers no Ping: the chief does not wait for it (the chaos tests cover that gate)
    cluster = RestartingLocalCluster(str(script), [str(state)], num_ps=1, num_workers=2, output=out, log=out,
                                     grace_period=2.0, ps_ready_timeout=0,
                                     policy=RestartPolicy(max_restarts=5, backoff_initial=0.1))
    result: dict = {}
    import threading

    def run():
        cluster.start()
        result["status"] = cluster.wait(timeout=90)

    t = threading.Thread(target=run)
    t.start()
    try:
        _wait(lambda: len(_pids(state, "chief-0")) == 2)  # the chief's exit 133 was retried
        _wait(lambda: len(_pids(state, "worker-1")) == 1)
        victim = _pids(state, "worker-1")[0]
        os.kill(victim, signal.SIGKILL)  # a child of this test's cluster
        _wait(lambda: len(_pids(state, "worker-1")) == 2)
        ps_pid = _pids(state, "ps-0")[0]
        os.kill(ps_pid, signal.SIGKILL)
        _wait(lambda: len(_pids(state, "ps-0")) == 2 and len(_pids(state, "chief-0")) == 3)
        (state / "finish").write_text("")
        t.join(timeout=60)
        assert result.get("status") == 0
    finally:
        (state / "finish").write_text("")
        cluster.stop()
        t.join(timeout=30)
    kinds = [(e.kind, e.task) for e in cluster.events]
    assert ("exit", "worker-1") in kinds and ("restart", "worker-1") in kinds
    assert ("exit", "ps-0") in kinds and ("kill", "chief-0") in kinds and ("restart", "ps-0") in kinds
    assert kinds[-1] == ("finish", "chief-0")
    for name in ("ps-0", "worker-0", "worker-1", "chief-0"):
        for pid in _pids(state, name):
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
