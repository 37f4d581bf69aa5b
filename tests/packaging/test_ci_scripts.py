"""The kind e2e script and the GitHub workflow: linted (shellcheck, actionlint) and wired together."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import find_tool

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "kind-e2e.sh"
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.y*ml"))


def test_shellcheck_clean():
    shellcheck = find_tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed: apt-get install -y shellcheck")
    proc = subprocess.run([shellcheck, "-x", "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_clean():
    actionlint = find_tool("actionlint")
    if actionlint is None:
        pytest.skip("actionlint not installed: go install github.com/rhysd/actionlint/cmd/actionlint@v1.7.12")
    args = [actionlint]
    if find_tool("shellcheck"):
        args += ["-shellcheck", find_tool("shellcheck")]
    proc = subprocess.run([*args, *map(str, WORKFLOWS)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_script_parses_and_explains_itself():
    assert os.access(SCRIPT, os.X_OK)
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    proc = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0 and "--install helm|manifests" in proc.stdout
    # Bad arguments fail before anything is created.
    proc = subprocess.run([str(SCRIPT), "--install", "tarball"], capture_output=True, text=True, timeout=10)
    assert proc.returncode != 0 and "--install must be helm or manifests" in proc.stderr
    proc = subprocess.run([str(SCRIPT), "--frobnicate"], capture_output=True, text=True, timeout=10)
    assert proc.returncode != 0 and "unknown argument" in proc.stderr


def test_script_deletes_its_cluster_and_reports_on_failure():
    text = SCRIPT.read_text()
    assert "trap cleanup EXIT" in text and "kind delete cluster" in text
    # On failure: the job's status and every pod's logs.
    assert "get psjob" in text and "logs" in text and "diagnose" in text


def test_workflow_runs_the_e2e_for_both_installs_and_the_suite():
    (workflow,) = [w for w in WORKFLOWS if w.stem == "e2e"]
    doc = yaml.safe_load(workflow.read_text())
    job = doc["jobs"]["kind"]
    assert job["strategy"]["matrix"]["install"] == ["helm", "manifests"]
    runs = "\n".join(step.get("run", "") for step in job["steps"])
    assert "hack/kind-e2e.sh --install helm --pytest" in runs
    assert "pip install -e '.[operator,test]'" in runs
    assert doc["permissions"] == {"contents": "read"}


def test_e2e_job_is_small_enough_for_a_ci_runner():
    job = yaml.safe_load((REPO / "examples" / "ctr" / "job.yaml").read_text())
    cpu = 0.0
    for spec in job["spec"]["replicaSpecs"].values():
        for container in spec["template"]["spec"]["containers"]:
            request = container["resources"]["requests"]["cpu"]
            cpu += spec["replicas"] * (float(request[:-1]) / 1000 if request.endswith("m") else float(request))
    assert cpu <= 1.5, f"the e2e job requests {cpu} CPUs; a GitHub runner has 2 (and kind's system pods)"
