"""The README stays true: its runtime example runs as written, and its set-up commands are the ones we run."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_readme_python_example_trains_under_kubeps_local(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) == 1, "the README has one runnable Python example"
    script = tmp_path / "quick.py"
    script.write_text(blocks[0])
    result = subprocess.run(
        [sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "2", "--workers", "2", "--grace-period", "2",
         str(script)],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(l for l in result.stdout.splitlines() if "[chief-0] w =" in l)
    # 200 SGD steps of (w - 1) * 2/8 * 0.1 from 0: w is close to 1; each of the 2 looked-up rows got 200 pushes
    # (a few more if a closure re-ran after a worker looked dead: execution is at-least-once).
    values = [float(v) for v in re.findall(r"-?\d+\.\d+", line.split("|")[0])]
    assert len(values) == 8 and all(0.95 < v <= 1.0 for v in values), line
    rows = [float(v) for v in re.findall(r"-?\d+(?:\.\d*)?", line.split("emb rows:")[1])]
    assert len(rows) == 2 and all(-20.61 < v < -19.99 for v in rows), line


def test_quick_start_commands_exist():
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = re.findall(r"^(make \w+)", quick, flags=re.M)
    assert commands == ["make example", "make test"]
    makefile = (REPO / "Makefile").read_text()
    for command in commands:
        assert re.search(rf"^{command.split()[1]}:", makefile, flags=re.M), command
    assert "make test" in (REPO / ".ci" / "run").read_text()
