"""observe_pods: each pod version is read once, whatever the number of reconciles that see it."""

from __future__ import annotations

import copy

import pytest

from kubeps.operator.core import observed
from kubeps.operator.core.observed import controlled_by, observe_pod, observe_pods


def _pod(uid: str, version: str | None, phase: str = "Running", owner: str = "job", controller: bool = True) -> dict:
    meta = {"name": f"p-{uid}", "uid": uid, "labels": {"kubeps.dev/replica-type": "worker",
                                                       "kubeps.dev/replica-index": "0"},
            "ownerReferences": [{"uid": owner, "controller": controller}]}
    if version is not None:
        meta["resourceVersion"] = version
    return {"metadata": meta, "status": {"phase": phase}}


def test_a_pod_version_is_read_once_and_a_new_version_again(monkeypatch):
    reads = []
    monkeypatch.setattr(observed, "observe_pod", lambda pod: reads.append(pod) or observe_pod(pod))
    pods = [_pod(f"u{i}", "1") for i in range(50)]
    first = observe_pods(pods, "job")
    again = observe_pods(copy.deepcopy(pods), "job")  # the watch cache hands out new dicts of the same versions
    assert len(reads) == 50 and [a is b for a, b in zip(first, again)] == [True] * 50
    changed = _pod("u0", "2", phase="Failed")
    assert observe_pods([changed, *pods[1:]], "job")[0].phase == "Failed" and len(reads) == 51


def test_a_copy_marked_deleted_is_read_as_terminating():
    """The lost-node rules mark a copy of the pod (same version) deleted: that is another observation."""
    pod = _pod("lost", "9")
    assert not observe_pods([pod], "job")[0].terminating
    marked = copy.deepcopy(pod)
    marked["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert observe_pods([marked], "job")[0].terminating
    assert not observe_pods([pod], "job")[0].terminating


@pytest.mark.parametrize("owner, controller, job", [("job", True, "job"), ("job", False, "job"), ("other", True, "job"),
                                                     ("job", True, None)])
def test_the_same_pods_as_controlled_by(owner, controller, job):
    for version in ("3", None):  # cached or read every time
        pod = _pod(f"x-{owner}-{controller}-{job}-{version}", version, owner=owner, controller=controller)
        assert bool(observe_pods([pod], job)) == controlled_by(pod, job)


def test_observations_cannot_be_changed_in_place():
    """Shared between reconciles, an observation is frozen: a rule that changed one would change it for all."""
    seen = observe_pods([_pod("f", "1")], "job")[0]
    with pytest.raises(AttributeError):
        seen.phase = "Failed"  # type: ignore[misc]


@pytest.mark.parametrize("owner, controller, job", [("job", True, "job"), ("job", False, "job"), ("other", True, "job")])
def test_owned_children_are_the_same_as_controlled_by(owner, controller, job):
    from kubeps.operator.core.observed import owned

    for version in ("5", None):
        service = {"metadata": {"name": "s", "uid": f"s-{owner}-{controller}-{version}", "resourceVersion": version,
                                "ownerReferences": [{"uid": owner, "controller": controller}]}}
        assert owned([service], job) == ([service] if controlled_by(service, job) else [])
        assert owned([service], job) == owned([copy.deepcopy(service)], job)  # a version read once, same answer
