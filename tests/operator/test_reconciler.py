"""The reconciler's one plan per reconcile, with a recording stand-in for the API client (no API server): what it
observes, and how a cached Secret found gone before pods are made is handled. The real control plane covers the
rest (tests/operator/test_lifecycle.py, test_security.py)."""

from __future__ import annotations

import asyncio

from kubeps.operator.controller.reconciler import Reconciler
from kubeps.operator.controller.settings import Settings
from kubeps.operator.core.children import ANNOTATION_TLS_WORKERS
from kubeps.operator.core.state import SecretFacts
from kubeps.runtime.cluster import Membership

from .test_planner import make_job

KEY = ("ns", "ctr")


class RecordingKube:
    """Answers every request as if nothing existed (a read finds nothing), and records what was asked."""

    pool_size = 16

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        async def call(*args, **kwargs):
            self.calls.append(name)
            return None

        return call


def reconciler_with(job: dict) -> tuple[Reconciler, RecordingKube]:
    kube = RecordingKube()
    reconciler = Reconciler(Settings(node_lost_after=-1), kube=kube)  # type: ignore[arg-type]
    reconciler.cache.jobs[KEY] = job
    return reconciler, kube


def test_observed_secret_comes_from_the_cache_as_facts_with_the_network_policy_a_field():
    job = make_job(status={"conditions": []})
    reconciler, kube = reconciler_with(job)
    reconciler.cache.secrets[KEY] = "job-uid"
    reconciler.cache.secret_annotations[KEY] = {ANNOTATION_TLS_WORKERS: "3"}
    reconciler.cache.network_policies.add(KEY)
    membership = Membership(generation=2, workers=["ctr-worker-0.ns.svc:2222"])
    reconciler.cache.memberships[KEY] = ("job-uid", membership)  # written by this operator: not read again
    observed = asyncio.run(reconciler.observe(KEY, job, secret_cached=True))
    assert observed.secret == SecretFacts(3) and observed.network_policy and kube.calls == []
    assert observed.membership == membership
    reconciler.cache.network_policies.discard(KEY)
    assert not asyncio.run(reconciler.observe(KEY, job, secret_cached=True)).network_policy


def test_a_cached_secret_gone_before_pods_are_made_aborts_and_requeues_at_once():
    job = make_job(status={"conditions": []})  # reconciled before: its Secret is read, not assumed
    reconciler, kube = reconciler_with(job)
    reconciler.cache.secrets[KEY] = "job-uid"  # seen made; since deleted by hand (reads find nothing)
    again: list = []
    reconciler.queue.again = again.append  # type: ignore[method-assign]
    asyncio.run(reconciler.reconcile(KEY))
    # one plan (it would create pods), checked against the API: nothing written, nothing made, planned again now
    assert kube.calls == ["read_config_map", "read_secret"] and again == [KEY]
    assert KEY not in reconciler.cache.secrets and reconciler.reconciles == 0
    # the next pass reads the Secret and plans with it absent
    observed = asyncio.run(reconciler.observe(KEY, job, secret_cached=KEY in reconciler.cache.secrets))
    # (the ConfigMap found absent is remembered: not read again until written)
    assert observed.secret is None and kube.calls == ["read_config_map", "read_secret", "read_secret"]


def test_a_membership_configmap_that_cannot_be_read_is_planned_as_absent_not_raised():
    from kubeps.operator.kube.client import ApiError

    job = make_job(status={"conditions": []})
    reconciler, kube = reconciler_with(job)

    async def refused(*args, **kwargs):
        raise ApiError("GET", "/api/v1/namespaces/ns/configmaps/ctr-kubeps-membership", 403, "forbidden")

    kube.read_config_map = refused  # type: ignore[attr-defined]
    observed = asyncio.run(reconciler.observe(KEY, job, secret_cached=True))
    assert observed.membership is None and KEY not in reconciler.cache.memberships
