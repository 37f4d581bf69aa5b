#!/usr/bin/env python3
"""Run mypy on kubeps as it is imported: ``hack/mypy.py -p kubeps.operator`` (any mypy arguments).

pyproject.toml maps ``kubeps.operator`` to operator/ and ``kubeps.runtime`` to runtime/ (setuptools' package-dir), and
the editable install resolves that with an import hook, which mypy does not run. So this links
``build/mypy-path/kubeps/{operator,runtime}`` to the two source roots (the ``mypy_path`` of pyproject's
``[tool.mypy]``), then runs the mypy beside this Python with the arguments given. Once the links exist, plain
``mypy -p kubeps.operator`` from the repository root works as well.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINKS = ROOT / "build" / "mypy-path" / "kubeps"
SOURCE_ROOTS = {"operator": ROOT / "operator", "runtime": ROOT / "runtime"}


def link_source_roots() -> Path:
    """Create (or repair) the links; returns the folder to put on mypy's path."""
    LINKS.mkdir(parents=True, exist_ok=True)
    for name, target in SOURCE_ROOTS.items():
        link = LINKS / name
        relative = Path(os.path.relpath(target, LINKS))
        if link.is_symlink() and Path(os.readlink(link)) == relative:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(relative, target_is_directory=True)
    return LINKS.parent


def main(argv: list[str]) -> int:
    link_source_roots()
    mypy = Path(sys.executable).parent / "mypy"
    command = [str(mypy)] if mypy.exists() else [sys.executable, "-m", "mypy"]
    return subprocess.call([*command, *(argv or ["-p", "kubeps.operator"])], cwd=ROOT)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
