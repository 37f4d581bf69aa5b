"""End-to-end tests with real pods: a kind cluster (hack/kind.sh), the project's images, the Helm chart.

Every test here gets the ``e2e`` marker and is skipped unless ``KUBEPS_E2E=1`` (``make e2e`` sets it; so does
``.ci/run``): ``make test`` alone stays the fast kwok suite. The session fixture ``kind`` builds (cached) and
starts the cluster, builds and loads the runtime and operator images, installs the operator with Helm, and at the
end uninstalls it and runs ``hack/kind.sh down`` (``KUBEPS_E2E_KEEP=1`` keeps the cluster for a look around;
``KUBECONFIG`` is then printed by ``hack/kind.sh env``). Timings (cluster create, pods Running after a job is
created, replacement pod Running after a delete) are appended to ``$KUBEPS_E2E_TIMINGS`` (default
``/tmp/kubeps-e2e-timings.jsonl``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
KIND_SH = REPO / "hack" / "kind.sh"
NAMESPACE = "kubeps-system"
RELEASE = "kubeps"
TIMINGS = Path(os.environ.get("KUBEPS_E2E_TIMINGS", "/tmp/kubeps-e2e-timings.jsonl"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="end-to-end on kind: KUBEPS_E2E=1 (make e2e)")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
            # The first test also waits for the session fixture: cluster, images, operator (cached: ~2 min).
            item.add_marker(pytest.mark.timeout(3600))
            if os.environ.get("KUBEPS_E2E") != "1":
                item.add_marker(skip)
    # `test_zz_*` (helm uninstall) runs last, after the tests of every file.
    items.sort(key=lambda item: item.name.startswith("test_zz_"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: real pods on a kind cluster (hack/kind.sh); KUBEPS_E2E=1 to run")


def record(name: str, seconds: float, **extra: Any) -> None:
    line = {"name": name, "seconds": round(seconds, 2), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **extra}
    with TIMINGS.open("a") as f:
        f.write(json.dumps(line) + "\n")
    print(f"[timing] {name}: {seconds:.1f} s")


def wait(cond: Callable[[], Any], timeout: float, what: str, interval: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            value = cond()
        except subprocess.CalledProcessError as err:  # not yet
            last = err.stderr or err
            value = None
        if value:
            return value
        last = value if value is not None else last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


@dataclass
class Kind:
    env: dict[str, str]
    log: list[str] = field(default_factory=list)

    def run(self, *args: str, check: bool = True, timeout: float = 120, stdin: str | None = None) -> str:
        proc = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout,
                              input=stdin)
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, args, proc.stdout, proc.stderr)
        return proc.stdout

    def kubectl(self, *args: str, **kw: Any) -> str:
        return self.run("kubectl", *args, **kw)

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def helm(self, *args: str, **kw: Any) -> str:
        return self.run("helm", *args, **kw)

    # ---- PSTrainingJobs
    def apply(self, namespace: str, manifest: dict | str) -> None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        self.kubectl("-n", namespace, "apply", "-f", "-", stdin=text)

    def conditions(self, namespace: str, job: str) -> dict[str, dict]:
        obj = self.json("-n", namespace, "get", "psjob", job)
        return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}

    def true_conditions(self, namespace: str, job: str) -> set[str]:
        return {t for t, c in self.conditions(namespace, job).items() if c.get("status") == "True"}

    def pods(self, namespace: str, job: str) -> list[dict]:
        return self.json("-n", namespace, "get", "pods", "-l", f"kubeps.dev/job-name={job}")["items"]

    def wait_finished(self, namespace: str, job: str, timeout: float = 600) -> str:
        def done() -> str | None:
            true = self.true_conditions(namespace, job)
            return "Succeeded" if "Succeeded" in true else "Failed" if "Failed" in true else None
        try:
            return wait(done, timeout, f"psjob {job} to finish", interval=2)
        except AssertionError:
            self.diagnose(namespace)
            raise

    def logs(self, namespace: str, pod: str, previous: bool = False) -> str:
        args = ["-n", namespace, "logs", pod, "--all-containers"]
        if previous:
            args.append("--previous")
        return self.kubectl(*args, check=False)

    def diagnose(self, namespace: str) -> None:
        for args in (["get", "psjob,pods,pvc", "-o", "wide"], ["get", "events", "--sort-by=.lastTimestamp"]):
            print(self.kubectl("-n", namespace, *args, check=False))
        for pod in self.kubectl("-n", namespace, "get", "pods", "-o", "name", check=False).split():
            print(f"---- {pod}\n" + self.kubectl("-n", namespace, "logs", pod, "--all-containers", "--tail=40",
                                                 check=False))
        print(self.kubectl("-n", NAMESPACE, "logs", "deploy/kubeps", "--tail=60", check=False))


def _kind_env() -> dict[str, str]:
    env = dict(os.environ)
    out = subprocess.run([str(KIND_SH), "env"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        for word in shlex.split(line.removeprefix("export ")):
            key, _, value = word.partition("=")
            env[key] = value.replace("$PATH", env.get("PATH", ""))
    cp_bin = subprocess.run([str(REPO / "hack" / "controlplane.sh"), "bin-dir"], capture_output=True, text=True,
                            check=True).stdout.strip()
    env["PATH"] = env["PATH"] + ":" + cp_bin  # kubectl of the pinned release, when none is installed
    return env


def _on_the_control_plane(env: dict[str, str]) -> list[str]:
    """Helm arguments that put the operator on the control-plane node of a cluster with workers: the node tests
    (test_nodes.py) stop and drain workers, and an operator on a lost node would be lost with it (docs/nodes.md
    says what users do: two replicas with peering)."""
    if env.get("KUBEPS_KIND_WORKERS", "0") == "0":
        return []
    role = "node-role.kubernetes.io/control-plane"
    return ["--set-json", "nodeSelector=" + json.dumps({role: ""}),
            "--set-json", "tolerations=" + json.dumps([{"key": role, "operator": "Exists", "effect": "NoSchedule"}])]


def _step(what: str, *cmd: str, env: dict[str, str], timeout: float) -> float:
    start = time.monotonic()
    proc = subprocess.run(list(cmd), env=env, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed ({shlex.join(cmd)}, exit {proc.returncode})")
    return time.monotonic() - start


@pytest.fixture(scope="session")
def kind() -> Kind:
    """A kind cluster with the operator installed by Helm from the locally built image."""
    env = _kind_env()
    keep = os.environ.get("KUBEPS_E2E_KEEP") == "1"
    record("kind.sh build", _step("hack/kind.sh build", str(KIND_SH), "build", env=env, timeout=3600))
    try:
        record("kind.sh up", _step("hack/kind.sh up", str(KIND_SH), "up", env=env, timeout=900))
        created = Path(env["KUBECONFIG"]).with_name("create-seconds")
        if created.exists():
            record("kind create cluster", float(created.read_text()))
        record("kind.sh images (build + kind load)", _step("hack/kind.sh images", str(KIND_SH), "images", env=env,
                                                            timeout=1800))
        k = Kind(env)
        start = time.monotonic()
        out = k.helm("upgrade", "--install", RELEASE, str(REPO / "charts" / "kubeps"), "--namespace", NAMESPACE,
               "--create-namespace", "--set", "image.repository=kubeps-operator", "--set", "image.tag=e2e",
               "--set", "image.pullPolicy=Never", "--set", "runtimeImage.repository=kubeps-runtime",
               "--set", "runtimeImage.tag=e2e", *_on_the_control_plane(env), "--wait", "--timeout", "180s",
               timeout=240)
        if "has been upgraded" in out:
            # A kept cluster (KUBEPS_E2E_KEEP=1) and a rebuilt image of the same tag: the Deployment did not change,
            # so its pod would go on running the old image.
            k.kubectl("-n", NAMESPACE, "rollout", "restart", "deployment", "-l", f"app.kubernetes.io/instance={RELEASE}")
            k.kubectl("-n", NAMESPACE, "rollout", "status", "deployment", "-l", f"app.kubernetes.io/instance={RELEASE}",
                      "--timeout=120s", timeout=150)
        record("helm install (operator Ready)", time.monotonic() - start)
        yield k
    finally:
        if not keep:
            subprocess.run([str(KIND_SH), "down"], env=env, timeout=300)


@pytest.fixture
def ns(kind: Kind, request: pytest.FixtureRequest):
    name = f"e2e-{request.node.name[5:25].replace('_', '-').strip('-')}-{uuid.uuid4().hex[:4]}".lower()
    kind.kubectl("create", "namespace", name)
    yield name
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        kind.diagnose(name)
    kind.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
