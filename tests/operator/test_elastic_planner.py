"""The planner keeps the job's membership ConfigMap on the spec's Workers (pure, no control plane): what the chief
of a running job dispatches to when ``replicaSpecs.Worker.replicas`` changes, and what the chief pod mounts."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from kubeps.operator.core import actions as A, children
from kubeps.operator.core import planner as P
from kubeps.runtime.cluster import Membership, MembershipAck

from .test_planner import CONFIG, World, make_job, observe, running


def _addresses(count: int) -> list[str]:
    return [f"ctr-worker-{i}.ns.svc:2222" for i in range(count)]


@pytest.mark.parametrize("seen, workers, written", [
    # (document in the ConfigMap, Worker replicas, (generation, count) written or None)
    (None, 3, (1, 3)),  # none yet: the first one
    (Membership(generation=1, workers=_addresses(3)), 3, None),  # as the spec says: nothing
    (Membership(generation=1, workers=_addresses(3)), 5, (2, 5)),  # scale-up: next generation
    (Membership(generation=4, workers=_addresses(3)), 1, (5, 1)),  # scale-down: the highest indexes leave
    (Membership(generation=2, workers=["elsewhere:1", *_addresses(3)[1:]]), 3, (3, 3)),  # a stale address
])
def test_membership_follows_the_worker_replicas(seen, workers, written):
    job = make_job(workers=workers, status={"state": "Running"})
    plan = P.plan(observe(job, [], [], {"metadata": {}}, membership=seen))
    applied = plan.of(A.ApplyMembership)
    if written is None:
        assert applied == []
        return
    [action] = applied
    document = children.membership_of(action.body)
    assert (action.generation, action.workers) == written == (document.generation, len(document.workers))
    assert document.workers == _addresses(workers)
    assert action.name == "ctr-kubeps-membership" and action.body["kind"] == "ConfigMap"
    assert action.body["metadata"]["ownerReferences"][0]["uid"] == "job-uid"
    changed = [e for e in plan.of(A.Event) if e.reason == "WorkersChanged"]
    assert len(changed) == (seen is not None)


def test_a_suspended_job_writes_no_membership():
    job = make_job(run_policy={"suspend": True}, status={"state": "Running"})
    assert P.plan(observe(job, [], [], {"metadata": {}})).of(A.ApplyMembership) == []


def test_the_chief_mounts_the_membership_and_is_told_where_and_the_others_are_not():
    world = World(make_job(workers=2))
    pods = {a.name: a.body for a in world.plan().of(A.CreatePod)}
    chief = pods["ctr-chief-0"]["spec"]
    main = chief["containers"][0]
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["KUBEPS_MEMBERSHIP_FILE"] == "/var/run/kubeps/membership/membership.json"
    [volume] = [v for v in chief["volumes"] if v["name"] == children.MEMBERSHIP_VOLUME]
    assert volume["configMap"] == {"name": "ctr-kubeps-membership", "optional": True,
                                   "items": [{"key": "membership.json", "path": "membership.json"}]}
    assert {"name": children.MEMBERSHIP_VOLUME, "mountPath": "/var/run/kubeps/membership",
            "readOnly": True} in main["volumeMounts"]
    worker = pods["ctr-worker-0"]["spec"]
    assert "KUBEPS_MEMBERSHIP_FILE" not in {e["name"] for e in worker["containers"][0]["env"]}
    assert children.MEMBERSHIP_VOLUME not in {v["name"] for v in worker.get("volumes", [])}


def test_a_running_job_scaled_2_4_1_keeps_its_chief_and_its_membership_on_the_spec():
    world = running(workers=2)
    chief_uid = world.pods["ctr-chief-0"]["metadata"]["uid"]
    assert world.membership == Membership(generation=1, workers=_addresses(2))
    assert world.job["status"]["workerSelector"] == "kubeps.dev/job-name=ctr,kubeps.dev/replica-type=worker"
    for count, generation in ((4, 2), (1, 3)):
        world.job["spec"]["replicaSpecs"]["Worker"]["replicas"] = count
        world.converge()
        world.run_all()
        world.converge()
        assert world.membership == Membership(generation=generation, workers=_addresses(count))
        assert sorted(n for n in world.pods if "worker" in n) == [f"ctr-worker-{i}" for i in range(count)]
        assert world.pods["ctr-chief-0"]["metadata"]["uid"] == chief_uid  # no chief restart
        # told, so that its kubelet refreshes the mounted ConfigMap now
        assert world.pods["ctr-chief-0"]["metadata"]["annotations"][children.ANNOTATION_MEMBERSHIP] == str(generation)
        env = {e["name"]: e.get("value") for e in world.pods[f"ctr-worker-{count - 1}"]["spec"]["containers"][0]["env"]}
        assert len(json.loads(env["TF_CONFIG"])["cluster"]["worker"]) >= count
    assert [e.message.split(":")[0] for e in world.events if e.reason == "WorkersChanged"] == \
        ["Workers 2 -> 4", "Workers 4 -> 1"]


def test_the_chief_is_annotated_once_per_generation_after_the_first():
    world = running(workers=2)
    assert "annotations" not in world.pods["ctr-chief-0"]["metadata"] or children.ANNOTATION_MEMBERSHIP not in \
        world.pods["ctr-chief-0"]["metadata"]["annotations"]  # generation 1 was there before the chief started
    world.job["spec"]["replicaSpecs"]["Worker"]["replicas"] = 3
    plan = world.plan()
    [annotate] = plan.of(A.AnnotatePod)
    assert (annotate.name, annotate.uid) == ("ctr-chief-0", world.pods["ctr-chief-0"]["metadata"]["uid"])
    assert annotate.annotations == {children.ANNOTATION_MEMBERSHIP: "2"}
    world.apply(plan)
    assert world.plan().of(A.AnnotatePod) == []


def test_a_membership_configmap_that_holds_no_document_is_rewritten():
    assert children.membership_of({"data": {"membership.json": "{not json"}}) is None
    assert children.membership_of({"data": {}}) is None
    job = make_job(workers=1, status={"state": "Running"})
    assert len(P.plan(observe(job, [], [], {"metadata": {}}, membership=None, config=CONFIG))
               .of(A.ApplyMembership)) == 1


@pytest.mark.parametrize("before, after", [(2, 3), (3, 1)])
def test_a_ps_count_change_restarts_the_chief_into_the_new_count_without_counting_a_failure(before, after):
    world = running(ps=before)
    assert world.job["status"]["psReplicas"] == before
    chief_uid = world.pods["ctr-chief-0"]["metadata"]["uid"]
    worker_uids = {n: p["metadata"]["uid"] for n, p in world.pods.items() if "-worker-" in n}
    world.job["spec"]["replicaSpecs"]["PS"]["replicas"] = after
    plan = world.plan()  # a chief whose metrics show no membership (a TensorFlow program) is asked, and waited for
    assert "ctr-chief-0" not in [a.name for a in plan.of(A.DeletePod)] and plan.requeue_after <= 5
    world.apply(plan)
    world.now += timedelta(seconds=5)  # (the Checkpointing wait's deadline for a chief with no ack) then restarted
    plan = world.plan()
    assert "ctr-chief-0" in [a.name for a in plan.of(A.DeletePod)]
    # the workers' TF_CONFIG names the ps they use: they are made again with the new one
    assert sorted(_workers_deleted(plan)) == sorted(worker_uids)
    world.apply(plan)
    cond = world.cond("Restarting")
    assert world.is_true("Restarting") and cond["reason"] == "PSReplicasChanged"
    assert f"PS replicas {before} -> {after}" in cond["message"]
    assert [e.reason for e in world.events if e.type == "Warning"] == ["PSReplicasChanged"]
    assert "its latest checkpoint (it did not report checkpoint request 2 served)" in cond["message"]
    world.converge()
    world.run_all()
    world.converge()
    assert world.is_true("Running") and world.pods["ctr-chief-0"]["metadata"]["uid"] != chief_uid
    assert sorted(n for n in world.pods if "-ps-" in n) == [f"ctr-ps-{i}" for i in range(after)]
    for name in ["ctr-chief-0", *worker_uids]:
        env = {e["name"]: e.get("value") for e in world.pods[name]["spec"]["containers"][0]["env"]}
        assert len(json.loads(env["TF_CONFIG"])["cluster"]["ps"]) == after, name
    assert all(world.pods[n]["metadata"]["uid"] != uid for n, uid in worker_uids.items())
    status = world.job["status"]
    assert status["backoffCount"] == 0 and status["chiefEpoch"] == 1 and status["psReplicas"] == after


def _workers_deleted(plan: A.Plan) -> list[str]:
    return [a.name for a in plan.of(A.DeletePod) if "-worker-" in a.name]


def _chief_reports(world: World, generation: int, draining: tuple[int, ...] = (), checkpoint: int = 0) -> None:
    """What the progress reader writes from the chief's membership ack."""
    ack = MembershipAck(generation=generation, workers=[0], draining=list(draining), checkpoint=checkpoint)
    world.job["status"]["membershipAck"] = ack.model_dump(mode="json")


def test_scaled_away_workers_are_deleted_once_the_chief_reports_them_drained():
    world = running(workers=4)
    _chief_reports(world, 1)
    world.job["spec"]["replicaSpecs"]["Worker"]["replicas"] = 1
    plan = world.plan()
    assert plan.of(A.ApplyMembership) and _workers_deleted(plan) == []  # the chief has not seen it yet
    assert plan.requeue_after is not None and plan.requeue_after <= 120
    world.apply(plan)
    _chief_reports(world, 2, (1, 2, 3))  # applied; 1..3 finish the function they run
    assert _workers_deleted(world.plan()) == []
    _chief_reports(world, 2, (2,))  # 1 and 3 drained: their pods go, 2's stays
    assert _workers_deleted(world.plan()) == ["ctr-worker-3", "ctr-worker-1"]
    _chief_reports(world, 2)
    assert _workers_deleted(world.plan()) == ["ctr-worker-3", "ctr-worker-2", "ctr-worker-1"]


def test_metrics_decide_nothing_only_the_ack_does():
    """status.progress (read from the chief's metrics for people) showing the membership applied and nothing
    draining does not let the planner delete a worker the ack still names draining."""
    world = running(workers=3)
    _chief_reports(world, 1)
    world.job["spec"]["replicaSpecs"]["Worker"]["replicas"] = 2
    world.apply(world.plan())
    _chief_reports(world, 2, (2,))
    world.job["status"]["progress"] = {"step": 100, "membershipGeneration": 2, "workersDraining": 0}
    assert _workers_deleted(world.plan()) == []


@pytest.mark.parametrize("ack, later, deleted", [
    (None, 0, True),  # a chief that acknowledges no membership (a TensorFlow program): at once
    (1, 119, False),  # still within the timeout
    (1, 121, True),  # past it: deleted anyway
])
def test_the_drain_is_waited_for_only_from_a_chief_that_reports_it_and_for_a_bounded_time(ack, later, deleted):
    world = running(workers=3)
    world.job["status"]["progress"] = {"step": 100}
    if ack is not None:
        _chief_reports(world, ack)
    world.job["spec"]["replicaSpecs"]["Worker"]["replicas"] = 2
    plan = world.plan()
    first = _workers_deleted(plan)
    world.apply(plan)
    world.now += timedelta(seconds=later)
    assert (first + _workers_deleted(world.plan()) == ["ctr-worker-2"]) is deleted


def test_the_progress_shows_the_membership_from_the_chief_s_ack_even_before_a_step():
    from kubeps.operator.core.progress import progress, read_chief

    ack = MembershipAck(generation=3, workers=[0], draining=[1, 2], checkpoint=3)
    reading = read_chief("# TYPE kubeps_workers gauge\nkubeps_workers 1.0\n", 1.0)
    assert reading.step is None
    assert progress(None, reading, "t", ack) == {"lastUpdateTime": "t", "membershipGeneration": 3,
                                                 "workersDraining": 2, "checkpointRequest": 3}
    assert progress(None, read_chief("kubeps_train_step 5\n", 1.0), "t") == {"lastUpdateTime": "t", "step": 5}
    assert progress(None, read_chief("", 1.0), "t") is None


def _ps_pods(world: World) -> list[str]:
    return sorted(n for n in world.pods if "-ps-" in n)


@pytest.mark.parametrize("before, after", [(2, 3), (3, 1)])
def test_a_ps_count_change_asks_a_kubeps_chief_for_a_checkpoint_and_restarts_it_once_served(before, after):
    world = running(ps=before)
    _chief_reports(world, 1)
    chief_uid = world.pods["ctr-chief-0"]["metadata"]["uid"]
    world.job["spec"]["replicaSpecs"]["PS"]["replicas"] = after
    plan = world.plan()
    assert "ctr-chief-0" not in [a.name for a in plan.of(A.DeletePod)] and _workers_deleted(plan) == []
    [applied] = plan.of(A.ApplyMembership)
    document = children.membership_of(applied.body)
    assert (document.generation, document.checkpoint, document.workers) == (2, 2, world.membership.workers)
    assert [e.reason for e in plan.of(A.Event)] == ["CheckpointRequested"]
    assert plan.requeue_after is not None and plan.requeue_after <= 60
    world.apply(plan)
    assert world.job["status"]["checkpointRequest"] == 2 and world.job["status"]["psReplicas"] == before
    world.converge()
    # waiting: the ps that hold the variables being saved stay, a new one may start; the chief is not touched
    assert _ps_pods(world) == [f"ctr-ps-{i}" for i in range(max(before, after))]
    assert world.pods["ctr-chief-0"]["metadata"]["uid"] == chief_uid
    _chief_reports(world, 2, checkpoint=2)  # the chief saved and says so in its ack
    plan = world.plan()
    assert "ctr-chief-0" in [a.name for a in plan.of(A.DeletePod)]
    world.apply(plan)
    assert "the checkpoint it saved at the request (2)" in world.cond("Restarting")["message"]
    assert world.job["status"].get("checkpointRequest") is None and world.job["status"]["psReplicas"] == after
    world.converge()
    world.run_all()
    world.converge()
    assert world.is_true("Running") and _ps_pods(world) == [f"ctr-ps-{i}" for i in range(after)]
    assert world.membership.checkpoint == 2  # the new chief takes it as its predecessor's: nothing asked of it


@pytest.mark.parametrize("reports, later, restarted", [
    (True, 59, False), (True, 61, True),  # a chief that shows its membership: a minute
    (False, 4, False), (False, 6, True),  # one whose metrics show none (not read yet, or TensorFlow): 5 s
])
def test_a_chief_that_does_not_serve_the_checkpoint_request_is_restarted_after_a_while(reports, later, restarted):
    world = running(ps=2)
    if reports:
        _chief_reports(world, 1)
    world.job["spec"]["replicaSpecs"]["PS"]["replicas"] = 3
    world.apply(world.plan())
    world.now += timedelta(seconds=later)
    plan = world.plan()
    assert ("ctr-chief-0" in [a.name for a in plan.of(A.DeletePod)]) is restarted
    if restarted:
        world.apply(plan)
        assert "it did not report checkpoint request 2 served" in world.cond("Restarting")["message"]
