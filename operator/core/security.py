"""The job's security objects: its token Secret (with the job's CA and task certificate), the certificate's
reissue when Workers are added, the NetworkPolicy, and what a lost Secret means for the pods.

Rules (documented for users in docs/operator.md):

* One Secret per job, made before its pods; its task certificate names every task's host. When Workers are added
  beyond the names it covers (and the job is not suspended), a new certificate is issued from the same CA.
* The NetworkPolicy (security.networkPolicy.mode SameJob, or the operator's default) is asked for until the shell
  saw it made, except while the job is suspended.
* The token Secret gone (deleted by hand) while pods run with the token it held: a pod started now would get the
  new token, which the running ones refuse, so every pod is restarted (Restarting, reason TokenSecretLost); not a
  failure of the job's, so nothing counts against backoffLimit.

Functions of a :class:`~.draft.Draft`; pure: no I/O (the shell makes the token, the CA and its keys).
"""

from __future__ import annotations

from kubeps.operator.api.models import NetworkPolicyMode, PSTrainingJobSpec, ReplicaType

from .actions import CreateNetworkPolicy, CreateSecret, ReissueCertificate
from .children import (network_policy_body, network_policy_mode, network_policy_name, secret_body, secret_name,
                       tls_enabled, tls_hosts)
from .draft import Draft
from .flow import On
from .status import COUNTED


def plan_objects(d: Draft, spec: PSTrainingJobSpec) -> None:
    """Ask for the Secret, a certificate that covers every Worker and PS, and the NetworkPolicy, as far as missing."""
    secret = d.observed.secret
    suspended = spec.runPolicy.suspend
    workers = d.desired_counts()[ReplicaType.WORKER]
    ps = d.desired_counts()[ReplicaType.PS]
    if secret is None:
        d.plan.actions.append(CreateSecret(secret_name(d.name), secret_body(d.job),
                                           tuple(tls_hosts(d.job, spec, d.config, workers)), workers, ps))
    elif tls_enabled(spec) and not secret.covers(workers, ps) and not suspended:
        d.plan.actions.append(ReissueCertificate(secret_name(d.name), tuple(tls_hosts(d.job, spec, d.config, workers)),
                                                 workers, ps))
    if network_policy_mode(spec, d.config) is NetworkPolicyMode.SAME_JOB and not suspended and not (
            secret is not None and d.observed.network_policy):
        # not watched: asked for until the shell saw it made (a create that finds it there is a no-op)
        d.plan.actions.append(CreateNetworkPolicy(network_policy_name(d.name), network_policy_body(d.job)))


def restart_for_lost_secret(d: Draft) -> bool:
    """Delete every pod of the job when its token Secret is gone; returns whether any was deleted."""
    if d.observed.secret is not None:
        return False
    present = [p for p in d.pods if not p.terminating]
    if not present:
        return False
    message = (f"Secret {secret_name(d.name)} was deleted while {len(present)} pod(s) held its token; "
               f"restarting them all with a new token, the chief restores the latest checkpoint.")
    d.move(On.SECRET_LOST, message)
    for pod in sorted(present, key=lambda p: p.name):
        if pod.replica_type in COUNTED and d.book.retire(pod):
            d.book.replica_status(pod.replica_type).restarts += 1
        else:
            d.book.mark_handled(pod)
        d.delete_pod(pod, "token Secret lost")
    return True
