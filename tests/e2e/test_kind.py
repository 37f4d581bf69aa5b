"""PSTrainingJobs with real pods on kind: the CTR example, lost workers and parameter servers, bad jobs, the
sidecar evaluator, TensorFlow and Keras programs, and `helm uninstall` (last). See tests/e2e/conftest.py for how
the cluster is made."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import time
from datetime import datetime

import pytest
import yaml

from .conftest import KIND_SH, NAMESPACE, RELEASE, REPO, Background, Kind, new_namespace, record, run_early, wait

EXAMPLE = yaml.safe_load((REPO / "examples" / "ctr" / "job.yaml").read_text())


def ctr_job(name: str, *, steps: int = 600, checkpoint: str | None = None, every: int = 100,
            evaluator: bool = False) -> dict:
    """examples/ctr/job.yaml renamed, with more steps and, optionally, checkpoints on the PVC named ``checkpoint``."""
    job = copy.deepcopy(EXAMPLE)
    job["metadata"]["name"] = name
    specs = job["spec"]["replicaSpecs"]
    chief = specs["Chief"]["template"]["spec"]["containers"][0]
    chief["command"] = ["python", "examples/ctr/train.py", "--steps", str(steps), "--train-examples", "40000",
                        "--eval-examples", "10000"]
    if checkpoint:
        chief["command"] += ["--checkpoint-every", str(every)]
        if evaluator:
            ev = copy.deepcopy(specs["PS"])
            ev["replicas"] = 1
            ev["template"]["spec"]["containers"][0]["command"] = [
                "python", "examples/ctr/train.py", "--eval-examples", "10000", "--evaluator-timeout", "120"]
            specs["Evaluator"] = ev
        for rt in ("Chief", "PS", "Evaluator"):
            if rt not in specs:
                continue
            pod = specs[rt]["template"]["spec"]
            c = pod["containers"][0]
            c["env"] = [{"name": "KUBEPS_CHECKPOINT_DIR", "value": f"/ckpt/{name}"}]
            c["volumeMounts"] = [{"name": "ckpt", "mountPath": "/ckpt"}]
            pod["volumes"] = [{"name": "ckpt", "persistentVolumeClaim": {"claimName": checkpoint}}]
    return job


#: CPU request of every pod of a job that runs beside others (``side_by_side``)
SIDE_BY_SIDE_CPU = "50m"


def side_by_side(job: dict) -> dict:
    """``job`` with every replica's CPU request lowered to ``SIDE_BY_SIDE_CPU``, for the jobs that start together
    at the beginning of the run (run_early, the missing-image job). Kind's two worker nodes have 2 CPUs each to
    schedule from; at the example's requests (800-900m a job) the example, another run_early job and the missing-image
    job ask for up to 2,550m of them at once, and a job on a volume (the sidecar evaluator's) needs its chief, ps and
    evaluator on the volume's node: one could be left Pending there until the chief had succeeded and the job was
    over, its evaluator never started. At 50m a job asks for 250-300m. Requests only place pods: the CPU a pod uses
    is not limited by them."""
    for spec in job["spec"]["replicaSpecs"].values():
        container = spec["template"]["spec"]["containers"][0]
        container.setdefault("resources", {}).setdefault("requests", {})["cpu"] = SIDE_BY_SIDE_CPU
    return job


def local_image(job: dict, image: str) -> dict:
    """``job`` with every replica's container running ``image`` from the nodes' own images (no registry is ever
    asked: ``imagePullPolicy: Never``)."""
    for spec in job["spec"]["replicaSpecs"].values():
        container = spec["template"]["spec"]["containers"][0]
        container["image"] = image
        container["imagePullPolicy"] = "Never"
    return job


def pvc(kind: Kind, ns: str, name: str = "ckpt") -> str:
    # kind's local-path provisioner: the volume is bound to one node, and every pod that mounts it is scheduled
    # there (ReadWriteOnce is per node), so the job's pods share it.
    kind.apply(ns, {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    return name


def running(kind: Kind, ns: str, job: str, count: int) -> list[dict] | None:
    pods = [p for p in kind.pods(ns, job) if p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")]
    return pods if len(pods) >= count else None


def pod_phases(kind: Kind, ns: str, job: str) -> list[str]:
    """Each pod of ``job`` as ``name phase node [why it waits]``, for a failure message."""
    out = []
    for p in kind.pods(ns, job):
        why = [c.get("message", c.get("reason", "")) for c in p["status"].get("conditions", [])
               if c.get("status") == "False"]
        out.append(" ".join([p["metadata"]["name"], p["status"].get("phase", "?"),
                             p["spec"].get("nodeName") or "(not scheduled)", *why]))
    return out


def pod_uid(kind: Kind, ns: str, pod: str) -> str:
    return kind.json("-n", ns, "get", "pod", pod)["metadata"]["uid"]


def chief_log(kind: Kind, ns: str, job: str) -> str:
    return kind.logs(ns, f"{job}-chief-0")


def start_and_time(kind: Kind, ns: str, job: dict, pods: int) -> None:
    start = time.monotonic()
    kind.apply(ns, job)
    try:
        wait(lambda: running(kind, ns, job["metadata"]["name"], pods), 180, f"{pods} pods Running", interval=0.25)
    except AssertionError as err:
        raise AssertionError(f"{err}; the job's pods: {pod_phases(kind, ns, job['metadata']['name'])}") from None
    record("job create -> all pods Running", time.monotonic() - start, pods=pods)


def delete_and_time(kind: Kind, ns: str, job: str, pod: str) -> None:
    """Delete a pod (default grace period) and time: the delete itself, and until a new pod of that name runs."""
    old = pod_uid(kind, ns, pod)
    start = time.monotonic()
    kind.kubectl("-n", ns, "delete", "pod", pod, "--wait=true", timeout=60)
    deleted = time.monotonic() - start
    record("pod delete (SIGTERM to gone)", deleted, pod=pod)
    # The runtime image exits on SIGTERM: a delete must not wait out the 30 s grace period.
    assert deleted < 15, f"deleting {pod} took {deleted:.1f} s: the container did not stop on SIGTERM"

    def replaced() -> bool:
        p = kind.json("-n", ns, "get", "pod", pod)
        return p["metadata"]["uid"] != old and p["status"].get("phase") == "Running"
    wait(replaced, 120, f"a new {pod} Running", interval=0.25)
    record("pod delete -> replacement Running", time.monotonic() - start, pod=pod)


def learned(log: str) -> dict:
    m = re.search(r"^RESULT (\{.*\})$", log, re.M)
    assert m, f"no RESULT line in the chief's log:\n{log[-2000:]}"
    result = json.loads(m.group(1))
    assert result["logloss"] < result["base_logloss"], result
    return result


# ---------------------------------------------------------------------------------------------- scenarios


@run_early
def test_ctr_example_succeeds(kind: Kind, ns: str):
    """examples/ctr/job.yaml as users apply it: Succeeded, `kubectl get psjob` says so, the chief printed its eval."""
    start_and_time(kind, ns, EXAMPLE, pods=5)
    start = time.monotonic()
    assert kind.wait_finished(ns, "ctr-e2e") == "Succeeded"
    record("ctr example: Running -> Succeeded", time.monotonic() - start)
    table = kind.kubectl("-n", ns, "get", "psjob", "ctr-e2e")
    print(table)
    assert re.search(r"ctr-e2e\s+Succeeded", table), table
    log = chief_log(kind, ns, "ctr-e2e")
    assert "eval log-loss" in log, log[-2000:]
    learned(log)


def test_worker_deleted_mid_training(kind: Kind, ns: str):
    # Alone (no job of a run_early test beside it): under a loaded machine, two jobs at once made a chief miss its
    # parameter servers' heartbeats (3 x 1 s) and exhaust backoffLimit.
    kind.settle(loads=False)
    # The delete starts at the chief's first step line (a fifth of the steps); the other four fifths must outlast
    # the delete (1-2.5 s) and the replacement's start (2.5-4 s): 4,000 steps, ~8.5 s at the ~460 steps/s of an idle
    # machine, ~35 s at CI's ~110. 1600 steps in all were over in 3.5 s, before the deleted worker was even gone.
    job = ctr_job("lost-worker", steps=5000)
    start_and_time(kind, ns, job, pods=5)
    wait(lambda: re.search(r"^step\s+\d+/", chief_log(kind, ns, "lost-worker"), re.M), 180, "training steps")
    delete_and_time(kind, ns, "lost-worker", "lost-worker-worker-0")
    assert kind.wait_finished(ns, "lost-worker") == "Succeeded"
    learned(chief_log(kind, ns, "lost-worker"))


def test_ps_deleted_chief_resumes_from_checkpoint(kind: Kind, ns: str):
    kind.settle(loads=False)  # alone, as test_worker_deleted_mid_training
    job = ctr_job("lost-ps", steps=4000, checkpoint=pvc(kind, ns), every=100)  # still training when the ps goes
    # A restarted chief may still resolve the old ps address (CoreDNS caches the headless Service's records for up
    # to 30 s) and exit 133 again: each of those restarts counts against backoffLimit (2 in the example); 6 were
    # seen on kind.
    job["spec"]["runPolicy"]["backoffLimit"] = 10
    learned(lose_ps_and_resume(kind, ns, job))


def lose_ps_and_resume(kind: Kind, ns: str, job: dict) -> str:
    """Start ``job`` (checkpoints on), delete ps-0 once the chief has saved one, and check the chief restarted and
    resumed from a checkpoint past step 0 and the job Succeeded; returns the chief's log."""
    name = job["metadata"]["name"]
    start_and_time(kind, ns, job, pods=5)
    wait(lambda: re.search(r"saved \S+", chief_log(kind, ns, name)), 300, "a checkpoint saved")
    first_chief = pod_uid(kind, ns, f"{name}-chief-0")
    delete_and_time(kind, ns, name, f"{name}-ps-0")
    # The chief loses its parameter server, exits 133 and is started again; it resumes from the checkpoint.
    wait(lambda: pod_uid(kind, ns, f"{name}-chief-0") != first_chief
         or "resumed from step" in chief_log(kind, ns, name), 180, "the chief restarted")
    assert kind.wait_finished(ns, name) == "Succeeded"
    log = chief_log(kind, ns, name)
    m = re.search(r"resumed from step (\d+)", log)
    assert m and int(m.group(1)) > 0, f"the chief did not resume from a checkpoint:\n{log[-2000:]}"
    print("restarts:", kind.json("-n", ns, "get", "psjob", name)["status"].get("restarts"))
    return log


def _first_closure_at(kind: Kind, ns: str, pod: str) -> float | None:
    """When ``pod`` (a worker) started its first scheduled function: the ``--closure-log`` its functions append to in
    the worker's own /tmp (``S execution worker pid time``)."""
    out = kind.kubectl("-n", ns, "exec", pod, "--", "cat", "/tmp/closures.log", check=False)
    starts = [float(line.split()[4]) for line in out.splitlines() if line.startswith("S ")]
    return min(starts) if starts else None


def test_workers_scale_2_4_1_on_a_running_job(kind: Kind, ns: str):
    """kubectl scale 2 -> 4 -> 1 while the CTR example trains: the chief is never restarted, the new workers run
    functions (time from kubectl scale to the first one recorded: the membership ConfigMap, the chief pod's
    annotation, the kubelet's refresh, the pod's start), and the job Succeeds having learned."""
    kind.settle(loads=False)
    job = ctr_job("elastic", steps=8000)
    job["spec"]["replicaSpecs"]["Chief"]["template"]["spec"]["containers"][0]["command"] += [
        "--closure-log", "/tmp/closures.log"]
    start_and_time(kind, ns, job, pods=5)
    wait(lambda: re.search(r"^step\s+\d+/", chief_log(kind, ns, "elastic"), re.M), 180, "training steps")
    chief = pod_uid(kind, ns, "elastic-chief-0")
    asked = time.time()
    kind.kubectl("-n", ns, "scale", "psjob", "elastic", "--replicas", "4")
    first = wait(lambda: _first_closure_at(kind, ns, "elastic-worker-3"), 180, "a function on worker 3",
                 interval=0.25)
    record("kubectl scale 2 -> 4 -> new worker's first function", first - asked)
    asked = time.monotonic()
    kind.kubectl("-n", ns, "scale", "psjob", "elastic", "--replicas", "1")
    wait(lambda: not [p for p in kind.pods(ns, "elastic") if p["metadata"]["name"] in
                      ("elastic-worker-1", "elastic-worker-2", "elastic-worker-3")], 120, "workers 1..3 gone")
    record("kubectl scale 4 -> 1 -> pods deleted", time.monotonic() - asked)
    assert kind.wait_finished(ns, "elastic") == "Succeeded"
    assert pod_uid(kind, ns, "elastic-chief-0") == chief, "the chief was restarted"
    log = chief_log(kind, ns, "elastic")
    learned(log)
    # what the passes cut short by the two changes had read is read again, and the chief says how much
    reread = re.findall(r"; (\d+) record\(s\) read again in this job so far\)", log)
    assert reread, log[-3000:]
    print(f"[records] read again across 2 -> 4 -> 1: {reread[-1]}")


def test_ps_scale_2_3_restarts_the_chief_from_its_checkpoint(kind: Kind, ns: str):
    """PS replicas 2 -> 3 on a running job: the chief is asked for a checkpoint and saves it, then restarts
    (Restarting, PSReplicasChanged) and resumes from that checkpoint into three ps; the pause (the change to the
    resumed chief) is recorded."""
    kind.settle(loads=False)
    job = ctr_job("ps-scale", steps=6000, checkpoint=pvc(kind, ns), every=200)
    start_and_time(kind, ns, job, pods=5)
    wait(lambda: re.search(r"saved \S+", chief_log(kind, ns, "ps-scale")), 300, "a checkpoint saved")
    first_chief = pod_uid(kind, ns, "ps-scale-chief-0")
    # the first chief's whole log, to its end: it is deleted right after it saved
    follow = kind.background("ps-scale first chief log", "kubectl", "-n", ns, "logs", "-f", "ps-scale-chief-0")
    asked = time.monotonic()
    kind.kubectl("-n", ns, "patch", "psjob", "ps-scale", "--type", "merge", "-p",
                 json.dumps({"spec": {"replicaSpecs": {"PS": {"replicas": 3}}}}))
    wait(lambda: pod_uid(kind, ns, "ps-scale-chief-0") != first_chief
         and "resumed from step" in chief_log(kind, ns, "ps-scale"), 180, "the chief resumed")
    pause = time.monotonic() - asked
    try:  # its stream ends with the first chief's container
        follow.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        follow.stop()
    saved = re.search(r"checkpoint request (\d+): saved (\S+)", follow.log.read_text())
    assert saved, f"the first chief saved no checkpoint at the request:\n{follow.log.read_text()[-2000:]}"
    resumed = re.search(r"resumed from step (\d+) \((\S+),", chief_log(kind, ns, "ps-scale"))
    record("PS replicas 2 -> 3 -> chief resumed", pause, resumed_from=int(resumed.group(1)),
           saved_at_request=saved.group(2))
    # that checkpoint, or one the program saved itself after it, before the chief stopped: the newest wins
    number = re.compile(r"ckpt-(\d+)$")
    assert int(number.search(resumed.group(2)).group(1)) >= int(number.search(saved.group(2)).group(1)), \
        (resumed.group(0), saved.group(0))
    events = kind.json("-n", ns, "get", "events", "--field-selector",
                       "involvedObject.name=ps-scale,reason=PSReplicasChanged")["items"]
    assert any(f"the checkpoint it saved at the request ({saved.group(1)})" in e["message"] for e in events), events
    status = kind.json("-n", ns, "get", "psjob", "ps-scale")["status"]
    assert status["psReplicas"] == 3
    assert kind.wait_finished(ns, "ps-scale") == "Succeeded"
    learned(chief_log(kind, ns, "ps-scale"))


def start_no_image_job(kind: Kind) -> tuple[str, float]:
    """The missing-image job, in a namespace of its own: started before the first test, since all its test does is
    wait out its deadline (the tests before it run meanwhile)."""
    ns = new_namespace(kind, "test_image_that_does_not_exist")
    job = side_by_side(ctr_job("no-image"))
    job["spec"]["runPolicy"]["activeDeadlineSeconds"] = 45
    local_image(job, "kubeps-runtime:does-not-exist")
    start = time.monotonic()
    kind.apply(ns, job)
    return ns, start


def _when(stamp: str) -> datetime:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.start_early.with_args(start_no_image_job)
def test_image_that_does_not_exist_fails_in_bounded_time(kind: Kind):
    ns, start = kind.started(start_no_image_job)
    try:
        assert kind.wait_finished(ns, "no-image", timeout=max(150 - (time.monotonic() - start), 10)) == "Failed"
        cond = kind.conditions(ns, "no-image")["Failed"]
        print("Failed condition:", cond)
        # Timed by the API's clock (the test may run long after the job failed): created -> Failed.
        created = kind.json("-n", ns, "get", "psjob", "no-image")["metadata"]["creationTimestamp"]
        took = (_when(cond["lastTransitionTime"]) - _when(created)).total_seconds()
        record("missing image -> Failed", took)
        assert took <= 150, f"the job failed {took:.0f} s after it was created"
        assert cond.get("reason") and cond.get("message"), cond
        # Before the deadline the job said why its pods did not start (a TFJob just stays Created).
        warned = kind.json("-n", ns, "get", "events",
                           "--field-selector", "involvedObject.name=no-image,reason=PodsCannotStart")["items"]
        assert warned and "ErrImageNeverPull" in warned[0]["message"], warned
        wait(lambda: not running(kind, ns, "no-image", 1) and not [
            p for p in kind.pods(ns, "no-image") if p["status"].get("phase") in ("Pending", "Running")],
            60, "no pod of the job left running or pending")
    except BaseException:
        kind.diagnose(ns)
        raise
    finally:
        kind.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@run_early
def test_command_that_fails_at_once(kind: Kind, ns: str):
    job = side_by_side(ctr_job("bad-command"))
    chief = job["spec"]["replicaSpecs"]["Chief"]["template"]["spec"]["containers"][0]
    chief["command"] = ["python", "-c", "import sys; print('bad input', file=sys.stderr); sys.exit(3)"]
    start = time.monotonic()
    kind.apply(ns, job)
    assert kind.wait_finished(ns, "bad-command", timeout=120) == "Failed"
    record("failing chief command -> Failed", time.monotonic() - start)
    cond = kind.conditions(ns, "bad-command")["Failed"]
    print("Failed condition:", cond)
    assert cond.get("reason") and cond.get("message"), cond
    wait(lambda: not running(kind, ns, "bad-command", 1), 60, "no pod of the job left running")


#: a TCP connection attempt to each ``host:port`` argument, 3 s each; prints ``PROBE {"host:port": true|false}``
PROBE = """
import json, socket, sys
seen = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        seen[target] = True
    except OSError:
        seen[target] = False
print("PROBE " + json.dumps(seen))
"""


def probed(out: str) -> dict[str, bool]:
    m = re.search(r"^PROBE (\{.*\})$", out, re.M)
    assert m, f"no PROBE line in:\n{out[-2000:]}"
    return json.loads(m.group(1))


def enforcer_nodes(kind: Kind) -> list[str]:
    """The kind nodes where kube-router (hack/kind.sh's NetworkPolicy enforcer) runs; skips where the node image
    has no ipset (kind's published image: no enforcer is started there)."""
    nodes = kind.run("kind", "get", "nodes", "--name", kind.env["KUBEPS_KIND_CLUSTER"]).split()
    if kind.run("docker", "exec", nodes[0], "sh", "-c", "command -v ipset", check=False).strip() == "":
        pytest.skip("the node image has no ipset: hack/kind.sh starts no NetworkPolicy enforcer")
    return [n for n in nodes if kind.run("docker", "exec", n, "pgrep", "-x", "kube-router", check=False).strip()]


@run_early
def test_network_policy_admits_the_job_and_refuses_other_pods(kind: Kind, ns: str):
    """`networkPolicy.mode: SameJob` enforced (kube-router on every node): the job's own pods connect across nodes
    and it trains to Succeeded, the operator reads its progress through the metrics port; a pod labelled as another
    job's is refused at the ps's port while it reaches cluster DNS."""
    nodes = kind.run("kind", "get", "nodes", "--name", kind.env["KUBEPS_KIND_CLUSTER"]).split()
    assert sorted(enforcer_nodes(kind)) == sorted(nodes), "kube-router is not running on every node"
    job = side_by_side(ctr_job("np-e2e", steps=1000))
    job["spec"]["security"] = {"networkPolicy": {"mode": "SameJob"}}
    start_and_time(kind, ns, job, pods=5)
    wait(lambda: kind.kubectl("-n", ns, "get", "networkpolicy", "np-e2e-kubeps", "-o", "name"), 60,
         "the job's NetworkPolicy")
    # the operator reads the chief's progress through the policy (its metrics port admits any pod of the cluster)
    wait(lambda: (kind.json("-n", ns, "get", "psjob", "np-e2e").get("status") or {}).get("progress", {}).get("step"),
         120, "the job's progress in its status")
    worker = kind.json("-n", ns, "get", "pod", "np-e2e-worker-0")
    tf_config = json.loads(next(e["value"] for e in worker["spec"]["containers"][0]["env"] if e["name"] == "TF_CONFIG"))
    port = tf_config["cluster"]["ps"][0].rsplit(":", 1)[1]
    ps = f'{kind.json("-n", ns, "get", "pod", "np-e2e-ps-0")["status"]["podIP"]}:{port}'
    dns = "kube-dns.kube-system.svc.cluster.local:53"
    # A pod of the job (its label) connects, from inside worker-0 (on the other node than ps-0 or the same one).
    own = probed(kind.kubectl("-n", ns, "exec", "np-e2e-worker-0", "--", "python", "-c", PROBE, ps, timeout=60))
    assert own == {ps: True}, own
    probe = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "intruder", "labels": {"kubeps.dev/job-name": "another-job"}},
             "spec": {"restartPolicy": "Never", "containers": [{
                 "name": "probe", "image": kind.env["KUBEPS_E2E_RUNTIME_IMAGE"], "imagePullPolicy": "Never",
                 "command": ["python", "-c", PROBE, ps, dns],
                 "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}}]}}
    kind.apply(ns, probe)
    wait(lambda: kind.json("-n", ns, "get", "pod", "intruder")["status"].get("phase") == "Succeeded", 120,
         "the intruder probe to finish")
    other = probed(kind.logs(ns, "intruder"))
    assert other == {ps: False, dns: True}, other
    assert kind.wait_finished(ns, "np-e2e") == "Succeeded"
    learned(chief_log(kind, ns, "np-e2e"))


@run_early
def test_sidecar_evaluator_scores_the_final_checkpoint(kind: Kind, ns: str):
    claim = pvc(kind, ns)
    job = side_by_side(ctr_job("with-eval", steps=600, checkpoint=claim, every=200, evaluator=True))
    start_and_time(kind, ns, job, pods=6)
    assert kind.wait_finished(ns, "with-eval") == "Succeeded"
    # The job succeeded with its chief; the evaluator is left (runPolicy.evaluatorGraceSeconds, 60 s) to evaluate
    # the final checkpoint and exits by itself.
    finished = wait(lambda: (phase := kind.json("-n", ns, "get", "pod", "with-eval-evaluator-0")["status"].get(
        "phase")) in ("Succeeded", "Failed") and phase, 90, "the evaluator to exit by itself")
    assert finished == "Succeeded", pod_phases(kind, ns, "with-eval")
    # Read the evaluator's metrics from the shared volume.
    reader = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "read-metrics"},
              "spec": {"restartPolicy": "Never",
                       "containers": [{"name": "cat", "image": "kubeps-runtime:e2e",
                                       "command": ["cat", "/ckpt/with-eval/eval/metrics.jsonl"],
                                       "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]}],
                       "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": claim}}]}}
    kind.apply(ns, reader)
    wait(lambda: kind.json("-n", ns, "get", "pod", "read-metrics")["status"].get("phase") in ("Succeeded", "Failed"),
         120, "the metrics reader")
    lines = [json.loads(x) for x in kind.logs(ns, "read-metrics").splitlines() if x.startswith("{")]
    print("\n".join(map(json.dumps, lines)))
    assert lines, "the evaluator wrote no metrics"
    final = max(lines, key=lambda r: r.get("step", 0))
    assert final.get("step") == 600, final


def start_tf_image(kind: Kind) -> Background:
    """`hack/kind.sh tf-image` (a cached build, then about 1.7 GB into the 2 workers) in the background from the
    start: the tests before this one run meanwhile."""
    return kind.background("TensorFlow image", str(KIND_SH), "tf-image")


@pytest.mark.start_early.with_args(start_tf_image)
def test_tensorflow_program_succeeds(kind: Kind, ns: str):
    """A real TensorFlow ParameterServerStrategy program (examples/tf) in a tensorflow-cpu image built here."""
    image = kind.started(start_tf_image)
    start = time.monotonic()
    record("TensorFlow image build + kind load", image.wait(timeout=1800))
    record("TensorFlow image: waited for it", time.monotonic() - start)
    job = local_image(yaml.safe_load((REPO / "examples" / "tf" / "job.yaml").read_text()), "kubeps-tf:e2e")
    start_and_time(kind, ns, job, pods=4)
    assert kind.wait_finished(ns, "tf-ps", timeout=600) == "Succeeded"
    log = chief_log(kind, ns, "tf-ps")
    print(log[-1500:])
    assert re.search(r"variables on /job:ps/replica:0/task:\d", log), log[-2000:]
    assert re.search(r"trained \d+ steps: loss", log), log[-2000:]


def test_keras_fit_job_resumes_after_a_lost_ps(kind: Kind, ns: str):
    """The seed's model.fit flow on kind: examples/keras/job.yaml -- a Keras 3 model trained with kubeps's fit (a
    dataset function, steps_per_execution, BackupAndRestore checkpoints on a claim) in the runtime-keras image
    (loaded with the project's images). ps-0 is deleted after the first checkpoint; the chief loses it, exits 133
    and is started again, resumes from the latest checkpoint, and the job Succeeds with a model that learned."""
    kind.settle(loads=False)  # alone, as test_ps_deleted_chief_resumes_from_checkpoint
    job = local_image(yaml.safe_load((REPO / "examples" / "keras" / "job.yaml").read_text()),
                      "kubeps-runtime-keras:e2e")
    pvc(kind, ns, "keras-checkpoints")  # ReadWriteOnce on kind's local-path: the chief and the ps share its node
    log = lose_ps_and_resume(kind, ns, job)
    assert re.search(r"step 4000: saved \S+ \(final\)", log), log[-2000:]
    learned(log)


def _start_kueue_image(kind: Kind) -> Background:
    from . import kueue_kind

    return kueue_kind.start_image(kind)


@pytest.mark.start_early.with_args(_start_kueue_image)
def test_kueue_preempted_job_resumes_from_its_checkpoint(kind: Kind, ns: str):
    """Real Kueue v0.19.2 in the cluster (tests/e2e/kueue_kind.py), quota for one CTR job: a high-priority job
    preempts a training one, whose pods go; it is re-queued, admitted again once the first finishes, and its chief
    resumes from its latest checkpoint."""
    from . import kueue_kind

    # It restarts the operator and adds webhooks: nothing of the run_early tests may still run.
    kind.settle()
    kueue_kind.install(kind, kind.started(_start_kueue_image))
    try:
        group = "kueue.x-k8s.io/v1beta2"
        kind.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": group, "kind": "ResourceFlavor", "metadata": {"name": "e2e-flavor"}},
            {"apiVersion": group, "kind": "ClusterQueue", "metadata": {"name": "e2e-cq"},
             "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                      "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [
                          {"name": "e2e-flavor", "resources": [{"name": "cpu", "nominalQuota": "1"},
                                                               {"name": "memory", "nominalQuota": "2Gi"}]}]}]}},
            {"apiVersion": group, "kind": "WorkloadPriorityClass", "metadata": {"name": "e2e-low"}, "value": 10},
            {"apiVersion": group, "kind": "WorkloadPriorityClass", "metadata": {"name": "e2e-high"}, "value": 1000},
        ]}))
        kind.apply(ns, {"apiVersion": group, "kind": "LocalQueue", "metadata": {"name": "team"},
                        "spec": {"clusterQueue": "e2e-cq"}})
        low = ctr_job("kq-low", steps=6000, checkpoint=pvc(kind, ns), every=200)  # ~70 s: still training when preempted
        low["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team", "kueue.x-k8s.io/priority-class": "e2e-low"}
        kind.apply(ns, low)
        wait(lambda: running(kind, ns, "kq-low", 5), 240, "the low-priority job admitted and running")
        wait(lambda: re.search(r"saved \S+", chief_log(kind, ns, "kq-low")), 300, "a checkpoint saved")

        high = ctr_job("kq-high", steps=200)
        high["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team", "kueue.x-k8s.io/priority-class": "e2e-high"}
        start = time.monotonic()
        kind.apply(ns, high)
        wait(lambda: kind.conditions(ns, "kq-low").get("Suspended", {}).get("reason") == "Evicted", 120,
             "the low-priority job evicted")
        wait(lambda: not kind.pods(ns, "kq-low"), 120, "the evicted job's pods gone")
        wait(lambda: running(kind, ns, "kq-high", 5), 240, "the high-priority job running")
        record("kueue: preempting job submitted -> running", time.monotonic() - start)
        assert kind.wait_finished(ns, "kq-high", timeout=600) == "Succeeded"

        wait(lambda: running(kind, ns, "kq-low", 5), 240, "the preempted job admitted again")
        wait(lambda: "resumed from step" in chief_log(kind, ns, "kq-low"), 240, "the chief to restore its checkpoint")
        m = re.search(r"resumed from step (\d+)", chief_log(kind, ns, "kq-low"))
        assert m and int(m.group(1)) > 0, chief_log(kind, ns, "kq-low")[-2000:]
        assert kind.wait_finished(ns, "kq-low", timeout=900) == "Succeeded"
        workload = kind.json("-n", ns, "get", "workloads.kueue.x-k8s.io", "-l", "kubeps.dev/job-name=kq-low")["items"][0]
        conditions = {c["type"]: c for c in workload["status"]["conditions"]}
        assert conditions["Finished"]["reason"] == "Succeeded"
    finally:
        kind.kubectl("delete", "clusterqueue.kueue.x-k8s.io", "e2e-cq", "--ignore-not-found", "--wait=false",
                     check=False)
        kueue_kind.uninstall(kind)


def test_zz_helm_uninstall_leaves_nothing_but_the_kept_crd(kind: Kind):
    """Last: `helm uninstall` removes the operator; the CRD stays (crds.keep, documented in docs/install.md)."""
    kind.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "120s", timeout=180)
    sel = f"app.kubernetes.io/instance={RELEASE}"
    wait(lambda: not kind.kubectl("-n", NAMESPACE, "get", "all,serviceaccount,role,rolebinding,secret,configmap",
                                  "-l", sel, "-o", "name").strip(), 60, "the release's namespaced objects gone")
    assert not kind.kubectl("get", "clusterrole,clusterrolebinding", "-l", sel, "-o", "name").strip()
    assert not kind.kubectl("-n", NAMESPACE, "get", "pods", "-o", "name").strip()
    crd = kind.json("get", "crd", "pstrainingjobs.kubeps.dev")
    assert crd["metadata"]["annotations"].get("helm.sh/resource-policy") == "keep"
