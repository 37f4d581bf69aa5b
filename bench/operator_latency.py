"""Operator latency benchmark on the local control plane (hack/controlplane.sh; kwok nodes).

Measures, in one run:

* baseline: the API server itself - 11 pods and 11 Services created directly by this script (16 threads), from
  the first create to all 22 seen by a watch;
* single job: 1 chief + 2 PS + 8 workers, one job at a time (``--single`` runs), create -> all 11 pods and
  11 Services seen, and create -> state Running;
* burst: ``--jobs`` (50) such jobs created at once: p50/p99 of create -> all children and create -> Running, and
  the time until every job runs;
* the operator's peak RSS (VmHWM of the operator process).

Prints the figures, the ratios single-job/baseline and burst/single-job, and checks the goals (single-job p99 to
all children < 2 s, all 50 Running < 30 s, RSS < 150 MB); exit status 1 when a goal is missed. ``--smoke`` runs 1
baseline round, 1 single job and a burst of 2, and reports the goals without holding the exit status to them: a
check that the benchmark runs. On a cluster of its own (``--external``) it deletes its namespace, jobs and all, at the end.

    python bench/operator_latency.py                    # starts (and stops) a private control plane
    KUBECONFIG=... python bench/operator_latency.py --external   # use a running cluster
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "hack" / "controlplane.sh"
GROUP, VERSION, PLURAL = "kubeps.dev", "v1alpha1", "pstrainingjobs"
PS, WORKERS = 2, 8
CHILDREN = 1 + PS + WORKERS


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[k]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def manifest(name: str) -> dict:
    def spec(replicas: int) -> dict:
        return {"replicas": replicas, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [{"name": "kubeps", "image": "registry.test/rt:1"}]}}}

    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PSTrainingJob", "metadata": {"name": name},
            "spec": {"replicaSpecs": {"Chief": spec(1), "PS": spec(PS), "Worker": spec(WORKERS)}}}


class Recorder:
    """Watches pods, Services and jobs of one namespace; remembers when each name was first seen.

    Raw watch streams parsed with ``json.loads`` (no model objects), so the observer costs little CPU next to the
    operator and the control plane on a small machine.
    """

    def __init__(self, api_client, namespace: str):
        self.api_client = api_client
        self.namespace = namespace
        self.first_seen: dict[tuple[str, str], float] = {}
        self.running: dict[str, float] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        from kubernetes import client

        core = client.CoreV1Api(api_client)
        custom = client.CustomObjectsApi(api_client)
        opts = dict(watch=True, timeout_seconds=30, _preload_content=False)
        openers = {
            "pod": lambda: core.list_namespaced_pod(namespace, **opts),
            "svc": lambda: core.list_namespaced_service(namespace, **opts),
            "job": lambda: custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, **opts),
        }
        self.threads = [threading.Thread(target=self._watch, args=(k, o), daemon=True) for k, o in openers.items()]
        for t in self.threads:
            t.start()

    def _watch(self, kind: str, opener) -> None:
        import json

        while not self.stop.is_set():
            try:
                resp = opener()
                buffer = b""
                for chunk in resp.stream(65536):
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    now = time.monotonic()
                    for line in lines:
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        obj = event.get("object") or {}
                        name = (obj.get("metadata") or {}).get("name")
                        if not name:
                            continue
                        with self.lock:
                            if kind == "job":
                                if (obj.get("status") or {}).get("state") == "Running":
                                    self.running.setdefault(name, now)
                            else:
                                self.first_seen.setdefault((kind, name), now)
            except Exception:  # noqa: BLE001 - re-watch
                time.sleep(0.1)

    def children_done(self, prefix: str, count: int) -> float | None:
        with self.lock:
            seen = [t for (kind, name), t in self.first_seen.items() if name.startswith(prefix + "-")]
        return max(seen) if len(seen) >= 2 * count else None

    def wait(self, predicate, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.02)
        return None


def add_nodes(api_client, pods_needed: int) -> None:
    """kwok nodes hold 110 pods each; add fake nodes (played by kwok) until the burst fits."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    nodes = core.list_node(label_selector="type=kwok").items
    capacity = sum(int(n.status.allocatable.get("pods", "0")) for n in nodes)
    i = 0
    while capacity < pods_needed:
        name = f"kwok-bench-node-{i}"
        i += 1
        if any(n.metadata.name == name for n in nodes):
            continue
        res = {"cpu": "64", "memory": "256Gi", "pods": "300"}
        core.create_node({"metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                                       "labels": {"type": "kwok", "kubernetes.io/hostname": name}},
                          "status": {"allocatable": res, "capacity": res}})
        capacity += 300
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready = [n for n in core.list_node(label_selector="type=kwok").items
                 if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])]
        if sum(int(n.status.allocatable.get("pods", "0")) for n in ready) >= pods_needed:
            return
        time.sleep(0.5)
    raise SystemExit(f"the cluster cannot hold {pods_needed} pods")


def measure_baseline(api_client, namespace: str, recorder: Recorder, rounds: int) -> list[float]:
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    results = []
    for r in range(rounds):
        prefix = f"raw{r}"
        bodies = []
        for i in range(CHILDREN):
            name = f"{prefix}-{i}"
            labels = {"bench": prefix, "idx": str(i)}
            bodies.append(("pod", {"metadata": {"name": name, "labels": labels}, "spec": {
                "restartPolicy": "Never", "containers": [{"name": "c", "image": "registry.test/rt:1"}]}}))
            bodies.append(("svc", {"metadata": {"name": name, "labels": labels}, "spec": {
                "clusterIP": "None", "selector": labels, "ports": [{"port": 2222}]}}))
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda kb: (core.create_namespaced_pod if kb[0] == "pod" else
                                      core.create_namespaced_service)(namespace, kb[1]), bodies))
        done = recorder.wait(lambda: recorder.children_done(prefix, CHILDREN), 30)
        results.append(done - start)
    return results


def control_plane_up(env: dict) -> str | None:
    """Start a private control plane; sets KUBEPS_CP_DIR and KUBECONFIG in ``env``; None (and why) if it fails."""
    state_dir = tempfile.mkdtemp(prefix="kubeps-bench-cp-")
    env["KUBEPS_CP_DIR"] = state_dir
    up = subprocess.run(["bash", str(SCRIPT), "up"], env=env, capture_output=True, text=True)
    if up.returncode != 0:
        control_plane_down(env, state_dir)
        print(up.stderr[-3000:], file=sys.stderr)
        print("could not start the control plane: run `hack/controlplane.sh build` first", file=sys.stderr)
        return None
    env["KUBECONFIG"] = os.path.join(state_dir, "admin.kubeconfig")
    return state_dir


def control_plane_down(env: dict, state_dir: str | None) -> None:
    if state_dir:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True)
        shutil.rmtree(state_dir, ignore_errors=True)


def new_namespace(api_client, prefix: str) -> str:
    """A fresh namespace whose default service account exists (pods can be created in it)."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    namespace = f"{prefix}{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})
    while True:
        try:
            core.read_namespaced_service_account("default", namespace)
            return namespace
        except Exception:  # noqa: BLE001
            time.sleep(0.2)


def start_operator(env: dict, namespace: str, log_path: Path, *extra: str) -> subprocess.Popen:
    """``kubeps.operator.main`` watching ``namespace``, logging to ``log_path``; returns once it answers /healthz."""
    live_port = free_port()
    with open(log_path, "wb") as log:
        operator = subprocess.Popen(
            [sys.executable, "-m", "kubeps.operator.main", "--namespace", namespace, "--bind-address", "127.0.0.1",
             "--metrics-port", "0", "--liveness-port", str(live_port), *extra],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{live_port}/healthz", timeout=1)
            return operator
        except OSError:
            if time.monotonic() > deadline or operator.poll() is not None:
                raise SystemExit(f"the operator did not start; see {log_path}") from None
            time.sleep(0.1)


def stop_operator(operator: subprocess.Popen | None) -> None:
    """SIGTERM to the operator this script started (by its PID), SIGKILL after 15 s."""
    if operator is not None and operator.poll() is None:
        os.kill(operator.pid, signal.SIGTERM)
        try:
            operator.wait(15)
        except subprocess.TimeoutExpired:
            os.kill(operator.pid, signal.SIGKILL)


def rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--single", type=int, default=5, help="single-job runs")
    parser.add_argument("--external", action="store_true", help="use $KUBECONFIG instead of a private control plane")
    parser.add_argument("--smoke", action="store_true",
                        help="1 baseline round, 1 single job and a burst of 2; the goals reported, the exit status 0 "
                             "whatever they say")
    args = parser.parse_args(argv)
    if args.smoke:
        args.jobs, args.single = 2, 1

    from kubernetes import config

    state_dir = None
    env = dict(os.environ)
    if not args.external:
        state_dir = control_plane_up(env)
        if state_dir is None:
            return 2
    kubectl = shutil.which("kubectl", path=subprocess.run(["bash", str(SCRIPT), "bin-dir"], env=env,
                                                          capture_output=True, text=True).stdout.strip()) or "kubectl"
    operator = None
    namespace = None
    core = None
    try:
        subprocess.run([kubectl, "apply", "--server-side", "--force-conflicts", "-f", str(REPO / "deploy" / "crd.yaml")],
                       env=env, check=True, capture_output=True)
        subprocess.run([kubectl, "wait", "--for=condition=Established", "--timeout=30s",
                        f"crd/{PLURAL}.{GROUP}"], env=env, check=True, capture_output=True)
        api_client = config.new_client_from_config(config_file=env["KUBECONFIG"])
        api_client.configuration.connection_pool_maxsize = 32
        from kubernetes import client

        custom = client.CustomObjectsApi(api_client)
        core = client.CoreV1Api(api_client)
        namespace = new_namespace(api_client, "bench-")
        time.sleep(1.0)  # discovery of the new CRD
        add_nodes(api_client, args.jobs * CHILDREN + 3 * CHILDREN + args.single * CHILDREN + 50)
        recorder = Recorder(api_client, namespace)
        time.sleep(0.5)

        baseline = measure_baseline(api_client, namespace, recorder, rounds=1 if args.smoke else 3)

        operator = start_operator(env, namespace, Path(tempfile.gettempdir()) / f"kubeps-bench-operator-{namespace}.log",
                                  "--log-level", "WARNING")

        def run_jobs(names: list[str]) -> tuple[list[float], list[float], float]:
            starts = {}

            def create(name):
                starts[name] = time.monotonic()
                custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest(name))

            t0 = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(create, names))
            recorder.wait(lambda: all(n in recorder.running for n in names), 120)
            children = [(recorder.children_done(n, CHILDREN) or float("nan")) - starts[n] for n in names]
            running = [recorder.running.get(n, float("nan")) - starts[n] for n in names]
            last = max(recorder.running.get(n, float("inf")) for n in names) - t0
            return children, running, last

        single_children, single_running = [], []
        for i in range(args.single):
            c, r, _ = run_jobs([f"single{i}"])
            single_children += c
            single_running += r
        burst_children, burst_running, all_running = run_jobs([f"burst{i:02d}" for i in range(args.jobs)])
        rss = rss_peak_mb(operator.pid)
    finally:
        if args.external and namespace is not None and core is not None:  # the operator still runs: no job is stuck
            core.delete_namespace(namespace, propagation_policy="Background")
        stop_operator(operator)
        control_plane_down(env, state_dir)

    base = statistics.median(baseline)
    s50, s99 = pct(single_children, 50), pct(single_children, 99)
    b50, b99 = pct(burst_children, 50), pct(burst_children, 99)
    print(f"jobs of 1 chief + {PS} PS + {WORKERS} workers ({CHILDREN} pods + {CHILDREN} Services each)")
    print(f"baseline: {CHILDREN} pods + {CHILDREN} Services created directly: median {base:.3f} s "
          f"(runs: {', '.join(f'{b:.3f}' for b in baseline)})")
    print(f"single job ({args.single} runs): create -> all children p50 {s50:.3f} s p99 {s99:.3f} s; "
          f"create -> Running p50 {pct(single_running, 50):.3f} s p99 {pct(single_running, 99):.3f} s")
    print(f"{args.jobs} jobs at once: create -> all children p50 {b50:.3f} s p99 {b99:.3f} s; "
          f"create -> Running p50 {pct(burst_running, 50):.3f} s p99 {pct(burst_running, 99):.3f} s; "
          f"all Running after {all_running:.2f} s")
    print(f"operator peak RSS: {rss:.1f} MB")
    print(f"ratio single-job p50 / direct-create baseline: {s50 / base:.2f}x")
    print(f"ratio burst p50 / single-job p50: {b50 / s50:.2f}x")
    goals = [
        ("single-job p99 to all children < 2 s", s99 < 2.0),
        (f"all {args.jobs} jobs Running < 30 s", all_running < 30.0),
        ("operator RSS < 150 MB", rss < 150.0),
    ]
    for text, ok in goals:
        print(f"goal {'met' if ok else 'MISSED'}: {text}")
    return 0 if args.smoke or all(ok for _, ok in goals) else 1


if __name__ == "__main__":
    raise SystemExit(main())
