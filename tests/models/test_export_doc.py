"""Every code block of docs/export.md runs: the install line names the extra pyproject declares, the two commands
train and export the Keras example, the serving program loads both artifacts where kubeps cannot be imported, and
the ``CheckpointReader`` program reads the checkpoint they came from."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
pytest.importorskip("jax")
pytest.importorskip("keras")
pytest.importorskip("jax2onnx")
pytest.importorskip("onnxruntime")

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "export.md"
#: makes `import kubeps` fail in the serving program, as on a serving host
NO_KUBEPS = """import sys
class _NoKubeps:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "kubeps":
            raise ImportError("no kubeps here")
sys.meta_path.insert(0, _NoKubeps())
"""


def blocks() -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```$", DOC.read_text(), re.M | re.S)


def test_the_install_line_names_the_export_extra():
    (lang, install), *_ = blocks()
    assert lang == "bash" and install.startswith("pip install 'kubeps[export]'")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["export"]
    assert "# " + ", ".join(extra) == "#" + install.split("#", 1)[1].rstrip("\n")
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert {"jax2onnx>=0.17.1", "onnx>=1.23", "onnxruntime>=1.31"} <= set(test_extra)  # CI runs the export tests


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_doc_commands_and_programs_run(tmp_path):
    kinds = [lang for lang, _ in blocks()]
    assert kinds == ["bash", "bash", "python", "python"], kinds
    (_, _), (_, commands), (_, serving), (_, reading) = blocks()

    def here(text: str) -> str:
        return text.replace("/tmp/ctr-keras", str(tmp_path / "ckpt")).replace("/tmp/ctr-serving", str(tmp_path / "out"))

    for line in here(commands).splitlines():
        args = line.split()
        assert args[0] == "kubeps", line
        done = subprocess.run([sys.executable, "-m", "kubeps.runtime.cli", *args[1:]], cwd=ROOT, capture_output=True,
                              text=True, timeout=400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    fresh = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}  # a serving host's shell: the snippet sets it
    done = subprocess.run([sys.executable, "-c", NO_KUBEPS + here(serving)], capture_output=True, text=True,
                          timeout=300, env=fresh)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "'Embedding'" in done.stdout and "KubepsEmbedding" not in done.stdout, done.stdout
    assert "click probabilities" in done.stdout

    done = subprocess.run([sys.executable, "-c", here(reading)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "step 100 final True" in out, out
    assert re.search(r"model/embedding/embeddings: shape \[65536, 8\] float32, 2 slice\(s\), slots \['accumulator ",
                     out), out
