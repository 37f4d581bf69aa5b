"""status.progress and the STEP / EXAMPLES/S columns on the real control plane: an operator whose
``KUBEPS_CHIEF_METRICS_URL`` points at a local server serving a chief's exposition writes the job's progress
within 15 s of the chief's, and ``kubectl get psjob`` shows it."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .conftest import OperatorProcess, create_job, delete_namespace, get_job, job_manifest, make_namespace, wait_state

pytestmark = pytest.mark.timeout(180)


def test_the_operator_reads_the_chiefs_metrics_into_kubectl_get(crd, kube, tmp_path):
    served = {"step": 120, "examples": 61440.0}

    class Chief(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = (f"kubeps_train_step {served['step']}.0\nkubeps_train_examples_total {served['examples']}\n"
                    "kubeps_checkpoint_step 100.0\n").encode()
            self.send_response(200 if self.path == f"/{ns}/ctr/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Chief)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ns = make_namespace(kube, prefix="kpg-")
    proc = OperatorProcess(kube, [ns], tmp_path / "operator.log", extra_env={
        "KUBEPS_CHIEF_METRICS_URL": f"http://127.0.0.1:{server.server_port}/{{namespace}}/{{job}}/metrics",
        "KUBEPS_PROGRESS_INTERVAL": "1"})
    try:
        proc.start()
        create_job(kube, ns, job_manifest("ctr", ps=1, workers=1))
        wait_state(kube, ns, "ctr", "Running")

        def progress(step: int):
            def check():
                found = (get_job(kube, ns, "ctr").get("status") or {}).get("progress") or {}
                return found if found.get("step") == step else None
            return check

        first = kube.wait_for(progress(120), timeout=15, what="status.progress.step 120")
        assert first["lastCheckpointStep"] == 100
        served.update(step=220, examples=61440.0 + 100 * 512)
        second = kube.wait_for(progress(220), timeout=15, what="status.progress.step 220 within 15 s")
        assert int(second["examplesPerSecond"]) > 0
        table = kube.kubectl("get", "psjob", "ctr", "-n", ns).stdout.splitlines()
        header, row = table[0].split(), table[1].split()
        assert header[6:8] == ["STEP", "EXAMPLES/S"] and row[6] == "220" and int(row[7]) > 0, table
    finally:
        proc.stop()
        server.shutdown()
        delete_namespace(kube, ns)
