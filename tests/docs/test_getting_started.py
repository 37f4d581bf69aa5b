"""docs/getting-started.md works as written: the built wheel installed into a fresh venv, then the page's commands.

The wheel is built from this tree (``pip wheel --no-deps``, as the page says). The page's shell blocks run in
order with bash in an empty directory holding it under ``dist/``, and its Python block is saved as the file the
page names. One shortcut keeps the test fast and offline: right after ``python3 -m venv`` makes the fresh venv, a
``.pth`` file gives it this environment's installed dependencies (every distribution but kubeps, through a
directory of links), so ``pip install`` of the wheel finds them satisfied instead of downloading them; kubeps
itself comes from the wheel only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "getting-started.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)

pytestmark = pytest.mark.slow


def page_blocks() -> list[tuple[str, str]]:
    """(language, code) of the page's install and run blocks, in order (the clone's `make` block excluded)."""
    text = PAGE.read_text().split("## From a clone of the repository", 1)[0]
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(text)]


def _dependencies_without_kubeps(where: Path) -> Path:
    site = Path(sysconfig.get_paths()["purelib"])
    where.mkdir()
    for entry in site.iterdir():
        if entry.name.lower().startswith(("kubeps", "__editable__")) or entry.suffix == ".pth":
            continue
        (where / entry.name).symlink_to(entry)
    return where


@pytest.mark.timeout(600)
def test_getting_started_works_as_written(tmp_path: Path) -> None:
    blocks = page_blocks()
    assert [language for language, _ in blocks] == ["sh", "python", "sh"], blocks
    work = tmp_path / "user"
    (work / "dist").mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(work / "dist"), str(REPO)], check=True, capture_output=True, timeout=300)
    install, program, run = (code for _, code in blocks)
    saved_as = re.search(r"Save this as `([\w.]+)`", PAGE.read_text())
    assert saved_as, "the page names the file its program is saved as"
    (work / saved_as.group(1)).write_text(program)
    deps = _dependencies_without_kubeps(tmp_path / "deps")

    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "TF_CONFIG", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(sys.prefix))  # no kubeps but the page's venv
    env["PIP_NO_INDEX"] = "1"  # nothing is downloaded: a dependency missing here fails instead
    venv_line, *rest = install.strip().splitlines()
    assert venv_line.startswith("python3 -m venv "), venv_line
    venv = work / venv_line.split()[-1]
    subprocess.run(["bash", "-euo", "pipefail", "-c", venv_line], cwd=work, env=env, check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "kubeps-test-dependencies.pth").write_text(f"{deps}\n")

    installed = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(rest)], cwd=work, env=env,
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    version = subprocess.run([sys.executable, "-c", "import kubeps.runtime as kp; print(kp.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert installed.stdout.strip().endswith(f"kubeps {version}"), installed.stdout
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import kubeps.runtime; print(kubeps.runtime.__file__)"],
                           capture_output=True, text=True, check=True, env=env).stdout
    assert where.startswith(str(venv)), f"kubeps came from {where}, not the wheel installed in the page's venv"

    trained = subprocess.run(["bash", "-euo", "pipefail", "-c", run], cwd=work, env=env, capture_output=True,
                             text=True, timeout=300)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "[chief-0] w = [1. 2. 3. 4.]" in trained.stdout, trained.stdout[-3000:]
