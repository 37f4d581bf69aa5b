"""The kopf handlers: what kopf calls. ``kopf run -m kubeps.operator.controller.handlers`` works.

Level-based and finalizer-free:

* ``@kopf.on.event`` for PSTrainingJobs hands the latest body of every job to the reconciler
  (:class:`~.reconciler.Reconciler`, kopf's ``memo.reconciler``), which triggers its reconcile; no create/update
  handlers, timers or daemons, so kopf adds no finalizer and a job deletes (with its children, by ownerReference
  garbage collection) even while the operator is down. kopf also does the peering, the namespace patterns, the
  liveness probe (``@kopf.on.probe`` adds the reconciler's counts) and the Events.
* ``@kopf.on.login`` gives kopf the operator's own credentials (:func:`kubeps.operator.kube.client.login`);
  ``@kopf.on.startup`` reads kopf's scope and peering into the reconciler (and, under ``kopf run``, builds one
  from the environment); ``@kopf.on.cleanup`` stops its watches.
* The pods and Services are not kopf's: the reconciler's scopes watch them (:mod:`.scope`).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf

from kubeps.operator.api import models
from kubeps.operator.kube import client

from . import kopf_namespaces
from .reconciler import Reconciler
from .settings import Settings, kopf_settings

log = logging.getLogger("kubeps.operator")

kopf_namespaces.install()  # before kopf's observers start (this module is imported first)


@kopf.on.login()
def _login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials are ours (service account, kubeconfig, kubeconfig exec plugins): no client library."""
    return client.login(settings)


@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    if "reconciler" not in memo:
        # `kopf run -m kubeps.operator.controller.handlers`: our settings from the environment, kopf's CLI decides
        # the peering.
        ours = Settings.from_env()
        kopf_settings(ours, target=settings, peering=False)
        memo.reconciler = Reconciler(ours)
    ours = memo.reconciler.settings
    kueue_on = await memo.reconciler.start_kueue()
    memo.reconciler.start_progress()
    memo.reconciler.configure(
        clusterwide=settings.peering.clusterwide,
        peering=None if settings.peering.standalone else (settings.peering.name, settings.peering.priority))
    log.info("kubeps operator starting: namespaces=%s default image=%s cluster domain=%s qps=%s kueue=%s peering=%s",
             ",".join(ours.namespaces) or "(all)", ours.default_image, ours.cluster_domain, ours.api_qps,
             f"{'on' if kueue_on else 'off'} ({ours.kueue})",
             "off" if settings.peering.standalone else f"{settings.peering.name} (priority {settings.peering.priority})")


@kopf.on.cleanup()
async def _cleanup(memo: kopf.Memo, **_: Any) -> None:
    if "reconciler" in memo:
        await memo.reconciler.close()


def _plain(body: kopf.Body) -> dict[str, Any]:
    """A private plain copy of kopf's body, without managedFields (the cache keeps it until the next event)."""
    raw = {key: copy.deepcopy(value) for key, value in body.items()}
    meta = raw.get("metadata") or {}
    meta.pop("managedFields", None)
    return raw


@kopf.on.event(models.GROUP, models.VERSION, models.PLURAL)
async def _job_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.reconciler.observe_job(event.get("type"), _plain(body))


@kopf.on.probe(id="reconciler")
async def _probe(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    reconciler = memo.reconciler
    return {
        "jobs": len(reconciler.cache.jobs),
        "reconciles": reconciler.reconciles,
        "in_flight": len(reconciler.queue.tasks),
        "last_error": reconciler.queue.last_error,
    }
