"""Real Kueue (v0.19.2, built from Go modules by ``hack/kueue.sh build``) on the loopback control plane, for the
``kueue`` fixtures of tests/operator/conftest.py.

``kueue`` (module): Kueue's CRDs applied, its manager started as a process on 127.0.0.1 (leader election off,
``integrations.externalFrameworks: [PSTrainingJob.v1alpha1.kubeps.dev]``, ``waitForPodsReady`` on), its webhooks
registered by URL with certificates made here (no Service, no kube-proxy, no cert-manager: Kueue's internal
certificate management is off and it reads ours). The pod and Job webhooks only see namespaces labelled
``kubeps.dev/kueue-test``. Everything is removed again at the end of the module. ``kueue_operator``: our operator
with ``--kueue on`` watching ``kq-*`` namespaces; ``kq_ns`` a fresh one.

Without the build the tests skip, unless ``KUBEPS_REQUIRE_KUEUE=1`` (as CI sets) makes that a failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
import ssl
from pathlib import Path

import yaml

from kubeps.runtime import certs
from kubeps.runtime.local.launcher import free_ports


REPO = Path(__file__).resolve().parents[2]
KUEUE_VERSION = "v0.19.2"
TEST_LABEL = "kubeps.dev/kueue-test"
NS_PREFIX = "kq-"
#: webhooks of Kueue's own objects, and the pod/Job ones (scoped to the test namespaces): what these tests need
KEPT_WEBHOOK_PATHS = ("kueue-x-k8s-io", "--v1-pod", "batch-v1-job")


def kueue_dir() -> Path | None:
    proc = subprocess.run([str(REPO / "hack" / "kueue.sh"), "dir"], capture_output=True, text=True, check=False)
    found = Path(proc.stdout.strip()) if proc.returncode == 0 else None
    return found if found is not None and (found / "kueue").is_file() else None


class KueueProcess:
    def __init__(self, kube, home: Path, state: Path):
        self.kube, self.home, self.state = kube, home, state
        self.webhook_port, self.health_port = free_ports(2)
        self.proc: subprocess.Popen | None = None
        self.log_path = state / "kueue.log"
        self.ca_pem = b""

    def log_tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _certificates(self) -> None:
        made = certs.issue_job_credentials("kueue-webhook", ["127.0.0.1"])
        files = made.files()
        cert_dir = self.state / "certs"
        cert_dir.mkdir(parents=True, exist_ok=True)
        (cert_dir / "tls.crt").write_bytes(files[certs.TLS_CERT_KEY])
        (cert_dir / "tls.key").write_bytes(files[certs.TLS_KEY_KEY])
        self.ca_pem = files[certs.CA_CERT_KEY]

    def _config(self) -> Path:
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": "kueue-system",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1", "certDir": str(self.state / "certs")},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "waitForPodsReady": {"timeout": "5m", "blockAdmission": False},
            "integrations": {"frameworks": ["batch/job", "pod"],
                             "externalFrameworks": ["PSTrainingJob.v1alpha1.kubeps.dev"]},
            "managedJobsNamespaceSelector": {"matchLabels": {TEST_LABEL: "true"}},
        }
        path = self.state / "kueue-config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def _webhooks(self) -> list[dict]:
        """Kueue's webhook configurations, addressed by URL on loopback, with our CA."""
        import base64

        ca = base64.b64encode(self.ca_pem).decode()
        docs = [d for d in yaml.safe_load_all((self.home / "webhook" / "manifests.yaml").read_text()) if d]
        out = []
        for doc in docs:
            doc["metadata"] = {"name": f"kueue-{doc['metadata']['name']}", "labels": {TEST_LABEL: "true"}}
            kept = []
            for hook in doc.get("webhooks") or []:
                path = hook["clientConfig"]["service"]["path"]
                if not any(part in path for part in KEPT_WEBHOOK_PATHS):
                    continue
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{self.webhook_port}{path}", "caBundle": ca}
                if "kueue-x-k8s-io" not in path:  # pods and Jobs: only the test namespaces
                    hook["namespaceSelector"] = {"matchLabels": {TEST_LABEL: "true"}}
                kept.append(hook)
            doc["webhooks"] = kept
            out.append(doc)
        return out

    def start(self) -> "KueueProcess":
        crds = sorted((self.home / "crds").glob("*.yaml"))
        self.kube.kubectl("apply", "--server-side", "--force-conflicts", *sum((["-f", str(p)] for p in crds), []),
                          timeout=120)
        for path in crds:
            name = yaml.safe_load(path.read_text())["metadata"]["name"]
            self.kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{name}")
        core = self.kube.core()
        try:
            core.create_namespace({"metadata": {"name": "kueue-system"}})
        except Exception:  # noqa: BLE001 - already there (a kept control plane)
            pass
        self._certificates()
        env = dict(self.kube.env)
        log = open(self.log_path, "ab")
        # With its internal certificate management off, Kueue reads its metrics certificate from a fixed path,
        # /etc/kueue/metrics/certs (cmd/kueue/main.go). It gets ours there in a mount namespace of its own (a tmpfs
        # over /etc that no one else sees and that goes with the process): nothing is written to the host's /etc.
        script = ('mount -t tmpfs kubeps-kueue-etc /etc && mkdir -p /etc/kueue/metrics/certs && '
                  'cp "$0"/tls.crt "$0"/tls.key /etc/kueue/metrics/certs/ && exec "$@"')
        unshare = ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
        self.proc = subprocess.Popen([*unshare, "sh", "-c", script, str(self.state / "certs"),
                                      str(self.home / "kueue"), f"--config={self._config()}", "--zap-log-level=2",
                                      "--feature-gates=VisibilityOnDemand=false"],
                                     env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.state)
        log.close()
        self._wait_ready()
        for doc in self._webhooks():
            self.kube.apply(doc)
        return self

    def _wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        context = ssl.create_default_context(cadata=self.ca_pem.decode())
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"kueue exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as resp:
                    if resp.status == 200:
                        # and the webhook server answers TLS with our certificate
                        urllib.request.urlopen(f"https://127.0.0.1:{self.webhook_port}/", timeout=2,
                                               context=context).close()
                        return
            except urllib.error.HTTPError as err:
                if err.code == 404 and err.url.startswith("https"):
                    return  # the webhook server answered (no handler at /): up
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"kueue not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
            self.kube.kubectl("delete", kind, "-l", f"{TEST_LABEL}=true", "--ignore-not-found", check=False)
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
