"""``kubeps local``: real processes, real signals, checked by PID. No dependency on the distributed core: the tasks
are throwaway scripts that report their TF_CONFIG and then exit, fail or sleep as told."""

from __future__ import annotations

import json
import re
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubeps.runtime import cli
from kubeps.runtime.contract import VERSION
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.local import ports as local_ports
from kubeps.runtime.local.ports import PortAllocator
from kubeps.runtime.local.launcher import (LauncherArgumentError, LauncherError, LocalCluster, LocalJobSpec, exit_status,
                                           free_port_runs, free_ports)
from kubeps.runtime.settings import TaskSettings

# The task script: argv[1] is a directory for pid files, argv[2] a JSON behaviour per task type
# ({"chief": {"exit": 3}, "worker": {"sleep": 60}, ...}); "default" applies to types not named. "wait_for": N
# waits until N tasks have written their pid file (so every task has reported before the chief ends);
# "wait_starts": N waits until tasks have started N times in all (restarts included).
TASK_SCRIPT = r'''
import json, os, signal, sys, time
config = json.loads(os.environ["TF_CONFIG"])
task_type, index = config["task"]["type"], config["task"]["index"]
pid_dir, spec = sys.argv[1], json.loads(sys.argv[2])
behaviour = spec.get(f"{task_type}-{index}", spec.get(task_type, spec.get("default", {})))
if behaviour.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
report = {
    "task": config["task"], "cluster": config["cluster"], "argv": sys.argv[3:], "pid": os.getpid(),
    "token": os.environ.get("KUBEPS_JOB_TOKEN"), "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
    "bind_host": os.environ.get("KUBEPS_BIND_HOST"),
}
print("REPORT " + json.dumps(report))
print(f"to stderr from {task_type} {index}", file=sys.stderr)
tmp = os.path.join(pid_dir, f".{task_type}-{index}")
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.replace(tmp, os.path.join(pid_dir, f"{task_type}-{index}"))
with open(os.path.join(pid_dir, ".starts"), "a") as f:
    f.write(f"{task_type}-{index}\n")
deadline = time.time() + 30
while len([n for n in os.listdir(pid_dir) if not n.startswith(".")]) < behaviour.get("wait_for", 0):
    assert time.time() < deadline, "the other tasks did not start"
    time.sleep(0.01)
while len(open(os.path.join(pid_dir, ".starts")).read().split()) < behaviour.get("wait_starts", 0):
    assert time.time() < deadline, "the other tasks did not start"
    time.sleep(0.01)
time.sleep(behaviour.get("sleep", 0))
if "kill" in behaviour:
    os.kill(os.getpid(), behaviour["kill"])
sys.exit(behaviour.get("exit", 0))
'''

FOREVER = {"sleep": 600}


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "task.py"
    path.write_text(TASK_SCRIPT)
    return path


@pytest.fixture
def pid_dir(tmp_path) -> Path:
    d = tmp_path / "pids"
    d.mkdir()
    return d


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def pids(pid_dir: Path) -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in pid_dir.iterdir() if not p.name.startswith(".")}


def wait_for_pids(pid_dir: Path, count: int, timeout: float = 20.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pids(pid_dir)
        if len(found) >= count:
            return found
        time.sleep(0.02)
    raise AssertionError(f"only {pids(pid_dir)} of {count} tasks started")


def assert_all_gone(task_pids: dict[str, int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in task_pids.values()):
        time.sleep(0.02)
    left = {name: pid for name, pid in task_pids.items() if alive(pid)}
    if left:  # clean up what we started before failing
        for pid in left.values():
            os.kill(pid, signal.SIGKILL)
    assert left == {}, f"processes left behind: {left}"


def reports(out: str) -> dict[str, dict]:
    """``{"ps-1": report}`` from prefixed ``[ps-1] REPORT {...}`` lines."""
    found = {}
    for line in out.splitlines():
        if "] REPORT " in line:
            prefix, payload = line.split(" REPORT ", 1)
            found[prefix.strip("[]")] = json.loads(payload)
    return found


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def spawn_launcher(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kubeps.runtime.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# -- output, exit status, TF_CONFIG -------------------------------------------------------------------------------
def test_output_is_prefixed_and_exit_status_is_the_chiefs(script, pid_dir, capsys):
    spec = {"chief": {"exit": 3, "wait_for": 5}, "default": FOREVER}
    code, out, err = run_main(
        ["local", str(script), "--ps", "2", "--workers", "2", "--", str(pid_dir), json.dumps(spec), "x", "--flag"],
        capsys,
    )
    assert code == 3
    found = reports(out)
    assert set(found) == {"chief-0", "ps-0", "ps-1", "worker-0", "worker-1"}
    for name, report in found.items():
        task_type, index = name.split("-")
        assert report["task"] == {"type": task_type, "index": int(index)}
        assert report["argv"] == ["x", "--flag"]
        assert f"[{name}] to stderr from {task_type} {index}" in out.splitlines()
    assert "chief-0 exited with status 3" in err
    assert_all_gone(pids(pid_dir))


def test_tf_config_cluster_token_and_environment(script, pid_dir, capsys, monkeypatch):
    monkeypatch.delenv("KUBEPS_JOB_TOKEN", raising=False)
    monkeypatch.delenv("KUBEPS_JOB_TOKEN_FILE", raising=False)
    spec = {"chief": {"wait_for": 5}, "default": FOREVER}  # every task reports before the chief ends
    code, out, _ = run_main(
        ["local", str(script), "--ps", "1", "--workers", "2", "--evaluator", "--evaluator-grace", "0", "--",
         str(pid_dir), json.dumps(spec)],
        capsys,
    )
    assert code == 0
    found = reports(out)
    assert set(found) == {"chief-0", "ps-0", "worker-0", "worker-1", "evaluator-0"}
    training = found["chief-0"]["cluster"]
    assert set(training) == {"chief", "ps", "worker"}  # the evaluator is never in the training cluster
    for name in ("ps-0", "worker-0", "worker-1"):
        assert found[name]["cluster"] == training
    evaluator_cluster = found["evaluator-0"]["cluster"]
    assert list(evaluator_cluster) == ["evaluator"] and len(evaluator_cluster["evaluator"]) == 1
    addresses = [a for v in training.values() for a in v] + evaluator_cluster["evaluator"]
    assert len(set(addresses)) == 5
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    tokens = {r["token"] for r in found.values()}
    assert len(tokens) == 1 and len(tokens.pop()) >= 16
    assert {r["unbuffered"] for r in found.values()} == {"1"}
    assert {r["bind_host"] for r in found.values()} == {"127.0.0.1"}
    assert_all_gone(pids(pid_dir))


def test_job_token_from_the_environment_is_kept_and_runs_differ(script, pid_dir, capsys, monkeypatch):
    spec = {"chief": {"wait_for": 2}, "default": FOREVER}
    monkeypatch.delenv("KUBEPS_JOB_TOKEN_FILE", raising=False)
    monkeypatch.delenv("KUBEPS_JOB_TOKEN", raising=False)
    seen = []
    for _ in range(2):
        _, out, _ = run_main(["local", str(script), "--ps", "1", "--workers", "1", "--", str(pid_dir), json.dumps(spec)], capsys)
        seen.append(reports(out)["chief-0"]["token"])
        for p in pid_dir.iterdir():
            p.unlink()
    assert seen[0] != seen[1]  # a fresh random token per run
    monkeypatch.setenv("KUBEPS_JOB_TOKEN", "a-token-set-by-the-user-0123")
    _, out, _ = run_main(["local", str(script), "--ps", "1", "--workers", "1", "--", str(pid_dir), json.dumps(spec)], capsys)
    assert {r["token"] for r in reports(out).values()} == {"a-token-set-by-the-user-0123"}


def test_chief_killed_by_a_signal_gives_128_plus_signal(script, pid_dir, capsys):
    spec = {"chief": {"kill": int(signal.SIGKILL)}, "default": FOREVER}
    code, _, err = run_main(["local", str(script), "--ps", "1", "--workers", "1", "--", str(pid_dir), json.dumps(spec)], capsys)
    assert code == 128 + signal.SIGKILL
    assert exit_status(-9) == 137 and exit_status(4) == 4
    assert_all_gone(pids(pid_dir))


def test_worker_dying_before_the_chief_is_reported(script, pid_dir, capsys):
    spec = {"chief": {"wait_for": 4, "sleep": 1.0, "exit": 0}, "worker-1": {"exit": 5}, "default": FOREVER}
    code, _, err = run_main(["local", str(script), "--ps", "1", "--workers", "2", "--", str(pid_dir), json.dumps(spec)], capsys)
    assert code == 0
    assert "worker-1" in err and "exited with status 5 before the chief" in err
    assert "worker-0 (pid" not in err  # the others were still running when the chief ended
    assert_all_gone(pids(pid_dir))


def test_task_ignoring_sigterm_is_killed_after_the_grace_period(script, pid_dir, capsys):
    spec = {"chief": {"exit": 0, "wait_for": 3}, "default": {"sleep": 600, "ignore_term": True}}
    started = time.monotonic()
    code, _, err = run_main(
        ["local", str(script), "--ps", "1", "--workers", "1", "--grace-period", "0.5", "--", str(pid_dir), json.dumps(spec)],
        capsys,
    )
    assert code == 0
    assert "did not stop within 0.5 s: SIGKILL" in err
    assert time.monotonic() - started < 30  # not the default 60 s grace, and no hang
    assert_all_gone(pids(pid_dir))


# -- no process left behind ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_launcher_stops_every_task(script, pid_dir, sig, status):
    spec = {"default": FOREVER}
    launcher = spawn_launcher(
        ["local", str(script), "--ps", "2", "--workers", "2", "--evaluator", "--", str(pid_dir), json.dumps(spec)]
    )
    try:
        task_pids = wait_for_pids(pid_dir, 6)
        assert all(alive(p) for p in task_pids.values())
        launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=20)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == status, err
    assert f"received {signal.Signals(sig).name}" in err
    assert_all_gone(task_pids)


def test_failing_chief_leaves_nothing_behind_as_a_subprocess(script, pid_dir):
    spec = {"chief": {"wait_for": 4, "exit": 1}, "default": FOREVER}
    launcher = spawn_launcher(["local", str(script), "--ps", "1", "--workers", "2", "--", str(pid_dir), json.dumps(spec)])
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 1, err
    task_pids = pids(pid_dir)
    assert len(task_pids) == 4
    assert_all_gone(task_pids)


# -- the supervision API (what --restart builds on) ---------------------------------------------------------------
def test_local_cluster_restarts_a_task_through_on_task_exit(script, pid_dir, tmp_path):
    restarted = []

    class Restarting(LocalCluster):
        def on_task_exit(self, task):
            super().on_task_exit(task)
            if not restarted:
                restarted.append(task.pid)
                self.start_task(task.task_type, task.index)

    # the chief ends once ps-0, worker-0, itself and worker-0 again have started (each after its REPORT)
    spec = {"chief": {"wait_starts": 4}, "worker-0": {"exit": 2, "sleep": 0.1}, "default": FOREVER}
    out = open(tmp_path / "out.txt", "w+")
    log = open(tmp_path / "log.txt", "w+")
    cluster = Restarting(str(script), [str(pid_dir), json.dumps(spec)], num_ps=1, num_workers=1, output=out, log=log)
    try:
        cluster.start()
        assert cluster.wait(timeout=30) == 0
    finally:
        cluster.stop()
    out.seek(0)
    log.seek(0)
    text = out.read()
    assert len(restarted) == 1
    assert text.count("[worker-0] REPORT") == 2  # the first run and the restart
    worker = cluster.tasks[("worker", 0)]
    assert worker.pid != restarted[0] and worker.reaped
    assert "exited with status 2 before the chief" in log.read()
    assert_all_gone({"ps-0": cluster.tasks[("ps", 0)].pid, "worker-0": worker.pid, "first": restarted[0]})


ORPHAN_SCRIPT = r"""
import json, os, subprocess, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
pid_dir = sys.argv[1]
name = f"{task['type']}-{task['index']}"
if name == "worker-0" and not os.path.exists(os.path.join(pid_dir, "grandchild")):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(pid_dir, ".grandchild"), "w") as f:
        f.write(str(child.pid))
    os.replace(os.path.join(pid_dir, ".grandchild"), os.path.join(pid_dir, "grandchild"))
    sys.exit(2)  # the worker dies, its child lives on in the worker's process group
with open(os.path.join(pid_dir, name), "w") as f:
    f.write(str(os.getpid()))
time.sleep(3 if name == "chief-0" else 600)
"""


def test_restarting_a_task_kills_what_its_previous_run_left_in_its_process_group(tmp_path, pid_dir):
    """A restarted task's previous process group was reaped without being signalled: a child the dead task had
    started lived on (and, once the group was reaped, no stop() could reach it any more)."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT)

    class Restarting(LocalCluster):
        def on_task_exit(self, task):
            super().on_task_exit(task)
            self.start_task(task.task_type, task.index)

    devnull = open(os.devnull, "w")
    cluster = Restarting(str(script), [str(pid_dir)], num_ps=1, num_workers=1, output=devnull, log=devnull)
    grandchild = None
    try:
        cluster.start()
        assert cluster.wait(timeout=30) == 0  # the chief runs 3 s; worker-0 dies and is restarted meanwhile
        found = wait_for_pids(pid_dir, 4)  # ps-0, chief-0, the grandchild and the restarted worker-0
        assert "worker-0" in found and cluster.tasks[("worker", 0)].running
        grandchild = found["grandchild"]
        deadline = time.monotonic() + 5
        while alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(grandchild), "the first worker's child survived its restart"
    finally:
        cluster.stop()
        devnull.close()
        if grandchild is not None and alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)

def test_local_cluster_start_task_checks(script, tmp_path):
    cluster = LocalCluster(str(script), num_ps=1, num_workers=1, output=open(os.devnull, "w"), log=open(os.devnull, "w"))
    with pytest.raises(LauncherError, match="has 1 'ps' task"):
        cluster.start_task("ps", 1)
    with pytest.raises(LauncherError, match="has 0 'evaluator' task"):
        cluster.start_task("evaluator", 0)
    assert cluster.task_keys() == [("ps", 0), ("worker", 0), ("chief", 0)]
    assert json.loads(cluster.tf_config("worker", 0))["task"] == {"type": "worker", "index": 0}
    cluster.stop()  # never started: nothing to do


def test_every_task_gets_a_metrics_port_of_its_own_unless_metrics_are_off(script, monkeypatch):
    monkeypatch.setenv("KUBEPS_METRICS_PORT", "9090")  # one port for every task would collide: each gets its own
    cluster = LocalCluster(str(script), num_ps=2, num_workers=1, evaluator=True, tls=False)
    ports = {key: cluster.task_settings(*key).metrics_port for key in cluster.task_keys()}
    assert None not in ports.values() and len(set(ports.values())) == len(ports) == 5 and 9090 not in ports.values()
    assert cluster.task_env("ps", 1)["KUBEPS_METRICS_PORT"] == str(ports[("ps", 1)])
    assert cluster.metrics_url("chief", 0) == f"http://127.0.0.1:{ports[('chief', 0)]}/metrics"
    off = LocalCluster(str(script), num_ps=1, num_workers=1, tls=False, metrics=False)
    assert all(off.task_settings(*key).metrics_port is None for key in off.task_keys())
    assert "KUBEPS_METRICS_PORT" not in off.task_env("worker", 0) and off.metrics_url("chief", 0) is None


def test_the_throw_away_tls_directory_goes_with_stop_or_with_the_cluster(script):
    """The CA and key a cluster makes for its tasks are removed by stop(), and by the cluster's collection when
    nothing stopped it (a cluster built only to look at its settings); a stopped cluster's second stop is a no-op."""
    import gc

    stopped = LocalCluster(str(script), num_ps=1, num_workers=1)
    directory = Path(stopped.tls_dir)
    assert sorted(p.name for p in directory.iterdir()) and oct(directory.stat().st_mode & 0o777) == "0o700"
    stopped.stop()
    assert not directory.exists()
    stopped.stop()
    dropped = LocalCluster(str(script), num_ps=1, num_workers=1)
    directory = Path(dropped.tls_dir)
    assert directory.is_dir()
    del dropped
    gc.collect()
    assert not directory.exists()
    assert LocalCluster(str(script), num_ps=1, num_workers=1, tls=False).tls_dir is None


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_ports_lie_below_the_ephemeral_range_where_connections_take_theirs():
    low = local_ports._ephemeral_low()
    if low is None or low - local_ports._LISTEN_FLOOR < 1001:
        pytest.skip(f"no room below this kernel's ephemeral range (from {low})")
    ports = free_ports(16) + free_port_runs(4, 3)
    assert all(local_ports._LISTEN_FLOOR <= p < low for p in ports), (low, ports)
    assert all(p + 2 < low for p in ports[16:])  # a run ends below the range too


def test_a_free_port_is_the_kernels_choice_without_room_below_the_range():
    s = local_ports._free_socket("127.0.0.1", local_ports._LISTEN_FLOOR + 500)
    try:
        assert s.getsockname()[1] > 0
    finally:
        s.close()
    assert local_ports._ephemeral_low("/nonexistent/ip_local_port_range") is None


def test_consecutive_ports_give_each_ps_task_a_run_of_its_own():
    """From a base, in the order chief, ps..., worker..., evaluator: a ps task of two server processes takes two."""
    base = free_port_runs(1, 7)[0]
    cluster = PortAllocator("127.0.0.1").cluster({"chief": 1, "ps": 2, "worker": 1, "evaluator": 1}, 2, base)
    assert cluster == {"chief": [f"127.0.0.1:{base}"], "ps": [f"127.0.0.1:{base + 1}", f"127.0.0.1:{base + 3}"],
                       "worker": [f"127.0.0.1:{base + 5}"], "evaluator": [f"127.0.0.1:{base + 6}"]}
    assert PortAllocator("::1").address(2222) == "[::1]:2222"


def test_scaling_refuses_a_bad_count_and_a_stopping_cluster(script):
    cluster = LocalCluster(str(script), num_ps=1, num_workers=1, tls=False, metrics=False,
                           output=open(os.devnull, "w"), log=open(os.devnull, "w"))
    for count in (0, True, 1.5):
        with pytest.raises(LauncherArgumentError, match="allowed is a number of workers >= 1"):
            cluster.scale_workers(count)
    cluster.stop()
    with pytest.raises(LauncherError, match="the cluster is stopping; not scaling"):
        cluster.scale_workers(2)
    assert cluster.cluster["worker"] and not cluster.tasks


# -- usage errors -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,message",
    [
        (["--ps", "0"], "--ps must be >= 1, got 0"),
        (["--workers", "0"], "--workers must be >= 1, got 0"),
        (["--workers", "two"], "--workers must be an integer >= 1, got 'two'"),
        (["--port-base", "70000"], "--port-base must be a port number in 1..65535, got 70000"),
        (["--port-base", "65534"], "--port-base must be in 1..65531 for 5 tasks, got 65534"),
        (["--host", "example.com"], "--host must be an IP address"),
        (["--grace-period", "-1"], "--grace-period must be a number of seconds >= 0"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["extra"], "unrecognized arguments: extra"),
        # the script's own flags without '--' before them
        (["--steps", "5"], "unrecognized arguments: --steps 5; arguments for the script go after '--': "
                           "kubeps local {script} [OPTIONS] -- --steps 5"),
    ],
)
def test_bad_local_arguments_exit_2_with_a_clear_message(script, capsys, args, message):
    code, _, err = run_main(["local", str(script), *args], capsys)
    assert code == 2
    assert message.format(script=script) in err


@pytest.mark.parametrize("kwargs,allowed", [
    ({"num_ps": 0}, "a number of parameter servers >= 1"),
    ({"num_workers": -1}, "a number of workers >= 1"),
    ({"grace_period": -0.5}, "a number of seconds >= 0"),
    ({"evaluator_grace": float("nan")}, "a number of seconds >= 0"),
    ({"num_ps": 2, "num_workers": 2, "port_base": 65534}, "a port in 1..65531: 5 tasks take consecutive ports"),
])
def test_local_cluster_errors_name_its_parameters_not_the_flags(script, kwargs, allowed):
    """The library speaks of its parameters; only ``kubeps local`` (above) words its errors with its flags."""
    field, value = list(kwargs.items())[-1]
    with pytest.raises(LauncherArgumentError) as info:
        LocalCluster(str(script), **kwargs)
    assert (info.value.field, str(info.value)) == (field, f"'{field}' has invalid value {value!r}: allowed is {allowed}")
    assert isinstance(info.value, LauncherError) and isinstance(info.value, RuntimeConfigError)


@pytest.mark.parametrize("fields,error,words", [
    ({"evaluator": 1}, LauncherArgumentError, "'evaluator' has invalid value 1: allowed is True or False"),
    ({"ps_processes": 0}, LauncherArgumentError,
     "'ps_processes' has invalid value 0: allowed is a number of server processes per ps task >= 1, or None"),
    ({"grace_period": float("inf")}, LauncherArgumentError, "allowed is a number of seconds >= 0"),
    ({"num_ps": "2"}, LauncherArgumentError, "allowed is a number of parameter servers >= 1"),
    ({"workers": 2}, TypeError, "unexpected argument 'workers'"),
])
def test_the_job_spec_refuses_in_the_dialects_words(script, fields, error, words):
    with pytest.raises(error, match=re.escape(words)):
        LocalJobSpec(script=str(script), settings=TaskSettings(), **fields)
    with pytest.raises(LauncherError, match="script file not found"):
        LocalJobSpec(script=str(script) + ".missing", settings=TaskSettings())


def test_a_cluster_built_from_a_spec_is_the_one_its_keyword_arguments_build(script, tmp_path):
    """``LocalCluster(spec)``: what the command builds; the keyword arguments build the same spec, the settings read
    from ``env``; a spec with options beside it is refused (they are its fields)."""
    env = {"KUBEPS_LOG_LEVEL": "DEBUG", "KUBEPS_JOB_TOKEN": "a-token-0123456789abcdef", "KEPT": "yes"}
    spec = LocalJobSpec(script=tmp_path / "task.py", script_args=[tmp_path, "x"], num_ps=1, num_workers=3,
                        evaluator=True, tls=False, metrics=False, settings=TaskSettings.from_env(env))
    assert spec.script == str(script) and spec.script_args == (str(tmp_path), "x")
    with LocalCluster(spec, env=env) as built, \
            LocalCluster(str(script), [str(tmp_path), "x"], num_ps=1, num_workers=3, evaluator=True, tls=False,
                         metrics=False, env=env) as given:
        assert given.spec == built.spec == spec
        assert {t: len(a) for t, a in built.cluster.items()} == {"chief": 1, "ps": 1, "worker": 3, "evaluator": 1}
        worker = built.task_env("worker", 2)
        assert (worker["KUBEPS_LOG_LEVEL"], worker["KUBEPS_JOB_TOKEN"], worker["KEPT"]) == (
            "DEBUG", "a-token-0123456789abcdef", "yes")
    with pytest.raises(TypeError, match="the spec's fields"):
        LocalCluster(spec, num_ps=2)


def test_port_base_counts_the_ps_processes_however_they_are_asked_for(script, capsys, monkeypatch):
    """Two server processes per ps task take two ports each: 7 ports for 2 ps and 2 workers, from the flag or from
    the environment's KUBEPS_PS_PROCESSES."""
    code, _, err = run_main(["local", str(script), "--ps-processes", "2", "--port-base", "65531"], capsys)
    assert code == 2 and "--port-base must be in 1..65529 for 7 tasks, got 65531" in err
    monkeypatch.setenv("KUBEPS_PS_PROCESSES", "2")
    code, _, err = run_main(["local", str(script), "--port-base", "65531"], capsys)
    assert code == 2 and "--port-base must be in 1..65529 for 7 tasks, got 65531" in err


def test_missing_or_directory_script(tmp_path, capsys):
    code, _, err = run_main(["local", str(tmp_path / "missing.py")], capsys)
    assert code == 2 and f"script file not found: {tmp_path / 'missing.py'}" in err
    code, _, err = run_main(["local", str(tmp_path)], capsys)
    assert code == 2 and "script must be a file, got a directory" in err
    code, _, err = run_main(["local"], capsys)
    assert code == 2 and "script" in err


def test_port_base_in_use(script, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = run_main(["local", str(script), "--ps", "1", "--workers", "1", "--port-base", str(port)], capsys)
    assert code == 2
    assert f"port {port} on 127.0.0.1 is not free" in err


def test_port_base_gives_consecutive_ports(script, pid_dir, capsys):
    base = free_ports(1)[0]
    spec = {"chief": {"wait_for": 3}, "default": FOREVER}
    for attempt in range(5):  # the range may be taken by someone else; try a few bases
        code, out, err = run_main(
            ["local", str(script), "--ps", "1", "--workers", "1", "--port-base", str(base), "--", str(pid_dir), json.dumps(spec)],
            capsys,
        )
        if code == 0:
            break
        assert "is not free" in err
        for p in pid_dir.iterdir():
            p.unlink()
        base = free_ports(1)[0]
    assert code == 0
    cluster = reports(out)["chief-0"]["cluster"]
    assert cluster == {
        "chief": [f"127.0.0.1:{base}"],
        "ps": [f"127.0.0.1:{base + 1}"],
        "worker": [f"127.0.0.1:{base + 2}"],
    }


def test_no_command_and_version(capsys):
    code, _, err = run_main([], capsys)
    assert code == 2 and "COMMAND" in err
    code, out, _ = run_main(["version"], capsys)
    assert code == 0 and out.startswith(f"kubeps {VERSION}")
    code, _, err = run_main(["version", "--", "x"], capsys)
    assert code == 2 and "only for 'kubeps local'" in err


# -- operator delegation ------------------------------------------------------------------------------------------
def test_operator_delegates_all_arguments(monkeypatch):
    import types

    calls = []
    fake = types.ModuleType("kubeps.operator.main")
    fake.main = lambda argv: calls.append(argv) or 4
    monkeypatch.setitem(sys.modules, "kubeps.operator.main", fake)
    assert cli.main(["operator", "--namespace", "x", "--", "y"]) == 4
    assert calls == [["--namespace", "x", "--", "y"]]


def test_operator_missing_says_what_to_install(monkeypatch, capsys):
    # None in sys.modules makes `from kubeps.operator.main import main` raise ImportError, as a missing kopf does
    monkeypatch.setitem(sys.modules, "kubeps.operator.main", None)
    assert cli.main(["operator"]) == 1
    assert "install kubeps[operator]" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "kubeps.runtime.cli", "version"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0 and result.stdout.startswith("kubeps ")


# -- the evaluator after a successful chief -----------------------------------------------------------------------
def test_evaluator_gets_a_grace_period_to_finish_after_the_chief(script, pid_dir, capsys):
    # the evaluator is still working (5 s) when the chief succeeds: plain `kubeps local` lets it finish
    spec = {"chief": {"wait_for": 4}, "evaluator": {"wait_for": 4, "sleep": 5, "exit": 0}, "default": FOREVER}
    args = ["local", str(script), "--ps", "1", "--workers", "1", "--evaluator"]
    code, _, err = run_main(args + ["--evaluator-grace", "30", "--", str(pid_dir), json.dumps(spec)], capsys)
    assert code == 0
    assert "waiting up to 30 s for the evaluator" in err
    assert "evaluator-0 (pid" in err and "exited with status 0" in err, err
    assert "stopping" in err and "evaluator-0" not in err.split("stopping", 1)[1].splitlines()[0]
    assert_all_gone(pids(pid_dir))


def test_evaluator_exiting_with_the_chief_is_still_reported(script, pid_dir, tmp_path):
    """Both exit before wait() looks: the chief's exit is handled first, the evaluator's still queued behind it."""
    spec = {"chief": {"wait_for": 4}, "evaluator": {"wait_for": 4, "sleep": 0.3}, "default": FOREVER}
    log = open(tmp_path / "log.txt", "w+")
    cluster = LocalCluster(str(script), [str(pid_dir), json.dumps(spec)], num_ps=1, num_workers=1, evaluator=True,
                           output=open(tmp_path / "out.txt", "w"), log=log)
    try:
        cluster.start()
        deadline = time.monotonic() + 30
        while any(cluster.tasks[k].running for k in (("chief", 0), ("evaluator", 0))):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert cluster.wait(timeout=30) == 0
    finally:
        cluster.stop()
    log.seek(0)
    assert re.search(r"evaluator-0 \(pid \d+\) exited with status 0", log.read())


def test_evaluator_grace_is_bounded_and_can_be_turned_off(script, pid_dir, capsys):
    spec = {"chief": {"wait_for": 4}, "evaluator": FOREVER, "default": FOREVER}
    args = ["local", str(script), "--ps", "1", "--workers", "1", "--evaluator"]
    started = time.monotonic()
    code, _, err = run_main(args + ["--evaluator-grace", "0.5", "--", str(pid_dir), json.dumps(spec)], capsys)
    assert code == 0 and time.monotonic() - started < 30  # not the default 60 s grace
    assert "the evaluator did not finish within" in err and "stopping" in err and "evaluator-0" in err
    assert_all_gone(pids(pid_dir))
    for p in pid_dir.iterdir():
        p.unlink()
    code, _, err = run_main(args + ["--evaluator-grace", "0", "--", str(pid_dir), json.dumps(spec)], capsys)
    assert code == 0 and "waiting up to" not in err
    assert_all_gone(pids(pid_dir))
    assert cli.build_parser().parse_args(["local", str(script)]).evaluator_grace == 60.0
    code, _, err = run_main(args + ["--evaluator-grace", "-1", "--", str(pid_dir), "{}"], capsys)
    assert code == 2 and "--evaluator-grace must be a number of seconds >= 0" in err


JOINED_SERVER = """
import os, signal, sys
from kubeps.runtime.cluster import ClusterSpec
from kubeps.runtime.server import Server

signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(143))  # as the runtime image's kubeps_pid1 does
server = Server(ClusterSpec({"worker": ["127.0.0.1:%d"]}), "worker", 0, allow_insecure=True)
# The kernel may hand a process-directed signal to any thread; make it one of gRPC's, never the main thread.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
print("joined", flush=True)
server.join()
"""


def test_a_joined_server_runs_its_sigterm_handler_whichever_thread_the_signal_hits():
    """A SIGTERM the kernel delivers to one of gRPC's threads only runs its Python handler once the main thread
    executes bytecode; ``join()`` waiting without a timeout held it off until the kubelet's SIGKILL, 30 s later
    (seen in the kind e2e: a deleted worker pod took 30.8 s to go)."""
    (port,) = free_ports(1)
    proc = subprocess.Popen([sys.executable, "-c", JOINED_SERVER % port], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "joined"
        time.sleep(0.5)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 143
        assert time.monotonic() - started < 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
