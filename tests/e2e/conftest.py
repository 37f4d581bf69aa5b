"""End-to-end tests with real pods: a kind cluster (hack/kind.sh), the project's images, the Helm chart.

Every test here gets the ``e2e`` marker and is skipped unless ``KUBEPS_E2E=1`` (``make e2e`` sets it; so does
``.ci/run``): ``make test`` alone stays the fast kwok suite. The session fixture ``kind`` builds (cached) and
starts the cluster while it builds the runtime, runtime-keras and operator images (``hack/kind.sh up --images``
with ``KUBEPS_KIND_KERAS_IMAGE=1``), loads them, installs the operator with Helm, and at the end runs
``hack/kind.sh down`` (``KUBEPS_E2E_KEEP=1`` keeps the cluster for a look around; ``KUBECONFIG`` is then printed by
``hack/kind.sh env``). Timings (cluster create, pods Running after a job is created, replacement pod Running after
a delete) are appended to ``$KUBEPS_E2E_TIMINGS`` (default ``/tmp/kubeps-e2e-timings.jsonl``).

Most of the suite's time is waiting on the cluster, so what only waits starts before the first test: the marker
``start_early`` (a job that waits out its deadline, the TensorFlow and Kueue image loads in the background) and
``run_early`` (a short test's body run in a thread beside the other such tests, each in its own namespace). Each
test still makes its own assertions and fails on its own; the tests that delete pods mid-training, stop or drain
nodes or restart the operator wait for what could disturb them first (``Kind.settle``).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import threading
import subprocess
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
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
    config.addinivalue_line(
        "markers", "start_early(starter): starter(kind) runs once the cluster is up, before the first test, for a "
                   "test that mostly waits (a job's deadline, an image load); the test gets what it returned from "
                   "kind.started(starter)")


def record(name: str, seconds: float, **extra: Any) -> None:
    line = {"name": name, "seconds": round(seconds, 2), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **extra}
    with TIMINGS.open("a") as f:
        f.write(json.dumps(line) + "\n")
    print(f"[timing] {name}: {seconds:.1f} s")


#: set when the session ends: a scenario still running in a thread (run_early) stops waiting
CLOSING = threading.Event()


def wait(cond: Callable[[], Any], timeout: float, what: str, interval: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if CLOSING.is_set():
            raise AssertionError(f"the session ended while waiting for {what}")
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


class Background:
    """A command started before the first test (see the ``start_early`` marker), its output in ``log``: its time
    overlaps the tests that run before the one that needs it."""

    def __init__(self, what: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.what, self.log = what, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.took: float | None = None
        self._reaper = threading.Thread(target=self._reap, daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        self.proc.wait()
        self.took = time.monotonic() - self.start

    def wait(self, timeout: float) -> float:
        """Wait for it; fail with its output if it failed. Returns how long it ran (from its start to its end)."""
        rc = self.proc.wait(timeout=timeout)
        self._reaper.join(timeout=10)
        print(self.log.read_text()[-3000:])
        assert rc == 0, f"{self.what} failed (exit {rc}), see {self.log}"
        return self.took if self.took is not None else time.monotonic() - self.start

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)


@dataclass
class Kind:
    env: dict[str, str]
    log: list[str] = field(default_factory=list)
    #: what the ``start_early`` starters returned, by the starter's name
    early: dict[str, Any] = field(default_factory=dict)
    #: the threads of the run_early tests: two of their jobs at a time (each asks 0.8-0.9 CPU of the workers' 4, the
    #: early missing-image job 0.8 until its deadline; more at once only slow each other down on a 2-core machine)
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="e2e"))

    def background(self, what: str, *cmd: str) -> Background:
        logs = Path(self.env["KUBECONFIG"]).with_name("logs")
        return Background(what, list(cmd), self.env, logs / (what.replace(" ", "-") + ".log"))

    def started(self, starter: Callable[[Kind], Any]) -> Any:
        """What ``starter`` (a ``start_early`` argument) returned before the first test; started now if it was not
        (a test run on its own)."""
        if starter.__name__ not in self.early:
            self.early[starter.__name__] = starter(self)
        return self.early[starter.__name__]

    def settle(self, *, loads: bool = True) -> None:
        """Wait for every run_early test and background command still running (before a test that stops or drains
        a node, or changes the operator): their outcome is their own tests' business. ``loads=False``: only for the
        run_early tests, not for the background image loads."""
        for value in list(self.early.values()):
            if isinstance(value, Background) and loads:
                value.proc.wait(timeout=1800)
            elif isinstance(value, Future):
                value.exception(timeout=3600)

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
def kind(request: pytest.FixtureRequest) -> Kind:
    """A kind cluster with the operator installed by Helm from the locally built image."""
    env = _kind_env()
    keep = os.environ.get("KUBEPS_E2E_KEEP") == "1"
    record("kind.sh build", _step("hack/kind.sh build", str(KIND_SH), "build", env=env, timeout=3600))
    k = Kind(env)
    try:
        # The runtime, runtime-keras and operator images are built while kind creates the cluster, then loaded in
        # one archive (runtime-keras is the runtime image and one layer more: loaded here, not during the tests,
        # where its 600 MB slowed the tests beside it).
        record("kind.sh up --images (cluster, image build and load)",
               _step("hack/kind.sh up --images", str(KIND_SH), "up", "--images",
                     env={**env, "KUBEPS_KIND_KERAS_IMAGE": "1"}, timeout=1800))
        for name, file in (("kind create cluster", "create-seconds"),
                           ("kind load (operator + runtime + runtime-keras)", "load-seconds")):
            path = Path(env["KUBECONFIG"]).with_name(file)
            if path.exists():
                record(name, float(path.read_text()))
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
        # What the selected tests start early (a job that waits out its deadline, an image to load), in test order.
        for item in request.session.items:
            for marker in item.iter_markers("start_early"):
                k.started(marker.args[0])
        yield k
    finally:
        CLOSING.set()
        k.pool.shutdown(wait=True, cancel_futures=True)
        for value in list(k.early.values()):
            if isinstance(value, Background):
                value.stop()
        if not keep:
            start = time.monotonic()
            subprocess.run([str(KIND_SH), "down"], env=env, timeout=300)
            record("kind.sh down", time.monotonic() - start)


def new_namespace(kind: Kind, test: str) -> str:
    name = f"e2e-{test[5:25].replace('_', '-').strip('-')}-{uuid.uuid4().hex[:4]}".lower()
    kind.kubectl("create", "namespace", name)
    return name


def run_early(body: Callable[[Kind, str], None]) -> Callable[..., None]:
    """A test whose body ``body(kind, ns)`` runs in a thread of ``kind.pool``, submitted before the first test
    (``start_early``) with a namespace of its own, beside the other such tests: their jobs are independent, so their
    waits (pods starting, training, deadlines) overlap. The test waits for its body and fails as the body failed
    (the same assertions, the same traceback). Only for tests that leave the nodes, the operator and cluster-wide
    objects alone; the tests that do not (test_nodes.py, Kueue) call ``kind.settle()`` first."""

    def start(kind: Kind) -> Future:
        return kind.pool.submit(_run_in_namespace, kind, body)

    start.__name__ = f"run_{body.__name__}"

    def test(kind: Kind) -> None:
        kind.started(start).result(timeout=3600)

    test.__name__, test.__qualname__, test.__doc__ = body.__name__, body.__qualname__, body.__doc__
    test.__module__ = body.__module__
    return pytest.mark.start_early.with_args(start)(test)


def _run_in_namespace(kind: Kind, body: Callable[[Kind, str], None]) -> None:
    ns = new_namespace(kind, body.__name__)
    try:
        body(kind, ns)
    except BaseException:
        if not CLOSING.is_set():
            kind.diagnose(ns)
        raise
    finally:
        kind.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture
def ns(kind: Kind, request: pytest.FixtureRequest):
    name = new_namespace(kind, request.node.name)
    yield name
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        kind.diagnose(name)
    kind.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
