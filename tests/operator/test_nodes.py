"""Table tests of the pure rules for lost nodes (kubeps.operator.core.nodes) and the job's PodDisruptionBudget
(kubeps.operator.core.disruption), and of the two together with the planner: what a job does when a node of its
pods is lost."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kubeps.operator.core import actions as A, disruption
from kubeps.operator.core import nodes as N
from kubeps.operator.core import planner as P

from .test_planner import NOW, World, make_job, observe


def node(name="n1", ready="True", since=NOW - timedelta(hours=1), taints=()):
    return {"metadata": {"name": name},
            "spec": {"taints": [{"key": t, "effect": "NoExecute"} for t in taints]},
            "status": {"conditions": [{"type": "Ready", "status": ready,
                                       "lastTransitionTime": since.strftime("%Y-%m-%dT%H:%M:%SZ")}]}}


def state(lease_age: float | None = 5, **kw) -> N.NodeState:
    s = N.node_state(node(**kw))
    return N.NodeState(**{**s.__dict__, "lease_seen": None if lease_age is None else NOW - timedelta(seconds=lease_age)})


# ---------------------------------------------------------------------------------------------- verdicts
@pytest.mark.parametrize("st, lost, words", [
    (state(), False, ""),
    (state(lease_age=19.9), False, ""),
    (state(lease_age=20), True, "did not renew its Lease for 20 s"),
    (state(lease_age=None), False, ""),  # no Lease seen (yet): the node controller decides
    (state(ready="Unknown"), True, "Ready=Unknown since"),
    (state(taints=[N.TAINT_UNREACHABLE]), True, "tainted node.kubernetes.io/unreachable"),
    (state(ready="False", since=NOW - timedelta(seconds=5)), False, ""),
    (state(ready="False", since=NOW - timedelta(seconds=25)), True, "not ready for 25 s"),
    (state(taints=[N.TAINT_NOT_READY], since=NOW - timedelta(seconds=3)), False, ""),
    (None, True, "no longer exists"),
])
def test_verdicts(st, lost, words):
    verdict = N.assess(st, NOW, 20)
    assert verdict.lost is lost
    assert words in verdict.why


def test_recheck_when_the_lease_would_go_stale():
    assert N.assess(state(lease_age=5), NOW, 20).recheck_after == pytest.approx(15)
    # Ready=False for 15 s with a fresh Lease: the sooner of the two
    assert N.assess(state(lease_age=2, ready="False", since=NOW - timedelta(seconds=15)), NOW,
                    20).recheck_after == pytest.approx(5)
    assert N.assess(state(lease_age=None), NOW, 20).recheck_after is None


def test_lost_after_zero_leaves_it_to_the_node_controller():
    assert not N.assess(state(lease_age=600), NOW, 0).lost
    assert not N.assess(state(ready="False", since=NOW - timedelta(hours=1)), NOW, 0).lost
    assert N.assess(state(ready="Unknown"), NOW, 0).lost
    assert N.assess(state(lease_age=600), NOW, 0).recheck_after is None


def test_node_state_reads_a_node_with_missing_fields():
    assert N.node_state({}) == N.NodeState(name="")
    assert N.node_state({"metadata": {"name": "x"}, "status": {"conditions": [{"type": "Ready"}]}}).ready is None


# ---------------------------------------------------------------------------------------------- pods
def pod(name, node_name="n1", phase="Running", deleting=False, uid=None):
    meta = {"name": name, "uid": uid or f"uid-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T11:59:00Z"
    return {"metadata": meta, "spec": {"nodeName": node_name} if node_name else {}, "status": {"phase": phase}}


def test_pods_on_a_lost_node_are_shown_deleted_and_force_deleted():
    pods = [pod("j-ps-0", "dead"), pod("j-worker-0", "alive"), pod("j-worker-1", "dead", deleting=True),
            pod("j-worker-2", None, phase="Pending"), pod("j-chief-0", "dead", phase="Succeeded")]
    view = {"dead": state(lease_age=60, name="dead"), "alive": state(name="alive")}
    loss = N.replace_lost_pods(pods, view, NOW, 20)
    shown = {p["metadata"]["name"]: p for p in loss.pods}
    assert shown["j-ps-0"]["metadata"]["deletionTimestamp"] == "2025-01-01T12:00:00Z"
    assert "deletionTimestamp" not in pods[0]["metadata"], "the cache's copy is not changed"
    assert "deletionTimestamp" not in shown["j-worker-0"]["metadata"]
    assert "deletionTimestamp" not in shown["j-chief-0"]["metadata"]  # finished: the planner's to decide
    assert [(d.name, d.uid, d.node) for d in loss.deletes] == [("j-ps-0", "uid-j-ps-0", "dead"),
                                                                ("j-worker-1", "uid-j-worker-1", "dead")]
    assert [(uid, e.reason) for uid, e in loss.events.items()] == [("uid-j-ps-0", N.R_NODE_LOST)]  # newly deleted
    assert "j-ps-0" in loss.events["uid-j-ps-0"].message
    assert "did not renew its Lease" in loss.events["uid-j-ps-0"].message
    assert set(loss.lost) == {"dead"}


def test_a_pod_on_a_node_that_is_gone_is_replaced():
    loss = N.replace_lost_pods([pod("j-worker-0", "gone")], {}, NOW, 20)
    assert [d.name for d in loss.deletes] == ["j-worker-0"]
    assert "no longer exists" in loss.deletes[0].reason


def test_nothing_is_decided_without_the_nodes():
    pods = [pod("j-ps-0", "dead")]
    loss = N.replace_lost_pods(pods, None, NOW, 20)
    assert loss.pods == pods and not loss.deletes and not loss.events


def test_lost_nodes_are_named():
    view = {"a": state(name="a"), "b": state(lease_age=60, name="b"), "c": state(ready="Unknown", name="c")}
    assert N.lost_nodes(view, NOW, 20) == ["b", "c"]
    assert N.lost_nodes(None, NOW, 20) == []


def test_a_lease_is_stale_against_the_newest_renewal_seen_not_the_clock():
    st = state(lease_age=30, name="a")
    assert N.assess(st, NOW, 20).lost  # no reference given: the clock
    # nothing seen for 25 s: stale by 15 s only (the newest renewal seen + lost_after / 2 is the reference)
    assert not N.assess(st, NOW, 20, leases_until=NOW - timedelta(seconds=25)).lost
    verdict = N.assess(st, NOW, 20, leases_until=NOW - timedelta(seconds=5))
    assert verdict.lost and "did not renew its Lease for 30 s while other nodes did" in verdict.why
    # the newest renewal is the node's own (one node): never stale by its Lease; the node controller decides
    assert not N.assess(st, NOW, 20, leases_until=NOW - timedelta(seconds=30)).lost
    assert N.assess(state(lease_age=30, ready="Unknown"), NOW, 20, leases_until=NOW - timedelta(seconds=30)).lost


def test_every_node_lost_at_once_decides_nothing_but_a_node_that_is_gone():
    view = {"a": state(lease_age=60, name="a"), "b": state(ready="Unknown", name="b")}
    assert N.all_lost(view, NOW, 20) and not N.all_lost({}, NOW, 20) and not N.all_lost(None, NOW, 20)
    pods = [pod("j-ps-0", "a"), pod("j-worker-0", "b"), pod("j-worker-1", "gone")]
    loss = N.replace_lost_pods(pods, view, NOW, 20)
    assert [d.name for d in loss.deletes] == ["j-worker-1"] and set(loss.lost) == {"gone"}
    assert N.lost_nodes(view, NOW, 20) == []
    # one node healthy again: the others are lost
    view["c"] = state(name="c")
    assert N.lost_nodes(view, NOW, 20) == ["a", "b"]
    assert {d.name for d in N.replace_lost_pods(pods, view, NOW, 20).deletes} == {"j-ps-0", "j-worker-0", "j-worker-1"}


def test_node_watch_acts_on_the_lost_nodes_when_a_full_disruption_ends():
    import asyncio

    from kubeps.operator.controller.nodes import NodeWatch

    async def main():
        changed: list[str] = []
        watch = NodeWatch(None, 20, {}, on_change=changed.append, clock=lambda: NOW)
        watch.nodes.synced.set()
        watch._nodes_listed([node("a"), node("b", ready="Unknown")])
        assert not watch.disrupted
        changed.clear()
        watch._node_event("MODIFIED", node("a", ready="Unknown"))  # every node looks lost
        assert watch.disrupted and changed == ["a"]
        changed.clear()
        watch._node_event("MODIFIED", node("a"))  # a answers again: b is lost, and its jobs are reconciled now
        assert not watch.disrupted and sorted(changed) == ["a", "b"]
        await watch.stop()

    asyncio.run(main())


def create(body: dict) -> A.CreatePod:
    return A.CreatePod("j-ps-0", body, "PS", 0)


def test_new_pods_are_kept_off_lost_nodes():
    off = {"key": "metadata.name", "operator": "NotIn", "values": ["b", "c"]}
    [made] = N.keep_off([create({"spec": {"containers": []}})], ["b", "c"])
    assert made.body["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchFields": [off]}]}
    # The template's own terms keep their meaning (ORed terms, each ANDed with ours); the plan's body is not changed.
    zone = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]}
    body = {"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [zone, {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a"]}]}]}}}}}
    event = A.Event("Normal", "x", "y")
    made, same = N.keep_off([create(body), event], ["b", "c"])
    terms = made.body["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert terms == [{**zone, "matchFields": [off]},
                     {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a"]}, off]}]
    assert same is event
    assert "matchFields" not in body["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert N.keep_off([create(body)], [])[0].body is body


# ---------------------------------------------------------------------------------------------- with the planner
def lose(world: World, view: dict) -> list[A.ForceDeletePod]:
    """One reconcile as the shell does it: the planner, told the nodes (it shows it the pods as the nodes rule
    shows them), then the force deletes."""
    plan = P.plan(observe(world.job, world.pods.values(), world.services.values(), world.secret, world.now,
                          nodes=N.NodesSeen(view, 20)))
    world.apply(plan)
    for d in plan.force_deletes:
        if d.name in world.pods and world.pods[d.name]["metadata"]["uid"] == d.uid:
            del world.pods[d.name]
    return plan.force_deletes


def placed(world: World, where: dict[str, str]) -> None:
    for name, p in world.pods.items():
        p.setdefault("spec", {})["nodeName"] = where.get(name, "alive")


def test_ps_on_a_lost_node_restarts_the_chief_from_the_checkpoint():
    world = World(make_job(ps=2, workers=2)).running_job()
    placed(world, {"ctr-ps-0": "dead", "ctr-worker-1": "dead"})
    chief_uid = world.pods["ctr-chief-0"]["metadata"]["uid"]
    view = {"dead": state(ready="Unknown", name="dead"), "alive": state(name="alive")}
    deletes = lose(world, view)
    assert sorted(d.name for d in deletes) == ["ctr-ps-0", "ctr-worker-1"]
    assert world.is_true("Restarting")
    assert "ps 0 (pod ctr-ps-0) was deleted" in world.cond("Restarting")["message"]
    assert world.job["status"]["chiefEpoch"] == 1
    assert any(e.reason == "PSRestarting" for e in world.events)
    # The chief of the old epoch is restarted; the lost pods are made again, under the same names.
    world.converge()
    assert {"ctr-ps-0", "ctr-worker-1"} <= set(world.pods)
    assert world.pods["ctr-chief-0"]["metadata"]["uid"] != chief_uid
    assert world.job["status"]["backoffCount"] == 1
    assert world.job["status"]["replicaStatuses"]["PS"]["restarts"] == 1


def test_worker_on_a_lost_node_is_replaced_whatever_its_policy():
    world = World(make_job(ps=1, workers=2, policies={"Worker": "Never"})).running_job()
    placed(world, {"ctr-worker-0": "dead"})
    old = world.pods["ctr-worker-0"]["metadata"]["uid"]
    lose(world, {"dead": state(lease_age=45, name="dead"), "alive": state(name="alive")})
    assert "ctr-worker-0" not in world.pods
    world.converge()
    assert world.pods["ctr-worker-0"]["metadata"]["uid"] != old
    assert not world.is_true("Restarting") and not world.is_true("Failed")
    assert world.job["status"].get("backoffCount", 0) == 0


def test_healthy_nodes_change_nothing():
    world = World(make_job(ps=1, workers=1)).running_job()
    placed(world, {})
    before = {n: p["metadata"]["uid"] for n, p in world.pods.items()}
    assert lose(world, {"alive": state(name="alive")}) == []
    assert {n: p["metadata"]["uid"] for n, p in world.pods.items()} == before


def test_one_plan_keeps_new_pods_off_lost_nodes_and_says_node_lost_once_per_pod():
    world = World(make_job(ps=1, workers=2)).running_job()
    placed(world, {"ctr-worker-0": "dead"})
    seen = N.NodesSeen({"dead": state(ready="Unknown", name="dead"), "alive": state(name="alive")}, 20)
    uid = world.pods["ctr-worker-0"]["metadata"]["uid"]

    def plan(nodes: N.NodesSeen) -> A.Plan:
        return P.plan(observe(world.job, world.pods.values(), world.services.values(), world.secret, world.now,
                              nodes=nodes))

    first = plan(seen)
    assert [(d.name, d.uid, d.node) for d in first.force_deletes] == [("ctr-worker-0", uid, "dead")]
    assert [e.reason for e in first.of(A.Event)].count(N.R_NODE_LOST) == 1
    # the shell force-deleted it already: the delete is asked for again (a no-op), the Event is not
    again = plan(N.NodesSeen(seen.states, 20, force_deleted=frozenset({uid})))
    assert [d.name for d in again.force_deletes] == ["ctr-worker-0"]
    assert N.R_NODE_LOST not in [e.reason for e in again.of(A.Event)]
    del world.pods["ctr-worker-0"]
    [create] = plan(seen).of(A.CreatePod)
    terms = create.body["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["dead"]}]}]
    # nodes not known: nothing decided, nothing kept off
    [create] = plan(N.NodesSeen()).of(A.CreatePod)
    assert "affinity" not in create.body["spec"]


# ---------------------------------------------------------------------------------------------- disruption budget
def test_budget_over_chief_and_ps_while_the_job_runs():
    job = make_job(run_policy={"podDisruptionBudget": "ChiefAndPS"})
    assert disruption.wanted(job, terminal=False) is True
    assert disruption.wanted(job, terminal=True) is False
    assert disruption.wanted({**job, "metadata": {**job["metadata"], "deletionTimestamp": "x"}}, False) is False
    assert disruption.wanted(make_job(), terminal=False) is None
    assert disruption.wanted(make_job(run_policy={"podDisruptionBudget": "None"}), terminal=True) is None
    body = disruption.pdb_body(job)
    assert body["metadata"]["name"] == "ctr-chief-ps"
    assert body["metadata"]["ownerReferences"][0]["uid"] == "job-uid"
    assert body["spec"]["minAvailable"] == 3  # the chief and 2 ps: none may go
    sel = body["spec"]["selector"]
    assert sel["matchLabels"] == {"kubeps.dev/job-name": "ctr"}
    assert sel["matchExpressions"] == [{"key": "kubeps.dev/job-role", "operator": "In", "values": ["chief", "ps"]}]


def test_budget_selects_the_chief_and_ps_pods_the_planner_makes():
    world = World(make_job(ps=2, workers=1, run_policy={"podDisruptionBudget": "ChiefAndPS"})).running_job()
    sel = disruption.pdb_body(world.job)["spec"]["selector"]
    chosen = sorted(n for n, p in world.pods.items()
                    if all(p["metadata"]["labels"].get(k) == v for k, v in sel["matchLabels"].items())
                    and p["metadata"]["labels"].get("kubeps.dev/job-role") in sel["matchExpressions"][0]["values"])
    assert chosen == ["ctr-chief-0", "ctr-ps-0", "ctr-ps-1"]


def test_a_bad_budget_value_is_refused_naming_the_field():
    world = World(make_job(run_policy={"podDisruptionBudget": "Workers"}))
    plan = world.step()
    assert world.is_true("Failed")
    assert "podDisruptionBudget" in world.cond("Failed")["message"]
    assert not plan.of(A.CreatePod)


# ---------------------------------------------------------------------------------------------- the shell's watch
def test_node_watch_stamps_renewals_with_its_own_clock_and_looks_again_when_a_lease_goes_stale():
    import asyncio

    from kubeps.operator.controller.nodes import NodeWatch

    async def main():
        clock = [NOW]
        changed: list[str] = []
        watch = NodeWatch(None, 0.3, {}, on_change=changed.append, clock=lambda: clock[0])
        assert watch.view() is None  # not listed yet: nothing is decided
        watch._lease_event("ADDED", {"metadata": {"name": "n1"}, "spec": {"renewTime": "2020-01-01T00:00:00.000000Z"}})
        watch.nodes.synced.set()
        watch._nodes_listed([node("n1"), node("n2")])
        assert sorted(changed) == ["n1", "n2"]
        assert watch.view()["n1"].lease_seen == NOW and watch.view()["n2"].lease_seen is None
        clock[0] = NOW + timedelta(seconds=5)
        # the same renewTime again is no renewal; a new one is stamped with the operator's clock, not the kubelet's
        watch._lease_event("MODIFIED", {"metadata": {"name": "n1"}, "spec": {"renewTime": "2020-01-01T00:00:00.000000Z"}})
        assert watch.view()["n1"].lease_seen == NOW
        watch._lease_event("MODIFIED", {"metadata": {"name": "n1"}, "spec": {"renewTime": "1999-01-01T00:00:00.000000Z"}})
        assert watch.view()["n1"].lease_seen == NOW + timedelta(seconds=5)
        assert watch.leases_until == NOW + timedelta(seconds=5)
        changed.clear()
        clock[0] = NOW + timedelta(seconds=6)
        await asyncio.sleep(0.7)  # lost_after 0.3 s + 0.2 s: the timer looks again, but no other Lease was renewed
        assert changed == [], "an operator that saw no renewal at all (lagging, stalled) calls no node lost"
        watch._lease_event("ADDED", {"metadata": {"name": "n2"}, "spec": {"renewTime": "2020-01-01T00:00:01.000000Z"}})
        assert watch.leases_until == NOW + timedelta(seconds=6)
        await asyncio.sleep(0.5)  # n2 renews, n1 did not for 1 s before that: the timer reconciles n1's jobs
        assert changed == ["n1"]
        assert N.assess(watch.view()["n1"], NOW + timedelta(seconds=6), 0.3, watch.leases_until).lost
        assert not N.assess(watch.view()["n2"], NOW + timedelta(seconds=6), 0.3, watch.leases_until).lost
        # a node event that changes nothing the verdict reads triggers nothing
        changed.clear()
        watch._node_event("MODIFIED", node("n2"))
        assert changed == []
        watch._node_event("MODIFIED", node("n2", ready="Unknown"))
        assert changed == ["n2"]
        watch._node_event("DELETED", node("n2"))
        assert "n2" not in watch.view()
        await watch.stop()

    asyncio.run(main())
