"""Every PSTrainingJob we ship runs a command that exists: the script is in the image's examples/ and accepts
the arguments the manifest gives it (a typo here only shows up as a crash-looping pod in the user's cluster)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted(p for p in (REPO / "examples").rglob("*.yaml") if "PSTrainingJob" in p.read_text())


def _commands(manifest):
    """(role, command) of every container that runs a kubeps runtime image (no image given: the default; or the
    Dockerfile's runtime-keras image, which holds examples/ too)."""
    for role, spec in manifest["spec"]["replicaSpecs"].items():
        for container in spec["template"]["spec"]["containers"]:
            if "image" not in container or container["image"].startswith("kubeps-runtime-keras:"):
                yield role, container.get("command", []) + container.get("args", [])


def test_there_are_manifests_to_check():
    assert any(p.name == "job.yaml" and p.parent.name == "ctr" for p in MANIFESTS)
    assert any(p.name == "job.yaml" and p.parent.name == "keras" for p in MANIFESTS)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(REPO)))
def test_manifest_commands_resolve(path):
    for role, command in _commands(yaml.safe_load(path.read_text())):
        if not command:  # the image's default command serves ps and worker tasks, nothing else
            assert role in ("PS", "Worker"), f"{path.name}: {role} needs a command; the image's default serves ps/worker"
            continue
        assert command[0] == "python", f"{path.name}: {role} runs {command[0]!r}; the images provide 'python'"
        script = REPO / command[1]
        assert script.is_file(), f"{path.name}: {role} runs {command[1]!r}, which is not in the repository"
        # Without TF_CONFIG the program parses its arguments and then either refuses to run or trains in-process;
        # a bad flag fails earlier, with argparse's usage message.
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        result = subprocess.run([sys.executable, *command[1:]], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=60)
        assert "usage:" not in result.stderr, f"{path.name}: {role}'s arguments are rejected:\n{result.stderr}"
        assert result.returncode == 0 or "TF_CONFIG" in result.stderr, result.stdout + result.stderr


def test_tensorboard_example_is_valid_and_the_viewer_reads_what_the_job_writes():
    """examples/jobs/tensorboard.yaml (claim + viewer) and the job's pod templates pass kubernetes-validate --strict;
    the chief and the evaluator write KUBEPS_LOGDIR on the claim, below the directory TensorBoard reads."""
    import kubernetes_validate

    from kubeps.runtime.contract import LOGDIR_ENV

    version = kubernetes_validate.latest_version()
    claim, viewer = yaml.safe_load_all((REPO / "examples" / "jobs" / "tensorboard.yaml").read_text())
    for obj in (claim, viewer):
        kubernetes_validate.validate(obj, version, strict=True)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    pod = viewer["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    read = command[command.index("--logdir") + 1]
    [mount] = pod["containers"][0]["volumeMounts"]
    assert {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]} == {mount["name"]: "ctr-shared"}

    job = yaml.safe_load((REPO / "examples" / "jobs" / "ctr-tensorboard-job.yaml").read_text())
    for role, spec in job["spec"]["replicaSpecs"].items():
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                    "template": spec["template"]}
        kubernetes_validate.validate(template, version, strict=True)
        container = spec["template"]["spec"]["containers"][0]
        logdir = {e["name"]: e["value"] for e in container.get("env", [])}.get(LOGDIR_ENV)
        assert (logdir is not None) == (role in ("Chief", "Evaluator")), role
        if logdir:
            claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["template"]["spec"]["volumes"]}
            mounted = [m for m in container["volumeMounts"] if logdir.startswith(m["mountPath"] + "/")]
            assert [claims[m["name"]] for m in mounted] == ["ctr-shared"], role
            # the same claim, mounted at the same path here and in the viewer: TensorBoard reads below `read`
            assert mounted[0]["mountPath"] == mount["mountPath"] and logdir.startswith(read + "/"), (logdir, read)
