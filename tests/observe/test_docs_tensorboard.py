"""docs/tensorboard.md stays true: its commands and its program run as written, and TensorBoard serves the runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("tensorboardX")

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "tensorboard.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", DOC, flags=re.S)


def test_the_doc_has_the_blocks_run_here():
    assert [lang for lang, _ in BLOCKS] == ["sh", "python"]


def test_the_program_writes_train_scalars_to_kubeps_logdir(tmp_path, read_scalars):
    script = tmp_path / "program.py"
    script.write_text(BLOCKS[1][1])
    env = {**os.environ, "KUBEPS_LOGDIR": str(tmp_path / "logs" / "train")}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"wrote {tmp_path / 'logs' / 'train'}" in result.stdout
    scalars = read_scalars(tmp_path / "logs" / "train")
    assert [s for s, _ in scalars["loss"]] == [20, 40, 60, 80, 100]
    assert [s for s, _ in scalars["global_step/sec"]] == [20, 40, 60, 80, 100]
    assert [s for s, _ in scalars["examples/sec"]] == [20, 40, 60, 80, 100]
    assert scalars["learning_rate"] == [(100, pytest.approx(0.1))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_local_commands_train_and_tensorboard_serves_both_runs(tmp_path, read_scalars):
    train_line, tensorboard_line = BLOCKS[0][1].strip().splitlines()
    paths = {"/tmp/ctr-ckpt": str(tmp_path / "ckpt"), "/tmp/ctr-logs": str(tmp_path / "logs")}
    for old, new in paths.items():
        train_line, tensorboard_line = train_line.replace(old, new), tensorboard_line.replace(old, new)
    argv = shlex.split(train_line)
    assert argv[0] == "kubeps"
    result = subprocess.run([sys.executable, "-m", "kubeps.runtime.cli", *argv[1:]], cwd=REPO, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {"loss", "global_step/sec", "examples/sec"} == set(read_scalars(tmp_path / "logs" / "train"))
    assert {"logloss", "auc", "gap_pct"} == set(read_scalars(tmp_path / "logs" / "eval"))

    argv = shlex.split(tensorboard_line)
    tensorboard = shutil.which("tensorboard", path=os.path.dirname(sys.executable))
    if tensorboard is None:
        pytest.skip("the tensorboard command is not installed (pip install tensorboard)")
    port = _free_port()
    argv = [tensorboard, *argv[1:argv.index("--port")], "--port", str(port), "--host", "127.0.0.1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        runs: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sorted(runs) != ["eval", "train"]:
            time.sleep(1)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=5) as response:
                    runs = json.load(response)
            except OSError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert sorted(runs) == ["eval", "train"], runs
    finally:
        proc.terminate()
        proc.wait(timeout=20)
