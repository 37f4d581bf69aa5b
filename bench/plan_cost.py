"""What one reconcile of a big job costs the operator: ``plan()`` of a running PSTrainingJob of ``--ps`` + ``--workers``
(+ a chief), its pods and Services as the API server would hand them (each with a uid and a resourceVersion).

The job is brought to Running by applying the planner's own creates, then ``plan()`` is timed (process CPU, the
minimum over ``--sets`` sets of ``--plans`` plans) twice in one run, alternating: with the observations of earlier
reconciles kept (as the operator runs), and reading every pod and Service again at each plan, as each reconcile did
before they were kept (the baseline). Prints both and their ratio.

    .venv/bin/python bench/plan_cost.py [--ps 50] [--workers 1000] [--plans 10] [--sets 5]
"""

from __future__ import annotations

import argparse
import itertools
import time
from datetime import datetime, timezone

from kubeps.operator.core import actions as A
from kubeps.operator.core import children, draft, observed
from kubeps.operator.core import planner
from kubeps.operator.core.state import Observed, SecretFacts

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
CONFIG = children.PlanConfig(default_image="example.com/runtime:1", cluster_domain=None)


def job(ps: int, workers: int) -> dict:
    template = {"spec": {"containers": [{"name": "kubeps", "image": "example.com/runtime:1"}]}}
    specs = {rt: {"replicas": n, "restartPolicy": "OnFailure", "template": template}
             for rt, n in (("Chief", 1), ("PS", ps), ("Worker", workers))}
    return {"apiVersion": "kubeps.dev/v1alpha1", "kind": "PSTrainingJob",
            "metadata": {"name": "big", "namespace": "ns", "uid": "job-uid", "generation": 1},
            "spec": {"replicaSpecs": specs, "runPolicy": {}}, "status": {}}


class Cluster:
    """The job's children as the API server keeps them: every write gives a new resourceVersion."""

    def __init__(self, body: dict):
        self.job, self.pods, self.services, self.secret, self.membership = body, {}, {}, None, None
        self.versions = itertools.count(1)

    def observe(self) -> Observed:
        return Observed(self.job, NOW, list(self.pods.values()), list(self.services.values()),
                        None if self.secret is None else SecretFacts.of(self.secret), config=CONFIG,
                        membership=self.membership)

    def _stored(self, body: dict, kind: str) -> dict:
        body["metadata"]["uid"] = f"{kind}-{body['metadata']['name']}"
        body["metadata"]["resourceVersion"] = str(next(self.versions))
        return body

    def apply(self, plan: A.Plan) -> int:
        self.job["status"] = plan.status
        writes = 0
        for action in plan.actions:
            if isinstance(action, A.CreatePod) and action.name not in self.pods:
                self.pods[action.name] = self._stored({**action.body, "status": {"phase": "Pending"}}, "pod")
                writes += 1
            elif isinstance(action, A.CreateService) and action.name not in self.services:
                self.services[action.name] = self._stored(dict(action.body), "svc")
                writes += 1
            elif isinstance(action, A.CreateSecret) and self.secret is None:
                self.secret = {**action.body, "data": {"token": "c2VjcmV0"}}
                writes += 1
            elif isinstance(action, A.ApplyMembership):
                self.membership = children.membership_of(action.body)
        return writes

    def run_all(self) -> None:
        for name, pod in self.pods.items():
            self.pods[name] = {**pod, "metadata": {**pod["metadata"], "resourceVersion": str(next(self.versions))},
                               "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                                          "containerStatuses": [{"name": "kubeps", "restartCount": 0,
                                                                 "state": {"running": {}}}]}}


def _read_every_time(pods, controller):
    return [observed.observe_pod(p) for p in pods if observed.controlled_by(p, controller)]


def _owned_every_time(objs, controller):
    return [o for o in objs if observed.controlled_by(o, controller)]


def timed(cluster: Cluster, plans: int, baseline: bool) -> float:
    """CPU ms per plan; ``baseline``: the draft reads every pod and Service as it did before observations were
    kept (``observe_pod`` and ``controlled_by`` of each, at each plan)."""
    kept = draft.observe_pods, draft.owned
    if baseline:
        draft.observe_pods, draft.owned = _read_every_time, _owned_every_time
    try:
        started = time.process_time()
        for _ in range(plans):
            planner.plan(cluster.observe())
        return (time.process_time() - started) / plans * 1000
    finally:
        draft.observe_pods, draft.owned = kept


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--plans", type=int, default=10, help="plans per timed set (10)")
    parser.add_argument("--sets", type=int, default=5, help="timed sets of each kind, alternating (5)")
    args = parser.parse_args()
    cluster = Cluster(job(args.ps, args.workers))
    for _ in range(50):
        if not cluster.apply(planner.plan(cluster.observe())):
            break
    cluster.run_all()
    for _ in range(5):
        cluster.apply(planner.plan(cluster.observe()))
    phase = (cluster.job["status"].get("conditions") or [{}])[-1].get("type")
    pods = len(cluster.pods)
    warm, cold = [], []
    for _ in range(args.sets):
        cold.append(timed(cluster, args.plans, baseline=True))
        warm.append(timed(cluster, args.plans, baseline=False))
    print(f"plan() of a {phase} job of {pods} pods and {len(cluster.services)} Services, CPU ms per reconcile "
          f"(min of {args.sets} sets of {args.plans}): every pod read again (baseline) {min(cold):.1f}, "
          f"observations kept {min(warm):.1f}: {min(warm) / min(cold):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
