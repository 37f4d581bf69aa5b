"""``kubeps local --restart`` restarts a failed worker, as the operator would; without it the worker stays dead."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path

    state = Path(sys.argv[1])
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    if task["type"] == "worker":
        marker = state / "crashed-once"
        if not marker.exists():
            marker.write_text("x")
            sys.exit(1)  # the first incarnation dies, as a preempted pod would
        (state / "worker-restarted").write_text(str(os.getpid()))
        time.sleep(60)
    elif task["type"] == "chief":
        deadline = time.monotonic() + float(sys.argv[2])
        while time.monotonic() < deadline:
            if (state / "worker-restarted").exists():
                print("worker came back")
                sys.exit(0)
            time.sleep(0.1)
        print("worker never came back")
        sys.exit(3)
    else:
        time.sleep(60)
    """
)


def _run(tmp_path, *flags, wait_s="20"):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "kubeps.runtime.cli", "local", *flags, "--ps", "1", "--workers", "1",
           "--grace-period", "1", str(script), "--", str(tmp_path), wait_s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def test_restart_brings_a_failed_worker_back(tmp_path):
    result = _run(tmp_path, "--restart")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[chief-0] worker came back" in result.stdout


def test_without_restart_a_failed_worker_stays_down(tmp_path):
    result = _run(tmp_path, wait_s="3")
    assert result.returncode == 3, result.stdout + result.stderr
    assert not (tmp_path / "worker-restarted").exists()


def test_help_documents_restart():
    out = subprocess.run([sys.executable, "-m", "kubeps.runtime.cli", "local", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--restart" in out and "latest checkpoint" in out
