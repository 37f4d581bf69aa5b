"""The kubeps operator side by side with Kubeflow's training-operator (TFJob), on one loopback control plane.

The same workload for both: ``--jobs`` (50) jobs of 1 chief + 2 PS + 8 workers created at once (16 threads) in a
fresh namespace watched by a freshly started operator, pods played by kwok. Three configurations, run one at a
time and alternating (``--reps`` rounds, the order rotating each round):

* ``kubeps``: the kubeps operator at its defaults (client limit 100 requests/s, burst 200, 16 workers);
* ``to-default``: training-operator v1.9.3 at its defaults (20 requests/s, burst 30, 1 controller thread);
* ``to-matched``: training-operator at kubeps's limits (``--kube-api-qps 100 --kube-api-burst 200
  --controller-threads 16``).

Per run: time from the first create to half and all of the pods created, to all pods bound to a node (the
scheduler's work) and to all pods Running (kwok's); per job (create -> its 11 pods
Running) p50 and p99; the operator's CPU seconds (user + system) in the burst (from the first create to all pods
Running) and with its start-up (from its start); reconciles (from each operator's metrics); its idle
RSS (VmRSS 5 s after start) and peak RSS (VmHWM); API requests (each operator authenticates as its own service
account, whose FlowSchema counts what the API server dispatched for it, watches included). Then medians and the
ratios kubeps / training-operator.

training-operator is built from the Go module proxy into ``~/.cache/kubeps/training-operator/v1.9.3`` (about 3
minutes with a warm Go build cache, 12 with a cold one); its TFJob CRD is read from the same module in Go's module
cache. Nothing of it enters the repository. Not a test: run it by hand.

    python bench/side_by_side.py                  # private control plane; --jobs 50 --reps 2
    python bench/side_by_side.py --configs kubeps,to-matched --reps 3
    python bench/side_by_side.py --configs kubeps,to-matched --jobs 1 --ps 50 --workers 1000   # one big job
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from operator_latency import (  # noqa: E402
    REPO, SCRIPT, add_nodes, control_plane_down, control_plane_up, free_port, new_namespace, pct)

TO_VERSION = "v1.9.3"
TO_MODULE = "github.com/kubeflow/training-operator"
TO_CACHE = Path(os.environ.get("KUBEPS_TO_CACHE", Path.home() / ".cache" / "kubeps" / "training-operator")) / TO_VERSION
TO_BIN = TO_CACHE / "bin" / "training-operator.v1"
TO_NAMESPACE = "kubeflow-bench"  # its cert manager's namespace (MY_POD_NAMESPACE)
SYSTEM_NS = "bench-operators"
CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")  # fixed in training-operator's pkg/cert
PS, WORKERS = 2, 8  # a job's shape by default; --ps and --workers change it (--jobs 1 --ps 50 --workers 1000)
CONFIGS = ("kubeps", "to-default", "to-matched")
KUBEPS_PYTHON = [sys.executable]  # --kubeps-python: another checkout's venv, to compare commits
RUNNING_WITHIN_S = 900  # a run fails when its pods are not all Running by then


def go() -> str:
    found = shutil.which("go") or "/usr/local/go/bin/go"
    if not os.path.exists(found):
        raise SystemExit("go not found: training-operator is built from the Go module proxy")
    return found


def build_training_operator() -> None:
    """``go install`` training-operator into the cache (once)."""
    if TO_BIN.exists():
        return
    TO_BIN.parent.mkdir(parents=True, exist_ok=True)
    print(f"building training-operator {TO_VERSION} from Go modules into {TO_CACHE} (minutes) ...", flush=True)
    started = time.monotonic()
    env = dict(os.environ, GOBIN=str(TO_BIN.parent), CGO_ENABLED="0")
    subprocess.run([go(), "install", "-trimpath", "-ldflags", "-s -w",
                    f"{TO_MODULE}/cmd/training-operator.v1@{TO_VERSION}"], env=env, check=True)
    print(f"built in {time.monotonic() - started:.0f} s", flush=True)


def tfjob_crd() -> Path:
    modcache = subprocess.run([go(), "env", "GOMODCACHE"], capture_output=True, text=True, check=True).stdout.strip()
    path = Path(modcache) / f"{TO_MODULE}@{TO_VERSION}" / "manifests" / "base" / "crds" / "kubeflow.org_tfjobs.yaml"
    if not path.exists():
        subprocess.run([go(), "mod", "download", f"{TO_MODULE}@{TO_VERSION}"], check=True, cwd=tempfile.gettempdir())
    return path


# ------------------------------------------------------------------------------------------------ the workload
def replica(replicas: int, container: str) -> dict:
    return {"replicas": replicas, "restartPolicy": "OnFailure",
            "template": {"spec": {"containers": [{"name": container, "image": "registry.test/rt:1"}]}}}


def kubeps_job(name: str, ps: int, workers: int) -> tuple[str, str, str, dict]:
    body = {"apiVersion": "kubeps.dev/v1alpha1", "kind": "PSTrainingJob", "metadata": {"name": name},
            "spec": {"replicaSpecs": {"Chief": replica(1, "kubeps"), "PS": replica(ps, "kubeps"),
                                      "Worker": replica(workers, "kubeps")}}}
    return "kubeps.dev", "v1alpha1", "pstrainingjobs", body


def tf_job(name: str, ps: int, workers: int) -> tuple[str, str, str, dict]:
    body = {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": {"name": name},
            "spec": {"tfReplicaSpecs": {"Chief": replica(1, "tensorflow"), "PS": replica(ps, "tensorflow"),
                                        "Worker": replica(workers, "tensorflow")}}}
    return "kubeflow.org", "v1", "tfjobs", body


def job_of(pod: dict) -> str | None:
    labels = pod["metadata"].get("labels") or {}
    return labels.get("kubeps.dev/job-name") or labels.get("training.kubeflow.org/job-name")


class PodWatch:
    """When each pod of a namespace was first seen and first Running (raw watch, json.loads only)."""

    def __init__(self, api_client, namespace: str):
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.seen: dict[str, tuple[str, float]] = {}
        self.bound: dict[str, float] = {}  # first seen with a node (the scheduler's binding)
        self.running: dict[str, float] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                resp = self.core.list_namespaced_pod(self.namespace, watch=True, timeout_seconds=30,
                                                     _preload_content=False)
                buffer = b""
                for chunk in resp.stream(65536):
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    now = time.monotonic()
                    for line in lines:
                        if line.strip():
                            self._note(json.loads(line).get("object") or {}, now)
                resp.release_conn()
            except Exception:  # noqa: BLE001 - re-watch
                time.sleep(0.1)

    def _note(self, pod: dict, now: float) -> None:
        name = (pod.get("metadata") or {}).get("name")
        job = job_of(pod) if name else None
        if job is None:
            return
        with self.lock:
            self.seen.setdefault(name, (job, now))
            if (pod.get("spec") or {}).get("nodeName"):
                self.bound.setdefault(name, now)
            if (pod.get("status") or {}).get("phase") == "Running":
                self.running.setdefault(name, now)

    def counts(self) -> tuple[int, int]:
        with self.lock:
            return len(self.seen), len(self.running)


# ------------------------------------------------------------------------------------------------ the operators
class Cluster:
    def __init__(self, env: dict, kubectl: str):
        from kubernetes import config

        self.env = env
        self.kubectl_bin = kubectl
        self.api_client = config.new_client_from_config(config_file=env["KUBECONFIG"])
        self.api_client.configuration.connection_pool_maxsize = 32

    def kubectl(self, *args: str, input: str | None = None) -> str:
        done = subprocess.run([self.kubectl_bin, *args], env=self.env, input=input, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def apply(self, objects: list[dict]) -> None:
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                     input="\n---\n".join(json.dumps(o) for o in objects))

    def identity(self, name: str, tmp: Path) -> Path:
        """A service account (cluster-admin) with its own FlowSchema, and a kubeconfig with its token."""
        sa = {"kind": "ServiceAccount", "name": name, "namespace": SYSTEM_NS}
        self.apply([
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": SYSTEM_NS}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
             "subjects": [sa]},
            {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": name},
             "spec": {"priorityLevelConfiguration": {"name": "workload-high"}, "matchingPrecedence": 100,
                      "distinguisherMethod": {"type": "ByUser"},
                      "rules": [{"subjects": [{"kind": "ServiceAccount",
                                               "serviceAccount": {"name": name, "namespace": SYSTEM_NS}}],
                                 "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                                    "clusterScope": True, "namespaces": ["*"]}],
                                 "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}},
        ])
        token = self.kubectl("create", "token", name, "-n", SYSTEM_NS, "--duration", "6h").strip()
        admin = json.loads(self.kubectl("config", "view", "--raw", "--minify", "-o", "json"))
        cluster = admin["clusters"][0]
        kubeconfig = {"apiVersion": "v1", "kind": "Config", "current-context": name,
                      "clusters": [{"name": name, "cluster": cluster["cluster"]}],
                      "users": [{"name": name, "user": {"token": token}}],
                      "contexts": [{"name": name, "context": {"cluster": name, "user": name}}]}
        path = tmp / f"{name}.kubeconfig"
        path.write_text(json.dumps(kubeconfig))
        return path

    def dispatched(self, flow_schema: str) -> float:
        total = 0.0
        for line in self.kubectl("get", "--raw", "/metrics").splitlines():
            if line.startswith("apiserver_flowcontrol_dispatched_requests_total{") and \
                    f'flow_schema="{flow_schema}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the operator exited {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the operator was not ready after {timeout} s; see {log}")


def start_operator(cluster: "Cluster", config: str, namespace: str, kubeconfig: Path,
                   tmp: Path) -> tuple[subprocess.Popen, Path, str]:
    """Start one operator on ``namespace``; returns the process, its log and its metrics URL."""
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1")
    log = tmp / f"{config}-{namespace}.log"
    probe, metrics = free_port(), free_port()
    metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    if config == "kubeps":
        args = [KUBEPS_PYTHON[0], "-m", "kubeps.operator.main", "--namespace", namespace, "--bind-address",
                "127.0.0.1", "--metrics-port", str(metrics), "--liveness-port", str(probe), "--log-level", "WARNING"]
        url = f"http://127.0.0.1:{probe}/healthz"
    else:
        env["MY_POD_NAMESPACE"] = TO_NAMESPACE
        args = [str(TO_BIN), "--enable-scheme=tfjob", f"--namespace={namespace}",
                f"--metrics-bind-address=127.0.0.1:{metrics}", f"--health-probe-bind-address=127.0.0.1:{probe}",
                f"--webhook-server-port={free_port()}"]
        if config == "to-matched":
            args += ["--kube-api-qps=100", "--kube-api-burst=200", "--controller-threads=16"]
        url = f"http://127.0.0.1:{probe}/readyz"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    if config != "kubeps":
        mount_webhook_certs(cluster)
    wait_http(url, proc, log)
    return proc, log, metrics_url


def reconciles(metrics_url: str) -> float:
    """Reconciles done: kubeps's reconcile histogram, training-operator's controller-runtime counter."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("kubeps_reconcile_duration_seconds_count ") or \
                (line.startswith("controller_runtime_reconcile_total{") and 'controller="tfjob-controller"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def mount_webhook_certs(cluster: "Cluster", timeout: float = 60) -> None:
    """Play the kubelet's Secret volume: training-operator waits for its Secret's certificates in CERT_DIR."""
    from kubernetes import client

    core = client.CoreV1Api(cluster.api_client)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = core.read_namespaced_secret("training-operator-webhook-cert", TO_NAMESPACE).data or {}
        if "tls.crt" in data and "tls.key" in data:
            CERT_DIR.mkdir(parents=True, exist_ok=True)
            for key, value in data.items():
                (CERT_DIR / key).write_bytes(base64.b64decode(value))
            return
        time.sleep(0.2)
    raise SystemExit("training-operator wrote no certificates into its Secret")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def one_run(cluster: Cluster, config: str, kubeconfig: Path, jobs: int, tmp: Path,
            profile: Path | None = None, ps: int = PS, workers: int = WORKERS) -> dict:
    from kubernetes import client

    core = client.CoreV1Api(cluster.api_client)
    custom = client.CustomObjectsApi(cluster.api_client)
    namespace = new_namespace(cluster.api_client, "sbs-")
    watch = PodWatch(cluster.api_client, namespace)
    flow = "bench-kubeps" if config == "kubeps" else "bench-training-operator"
    requests0 = cluster.dispatched(flow)
    proc, log, metrics_url = start_operator(cluster, config, namespace, kubeconfig, tmp)
    spy = None
    if profile and config == "kubeps":  # py-spy (pip install py-spy) samples the operator; collapsed stacks
        spy = subprocess.Popen([shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record",
                                "--pid", str(proc.pid), "--rate", "200", "--format", "raw", "--nonblocking",
                                "--output", str(profile)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(5)
        idle_rss = proc_status_mb(proc.pid, "VmRSS")
        cpu_start = proc_cpu_seconds(proc.pid)  # start-up: imports, discovery, the first listings
        make = kubeps_job if config == "kubeps" else tf_job
        names = [f"j{i:03d}" for i in range(jobs)]
        starts: dict[str, float] = {}

        def create(name: str) -> None:
            group, version, plural, body = make(name, ps, workers)
            starts[name] = time.monotonic()
            custom.create_namespaced_custom_object(group, version, namespace, plural, body)

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(create, names))
        total = jobs * (1 + ps + workers)
        deadline = t0 + RUNNING_WITHIN_S
        while watch.counts()[1] < total and time.monotonic() < deadline:
            time.sleep(0.05)
        end = time.monotonic()
        cpu = proc_cpu_seconds(proc.pid)
        peak = proc_status_mb(proc.pid, "VmHWM")
        requests = cluster.dispatched(flow) - requests0
        reconciled = reconciles(metrics_url)
    finally:
        if spy is not None:
            os.kill(spy.pid, signal.SIGINT)
            spy.wait(30)
        stop(proc)
        watch.stop.set()
    with watch.lock:
        seen = dict(watch.seen)
        bound = dict(watch.bound)
        running = dict(watch.running)
    if len(running) < total:
        raise SystemExit(f"{config}: only {len(running)}/{total} pods Running after {RUNNING_WITHIN_S} s; see {log}")
    per_job: dict[str, float] = {}
    for pod, (job, _) in seen.items():
        per_job[job] = max(per_job.get(job, 0.0), running[pod] - starts[job])
    core.delete_namespace(namespace, propagation_policy="Background")
    return {
        "config": config, "half_created": pct([t for _, t in seen.values()], 50) - t0,
        "created": max(t for _, t in seen.values()) - t0, "bound": max(bound.values(), default=t0) - t0,
        "running": max(running.values()) - t0,
        "p50": pct(list(per_job.values()), 50), "p99": pct(list(per_job.values()), 99), "cpu": cpu - cpu_start,
        "cpu_total": cpu,
        "idle_rss": idle_rss, "peak_rss": peak, "requests": requests, "reconciles": reconciled, "wall": end - t0,
    }


def wait_namespaces_gone(cluster: Cluster, timeout: float = 180) -> None:
    """Between runs: the previous run's pods are gone, so each run starts from the same cluster."""
    from kubernetes import client

    core = client.CoreV1Api(cluster.api_client)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [n for n in core.list_namespace().items if n.metadata.name.startswith("sbs-")]:
            return
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--ps", type=int, default=PS, help="parameter servers per job")
    parser.add_argument("--workers", type=int, default=WORKERS, help="workers per job")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--external", action="store_true", help="use $KUBECONFIG instead of a private control plane")
    parser.add_argument("--profile", metavar="PREFIX", help="py-spy the kubeps operator: PREFIX.<round>.txt, "
                        "collapsed stacks (needs py-spy)")
    parser.add_argument("--kubeps-python", metavar="PYTHON",
                        help="run the kubeps operator with this interpreter (e.g. another checkout's .venv/bin/python)")
    args = parser.parse_args(argv)
    if args.kubeps_python:
        KUBEPS_PYTHON[0] = args.kubeps_python
    configs = [c for c in args.configs.split(",") if c]
    if set(configs) - set(CONFIGS):
        parser.error(f"unknown config in {args.configs}")
    if any(c.startswith("to-") for c in configs):
        build_training_operator()

    env = dict(os.environ)
    state_dir = None
    tmp = Path(tempfile.mkdtemp(prefix="kubeps-sbs-"))
    if not args.external:
        state_dir = control_plane_up(env)
        if state_dir is None:
            return 2
    bin_dir = subprocess.run(["bash", str(SCRIPT), "bin-dir"], env=env, capture_output=True, text=True).stdout.strip()
    results: list[dict] = []
    try:
        cluster = Cluster(env, shutil.which("kubectl", path=bin_dir) or "kubectl")
        cluster.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}}
                       for n in (SYSTEM_NS, TO_NAMESPACE)])
        # training-operator's cert manager starts its controllers once it has written its certificates into this
        # Secret and injected the CA into this webhook configuration (left without webhooks: nothing to call).
        cluster.apply([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "training-operator-webhook-cert",
                                                                           "namespace": TO_NAMESPACE}},
                       {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
                        "metadata": {"name": "validator.training-operator.kubeflow.org"}, "webhooks": []}])
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "deploy" / "crd.yaml"))
        if any(c.startswith("to-") for c in configs):
            cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(tfjob_crd()))
        crds = ["pstrainingjobs.kubeps.dev"] + (["tfjobs.kubeflow.org"] if any(c.startswith("to-") for c in configs)
                                                else [])
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=120s", *(f"crd/{c}" for c in crds))
        kubeconfigs = {"kubeps": cluster.identity("bench-kubeps", tmp)}
        kubeconfigs["to-default"] = kubeconfigs["to-matched"] = cluster.identity("bench-training-operator", tmp)
        pods = args.jobs * (1 + args.ps + args.workers)
        add_nodes(cluster.api_client, pods + 50)
        time.sleep(2)
        for rep in range(args.reps):
            order = configs[rep % len(configs):] + configs[:rep % len(configs)]
            for config in order:
                wait_namespaces_gone(cluster)
                result = one_run(cluster, config, kubeconfigs[config], args.jobs, tmp,
                                 args.profile and Path(f"{args.profile}.{rep + 1}.txt"), args.ps, args.workers)
                results.append(result)
                print(f"round {rep + 1} {config:10s}: half the pods created {result['half_created']:6.1f} s, all "
                      f"{result['created']:6.1f} s, bound {result['bound']:6.1f} s, Running "
                      f"{result['running']:6.1f} s, per job p50 {result['p50']:6.1f} s p99 {result['p99']:6.1f} s, "
                      f"CPU {result['cpu']:5.1f} s (with start-up {result['cpu_total']:4.1f} s), RSS idle {result['idle_rss']:5.1f} MiB peak "
                      f"{result['peak_rss']:5.1f} MiB, API requests {result['requests']:6.0f}, reconciles "
                      f"{result['reconciles']:5.0f}", flush=True)
    finally:
        control_plane_down(env, state_dir)
        if CERT_DIR.exists():
            shutil.rmtree(CERT_DIR.parent, ignore_errors=True)

    keys = ("half_created", "created", "bound", "running", "p50", "p99", "cpu", "cpu_total", "idle_rss", "peak_rss", "requests", "reconciles")
    medians = {c: {k: statistics.median(r[k] for r in results if r["config"] == c) for k in keys}
               for c in configs}
    print(f"\n{args.jobs} job(s) of 1 chief + {args.ps} PS + {args.workers} workers ({pods} pods); "
          f"medians of {args.reps} alternating runs")
    print(f"{'':12s}" + "".join(f"{k:>11s}" for k in keys))
    for c in configs:
        print(f"{c:12s}" + "".join(f"{medians[c][k]:11.1f}" for k in keys))
    if "kubeps" in medians:
        for c in configs:
            if c != "kubeps":
                print(f"kubeps / {c:10s}" + "".join(
                    f"{medians['kubeps'][k] / medians[c][k]:10.2f}x" if medians[c][k] else f"{'-':>11s}"
                    for k in keys))
    if "kubeps" in medians and "to-matched" in medians:
        k, t = medians["kubeps"], medians["to-matched"]
        if args.jobs == 1:  # one big job (--jobs 1 --ps 50 --workers 1000)
            goals = [("all pods Running within 1.2x training-operator's time at matched limits",
                      k["running"] <= 1.2 * t["running"]),
                     ("operator CPU in the burst <= training-operator's", k["cpu"] <= t["cpu"]),
                     ("peak RSS <= training-operator's", k["peak_rss"] <= t["peak_rss"])]
        else:
            goals = [("all pods Running no slower than training-operator at matched limits",
                      k["running"] <= t["running"]),
                     ("operator CPU in the burst <= 1.5x training-operator's", k["cpu"] <= 1.5 * t["cpu"]),
                     ("operator CPU with start-up <= 1.5x training-operator's",
                      k["cpu_total"] <= 1.5 * t["cpu_total"]),
                     ("peak RSS <= 1.2x training-operator's", k["peak_rss"] <= 1.2 * t["peak_rss"])]
        for text, ok in goals:
            print(f"goal {'met' if ok else 'MISSED'}: {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
