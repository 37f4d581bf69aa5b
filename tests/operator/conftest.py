"""Fixtures for the operator's integration tests on the real control plane (``kube`` from tests/conftest.py).

``operator`` (session): the CRD applied and one operator subprocess (``python -m kubeps.operator.main``) watching
the namespaces that match ``kop-*``. ``ns`` (function): a fresh ``kop-`` namespace. Tests that stop and start
their own operator use :class:`OperatorProcess` on a namespace outside that pattern.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
import warnings
from pathlib import Path

import pytest

from kubeps.runtime.local.launcher import free_ports

from . import kueue_cluster

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "kubeps.dev", "v1alpha1", "pstrainingjobs"
NS_PREFIX = "kop-"


class OperatorProcess:
    """The operator as a subprocess on loopback; stopped by its own PID only."""

    def __init__(self, kube, namespaces: list[str], log_path: Path, extra_args: list[str] | None = None,
                 kopf_cli: bool = False, extra_env: dict[str, str] | None = None):
        self.kube = kube
        self.namespaces = namespaces
        self.log_path = log_path
        self.extra_args = extra_args or []
        self.kopf_cli = kopf_cli  # `kopf run -m kubeps.operator.controller.handlers` instead of `kubeps operator`
        self.extra_env = dict(extra_env or {})
        self.proc: subprocess.Popen | None = None
        self.metrics_port, self.liveness_port = free_ports(2)  # held together: never the same port twice

    def start(self, wait: bool = True) -> "OperatorProcess":
        env = dict(self.kube.env, PYTHONUNBUFFERED="1", **self.extra_env)
        if self.kopf_cli:  # our settings from the environment, kopf's from its own flags
            env["KUBEPS_DEFAULT_IMAGE"] = "registry.test/kubeps-runtime:test"
            args = [sys.executable, "-m", "kopf", "run", "-m", "kubeps.operator.controller.handlers",
                    f"--liveness=http://127.0.0.1:{self.liveness_port}/healthz", *self.extra_args]
        else:
            args = [sys.executable, "-m", "kubeps.operator.main", "--bind-address", "127.0.0.1",
                    "--metrics-port", str(self.metrics_port), "--liveness-port", str(self.liveness_port),
                    "--default-image", "registry.test/kubeps-runtime:test", *self.extra_args]
        for namespace in self.namespaces:
            args += ["--namespace", namespace]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"operator not live after {timeout}s:\n{self.log_tail()}")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as resp:
            return resp.read().decode()

    def kill(self) -> None:
        """SIGKILL: no chance to finish anything (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def crd(kube):
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "deploy" / "crd.yaml"))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=30s", f"crd/{PLURAL}.{GROUP}")
    # Discovery lags Established a little: wait until the resource is served.
    kube.wait_for(lambda: kube.custom().list_cluster_custom_object(GROUP, VERSION, PLURAL, limit=1) is not None,
                  timeout=30, what="the PSTrainingJob resource to be served")
    return kube


@pytest.fixture(scope="session")
def operator(crd, kube, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    proc = OperatorProcess(kube, [f"{NS_PREFIX}*"], log_path).start()
    wait_reconciling(kube, proc)
    yield proc
    proc.stop()


def wait_reconciling(kube, proc: OperatorProcess, tries: int = 4, each: float = 30.0) -> None:
    """Wait until the operator reconciles a job in a namespace made after it started (its liveness probe answers
    before kopf watches anything). In CI a job made right after the start was twice never seen (the job report
    said: no status, no pod, no Event); a canary that is not reconciled in ``each`` seconds is reported as a
    warning, with the operator's log, and another is tried in a new namespace."""
    started = time.monotonic()
    for attempt in range(tries):
        namespace = make_namespace(kube)
        try:
            create_job(kube, namespace, job_manifest("canary", ps=1, workers=1))
            try:
                kube.wait_for(lambda: get_job(kube, namespace, "canary").get("status"), timeout=each,
                              what="the canary job reconciled")
            except AssertionError:
                warnings.warn(f"the operator did not reconcile canary {attempt + 1} in {namespace} within {each:g} s "
                              f"of its creation ({time.monotonic() - started:.0f} s after the operator started); "
                              f"operator log:\n{proc.log_tail(40)}\n{job_report(kube, namespace, 'canary')}")
                continue
            return
        finally:
            delete_namespace(kube, namespace)
    raise AssertionError(f"the operator reconciled none of {tries} canary jobs:\n{proc.log_tail()}")


def make_namespace(kube, prefix: str = NS_PREFIX) -> str:
    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    core = kube.core()
    core.create_namespace({"metadata": {"name": name, "labels": {"kubeps.dev/test": "true"}}})
    kube.wait_for(lambda: core.read_namespaced_service_account("default", name), timeout=30,
                  what=f"service account {name}/default")
    return name


def delete_namespace(kube, name: str) -> None:
    from kubernetes.client.exceptions import ApiException

    try:
        kube.core().delete_namespace(name, propagation_policy="Background")
    except ApiException as err:
        if err.status != 404:
            raise


@pytest.fixture
def ns(kube, operator, request):
    name = make_namespace(kube)
    yield name
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        print(f"--- operator log tail\n{operator.log_tail(120)}")
    delete_namespace(kube, name)


# -- Kueue (tests/operator/test_kueue.py) ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def kueue(kube, crd, tmp_path_factory):
    home = kueue_cluster.kueue_dir()
    if home is None:
        message = f"Kueue {kueue_cluster.KUEUE_VERSION} is not built: run `hack/kueue.sh build` (needs Go)"
        if os.environ.get("KUBEPS_REQUIRE_KUEUE") == "1":
            pytest.fail(message + " (KUBEPS_REQUIRE_KUEUE=1)", pytrace=False)
        pytest.skip(message)
    state = tmp_path_factory.mktemp("kueue")  # certificates, config and log; pytest keeps the last few runs
    proc = kueue_cluster.KueueProcess(kube, home, state).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def kueue_operator(kueue, kube, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("kueue-operator") / "operator.log"
    proc = OperatorProcess(kube, [f"{kueue_cluster.NS_PREFIX}*"], log_path, extra_args=["--kueue", "on"]).start()
    yield proc
    proc.stop()


@pytest.fixture
def kq_ns(kube, kueue, kueue_operator, request):
    name = make_namespace(kube, kueue_cluster.NS_PREFIX)
    kube.core().patch_namespace(name, {"metadata": {"labels": {kueue_cluster.TEST_LABEL: "true"}}})
    yield name
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        print(f"--- operator log tail\n{kueue_operator.log_tail(150)}\n--- kueue log tail\n{kueue.log_tail(80)}")
    delete_namespace(kube, name)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, "rep_" + report.when, report)


# ------------------------------------------------------------------------------------------------ job helpers
def container(image: str | None = "registry.test/app:1", **extra) -> dict:
    c = {"name": "kubeps", **extra}
    if image:
        c["image"] = image
    return c


def job_manifest(name: str, ps: int = 1, workers: int = 2, evaluator: int = 0, run_policy: dict | None = None,
                 policies: dict | None = None, templates: dict | None = None) -> dict:
    policies = policies or {}
    templates = templates or {}

    def spec(role: str, replicas: int) -> dict:
        return {"replicas": replicas, "restartPolicy": policies.get(role, "OnFailure"),
                "template": templates.get(role) or {"spec": {"containers": [container()]}}}

    replica_specs = {"Chief": spec("Chief", 1), "PS": spec("PS", ps), "Worker": spec("Worker", workers)}
    if evaluator:
        replica_specs["Evaluator"] = spec("Evaluator", evaluator)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PSTrainingJob", "metadata": {"name": name},
            "spec": {"replicaSpecs": replica_specs, "runPolicy": run_policy or {}}}


def create_job(kube, namespace: str, manifest: dict) -> dict:
    return kube.custom().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)


def get_job(kube, namespace: str, name: str) -> dict:
    return kube.custom().get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def patch_job(kube, namespace: str, name: str, patch: dict) -> dict:
    return kube.custom().patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, patch,
                                                        _content_type="application/merge-patch+json")


def condition(job: dict, ctype: str) -> dict | None:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return cond
    return None


def wait_state(kube, namespace: str, name: str, state: str, timeout: float = 60) -> dict:
    def check():
        job = get_job(kube, namespace, name)
        return job if (job.get("status") or {}).get("state") == state else None

    try:
        return kube.wait_for(check, timeout=timeout, what=f"job {namespace}/{name} state {state}")
    except AssertionError as timed_out:  # tests.conftest.WaitTimeout
        raise AssertionError(f"{timed_out}\n{job_report(kube, namespace, name)}") from None


def job_report(kube, namespace: str, name: str) -> str:
    """What a test that waited in vain for a job prints: its status, its pods (phase, node, conditions) and the
    namespace's Events."""
    lines = []
    try:
        lines.append(f"status: {get_job(kube, namespace, name).get('status')}")
        for pod_name, pod in sorted(pods_of(kube, namespace, name).items()):
            conds = ", ".join(f"{c.type}={c.status}{f' ({c.reason})' if c.reason else ''}"
                              for c in pod.status.conditions or [])
            lines.append(f"pod {pod_name}: {pod.status.phase} on {pod.spec.node_name}: {conds}")
        for event in kube.core().list_namespaced_event(namespace).items[-20:]:
            lines.append(f"event {event.involved_object.kind}/{event.involved_object.name}: {event.type} "
                         f"{event.reason}: {event.message}")
    except Exception as exc:  # noqa: BLE001 - a report, not the failure
        lines.append(f"(report failed: {exc!r})")
    return "\n".join(lines)


def pods_of(kube, namespace: str, name: str) -> dict:
    pods = kube.core().list_namespaced_pod(namespace, label_selector=f"kubeps.dev/job-name={name}").items
    return {p.metadata.name: p for p in pods if p.metadata.deletion_timestamp is None}


def services_of(kube, namespace: str, name: str) -> dict:
    svcs = kube.core().list_namespaced_service(namespace, label_selector=f"kubeps.dev/job-name={name}").items
    return {s.metadata.name: s for s in svcs}
