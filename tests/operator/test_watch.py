"""The operator's own list-then-watch (operator/kube/watch.py) and its peering gate (operator/kube/peering.py).

On the real control plane: the first list, every change after it, and a restart that lists again and so learns
of a deletion made while it was away. On a loopback HTTP server, what the API server does too rarely to provoke:
a "410 Gone" in the stream (list again, from the new version), a line over aiohttp's 64 KiB line limit, and a
broken stream (resume from the last version, without listing).
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone

import pytest
from aiohttp import web

from kubeps.operator.kube import client as client_module
from kubeps.operator.kube.client import KubeClient
from kubeps.operator.kube.peering import is_open
from kubeps.operator.kube.watch import Watcher

from .test_client import _client, _serve

LABEL = "kubeps.test/watched"


class Seen:
    """What a Watcher reported: the latest list and the events since."""

    def __init__(self):
        self.lists: list[list[str]] = []
        self.events: list[tuple[str, str]] = []

    def on_list(self, items):
        self.lists.append(sorted(i["metadata"]["name"] for i in items))

    def on_event(self, kind, obj):
        self.events.append((kind, obj["metadata"]["name"]))


async def _until(check, timeout=20.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.05)


def _configmap(name: str, labelled: bool = True) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "labels": {LABEL: "yes"} if labelled else {}}, "data": {"v": "1"}}


def test_list_then_watch_and_a_restart_relists_on_the_real_api_server(kube, namespace, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", kube.kubeconfig)
    ns = namespace
    kube.apply([_configmap("before"), _configmap("unlabelled", labelled=False)], namespace=ns)

    async def main():
        kube_client = KubeClient(qps=100, burst=100, login=client_module.login)
        seen = Seen()
        watcher = Watcher(kube_client, f"/api/v1/namespaces/{ns}/configmaps", label_selector=LABEL,
                          on_list=seen.on_list, on_event=seen.on_event, server_timeout=5).start()
        try:
            await asyncio.wait_for(watcher.synced.wait(), 20)
            assert seen.lists == [["before"]]  # the selector keeps the unlabelled one out
            await asyncio.to_thread(kube.apply, _configmap("during"), ns)
            await asyncio.to_thread(kube.kubectl, "-n", ns, "patch", "configmap", "during", "-p",
                                    '{"data": {"v": "2"}}')
            await asyncio.to_thread(kube.kubectl, "-n", ns, "delete", "configmap", "before")
            await _until(lambda: ("DELETED", "before") in seen.events)
            assert seen.events == [("ADDED", "during"), ("MODIFIED", "during"), ("DELETED", "before")]
            await asyncio.sleep(6)  # the server ends the 5 s watch; it resumes from its version, no new list
            assert watcher.lists == 1 and watcher.task is not None and not watcher.task.done()

            await watcher.stop()  # away: a deletion it cannot see as an event
            await asyncio.to_thread(kube.kubectl, "-n", ns, "delete", "configmap", "during")
            await asyncio.to_thread(kube.apply, _configmap("after"), ns)
            watcher.start()
            await _until(lambda: len(seen.lists) == 2)
            assert seen.lists[1] == ["after"]  # "during" is missing from the new list: gone
        finally:
            await watcher.stop()
            await kube_client.close()

    asyncio.run(main())


def test_gone_lists_again_long_lines_and_broken_streams_resume():
    """410 Gone in the stream: list again. A broken stream: watch again from the last version, no list. A watch
    line of 200 KB: parsed whole."""
    big = "x" * 200_000
    lists, watches = [], []

    def line(kind, name, version, **extra):
        obj = {"metadata": {"name": name, "resourceVersion": str(version)}, **extra}
        return (json.dumps({"type": kind, "object": obj}) + "\n").encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") != "1":
            lists.append(request.query.get("labelSelector"))
            return web.json_response({"metadata": {"resourceVersion": str(10 * len(lists))},
                                      "items": [{"metadata": {"name": f"listed{len(lists)}"}}]})
        watches.append(request.query["resourceVersion"])
        resp = web.StreamResponse()
        await resp.prepare(request)
        if len(watches) == 1:  # an event, then the version is compacted away
            await resp.write(line("ADDED", "a", 11))
            await resp.write(json.dumps({"type": "ERROR", "object": {"code": 410, "message": "too old"}}).encode()
                             + b"\n")
        elif len(watches) == 2:  # a huge object in small pieces, a bookmark, then the connection breaks
            data = line("MODIFIED", "big", 21, data={"v": big})
            for start in range(0, len(data), 1000):
                await resp.write(data[start:start + 1000])
            await resp.write(line("BOOKMARK", "", 25))
            request.transport.close()
            return resp
        else:
            await asyncio.sleep(30)
        return resp

    async def main():
        runner, server = await _serve(handler)
        kube_client = _client(server, ["t"])
        seen = Seen()
        sizes = []
        watcher = Watcher(kube_client, "/api/v1/namespaces/a/configmaps", label_selector="x",
                          on_list=seen.on_list,
                          on_event=lambda k, o: (seen.on_event(k, o), sizes.append(len(json.dumps(o)))))
        watcher.start()
        try:
            await _until(lambda: len(watches) >= 3)
            assert lists == ["x", "x"]  # once at the start, once after the 410
            assert seen.lists == [["listed1"], ["listed2"]]
            assert seen.events == [("ADDED", "a"), ("MODIFIED", "big")] and sizes[1] > 200_000
            assert watches == ["10", "20", "25"]  # after the break: from the bookmark's version, not a new list
        finally:
            await watcher.stop()
            await kube_client.close()
            await runner.cleanup()

    asyncio.run(main())


def _peers(now: datetime, *records: tuple[int, float]) -> dict:
    """A peering object whose peers have (priority, seconds since last seen), lifetime 10 s."""
    return {"status": {f"peer{i}": {"priority": p, "lifetime": 10, "lastseen": (now - timedelta(seconds=ago)).isoformat()}
                       for i, (p, ago) in enumerate(records)}}


@pytest.mark.parametrize("records, expected", [
    (((5, 1),), (True, None)),                   # only this replica
    (((5, 1), (3, 1)), (True, None)),            # a lower one: it waits, this acts
    (((5, 1), (7, 2)), (False, 8.0)),            # a higher live one acts; it expires in 8 s
    (((5, 1), (7, 12)), (True, None)),           # a higher dead one does not count
    (((5, 1), (5, 4)), (False, 6.0)),            # the same priority twice: kopf pauses both, and so does this
    ((), (True, None)),                          # this replica's own record not written yet
])
def test_peering_gate_rule(records, expected):
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    got = is_open(_peers(now, *records), 5, now)
    assert got[0] == expected[0]
    assert got[1] == pytest.approx(expected[1])


def test_peering_gate_is_closed_without_the_peering_object():
    assert is_open(None, 5, datetime.now(timezone.utc)) == (False, None)
    bad = {"status": {"p": {"priority": "high", "lastseen": "yesterday"}, "q": "junk"}}
    assert is_open(bad, 5, datetime.now(timezone.utc)) == (True, None)  # unreadable records are skipped



def test_a_namespace_scope_starts_with_its_first_job_and_retires_after_its_last(kube, namespace, monkeypatch):
    """The reconciler watches a namespace's children from its first job on (lists in before any plan) and stops
    those watches RETIRE_AFTER seconds after its last job is gone."""
    from kubeps.operator.controller import scope as scope_module
    from kubeps.operator.controller.reconciler import Reconciler
    from kubeps.operator.controller.settings import Settings

    monkeypatch.setenv("KUBECONFIG", kube.kubeconfig)
    monkeypatch.setattr(scope_module, "RETIRE_AFTER", 0.5)
    ns = namespace
    kube.apply({"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "j-worker-0", "labels": {"kubeps.dev/job-name": "j"}},
                "spec": {"clusterIP": "None", "ports": [{"port": 2222}]}}, namespace=ns)

    async def main():
        reconciler = Reconciler(Settings(namespaces=(ns,)))
        reconciler.configure(clusterwide=False, peering=None)
        reconciler.reconcile = lambda key: asyncio.sleep(0)  # observe only: no plans, no writes
        job = {"metadata": {"namespace": ns, "name": "j", "uid": "u1", "resourceVersion": "1"}}
        try:
            reconciler.observe_job("ADDED", job)
            scope = reconciler.scopes.active[ns]
            await asyncio.wait_for(scope.ready(), 20)
            assert list(reconciler.cache.services[(ns, "j")].values())[0]["metadata"]["name"] == "j-worker-0"
            reconciler.observe_job("DELETED", job)
            await _until(lambda: ns not in reconciler.scopes.active, timeout=5)
            await _until(lambda: scope.pods.task is None and scope.services.task is None, timeout=5)
            assert (ns, "j") not in reconciler.cache.services
            reconciler.observe_job("ADDED", job)  # a job again: watched again, listed again
            await asyncio.wait_for(reconciler.scopes.active[ns].ready(), 20)
            assert (ns, "j") in reconciler.cache.services
        finally:
            await reconciler.close()

    asyncio.run(main())


def test_the_slim_copy_keeps_everything_the_planner_reads_of_a_pod():
    """The reconciler keeps slim copies of pods; the planner must see in them what it would in the full pod (the
    chief's finishedAt was dropped once, so a chief seen after the deadline never counted by when it exited)."""
    from dataclasses import asdict

    from kubeps.operator.controller.cache import _slim
    from kubeps.operator.core.children import ANNOTATION_EPOCH
    from kubeps.operator.core.observed import observe_pod

    meta = {"name": "j-chief-0", "namespace": "n", "uid": "u", "resourceVersion": "7",
            "labels": {"kubeps.dev/job-name": "j", "kubeps.dev/replica-type": "chief",
                       "kubeps.dev/replica-index": "0"},
            "annotations": {ANNOTATION_EPOCH: "2", "other": "x"},
            "ownerReferences": [{"uid": "job", "controller": True}], "managedFields": [{"manager": "kubelet"}]}
    statuses = [
        {"phase": "Failed", "reason": "Evicted", "conditions": [{"type": "Ready", "status": "False"}],
         "containerStatuses": [{"name": "kubeps", "restartCount": 2, "image": "img",
                                "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                                         "finishedAt": "2026-01-01T00:00:59Z"}}},
                               {"name": "sidecar", "restartCount": 0, "state": {"running": {}}}]},
        {"phase": "Pending", "initContainerStatuses": [
            {"name": "init", "restartCount": 1, "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                                       "message": "secret x not found"}}}]},
        {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled"}],
         "containerStatuses": [{"name": "kubeps", "restartCount": 0,
                                "state": {"waiting": {"reason": "ContainerCreating"}}}]},
    ]
    for status in statuses:
        pod = {"metadata": meta, "spec": {"containers": [{"name": "kubeps"}]}, "status": status}
        assert asdict(observe_pod(_slim(pod, with_status=True))) == asdict(observe_pod(pod))
