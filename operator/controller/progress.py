"""Training progress in ``kubectl get psjob``: the operator reads each running job's chief's metrics and writes
``status.progress`` (Kubeflow's controllers have no such reader; pods get no API credentials for it).

Every ``progress_interval`` seconds (default 10; every second for a job whose ps count change waits for the chief's
checkpoint) :class:`ProgressReader` GETs ``/metrics`` and the membership ack
(:data:`~kubeps.runtime.contract.MEMBERSHIP_ACK_PATH`, a :class:`~kubeps.runtime.cluster.MembershipAck` as JSON)
of the chief of every Running or Restarting job it watches
(``http://<job>-chief-0.<namespace>.svc[.<domain>]:<metrics port>``, at most 16 at a time, 3 s each), reads the
step, the examples counter and the last checkpoint's step from the metrics (:mod:`kubeps.operator.core.progress`),
and patches ``status.progress`` and ``status.membershipAck`` when the step, the checkpoint or the ack changed. The
planner decides from the ack alone; a malformed or absent ack is logged and changes nothing.
The writes are spaced to at most ``progress_writes_per_second`` (default 20) over all jobs, so 200 jobs cost the
API server 20 status patches a second at most, and a job's progress is at most ``200 / 20 = 10`` s behind the
interval. A hot ps the chief's detector flags (``kubeps_ps_imbalanced``) becomes a Warning Event
``PSImbalance`` on the job, once per change, naming the ps and its busiest variable shard.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from pydantic import ValidationError

from kubeps.runtime.cluster import MembershipAck
from kubeps.runtime.contract import MEMBERSHIP_ACK_PATH

from kubeps.operator.api import models
from kubeps.operator.core.observed import fmt_time
from kubeps.operator.core.progress import ChiefReading, progress, read_chief

from .cache import Cache
from .metrics import phase_of
from .recorder import Recorder

__all__ = ["ProgressReader", "chief_ack_url", "chief_metrics_url"]

log = logging.getLogger("kubeps.operator.progress")
#: the fields of ``status.progress`` whose change is written (the rate alone is not)
_WRITTEN_WHEN_CHANGED = ("step", "lastCheckpointStep", "membershipGeneration", "workersDraining", "checkpointRequest")
#: seconds between two reads of a chief that was asked for a checkpoint and has not reported it served yet (a ps
#: count change waits for it)
WAITING_INTERVAL_S = 1.0
#: chiefs read at once, and the seconds one read may take
CONCURRENT_READS = 16
READ_TIMEOUT_S = 3.0


def chief_metrics_url(job: Mapping[str, Any], cluster_domain: str | None, template: str = "") -> str:
    """``http://<job>-chief-0.<namespace>.svc[.<domain>]:<port>/metrics``: the port named ``metrics`` on the chief's
    template (the operator adds it, 9090, when the template has none). ``template`` (``KUBEPS_CHIEF_METRICS_URL``)
    replaces that URL, with ``{job}``, ``{namespace}``, ``{domain}`` and ``{port}`` filled in."""
    meta = job["metadata"]
    pod_template = ((job.get("spec") or {}).get("replicaSpecs") or {}).get("Chief", {}).get("template") or {}
    port = models.DEFAULT_METRICS_PORT
    for container in (pod_template.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == models.METRICS_PORT_NAME and p.get("containerPort"):
                port = int(p["containerPort"])
    domain = f".{cluster_domain}" if cluster_domain else ""
    if template:
        return template.format(job=meta["name"], namespace=meta["namespace"], domain=domain, port=port)
    return f"http://{meta['name']}-chief-0.{meta['namespace']}.svc{domain}:{port}/metrics"


def chief_ack_url(metrics_url: str) -> str:
    """Where the chief serves its membership ack: its metrics URL with the path's ``/metrics`` replaced by
    :data:`~kubeps.runtime.contract.MEMBERSHIP_ACK_PATH` (``http://<chief>:9090/kubeps/membership``; a path
    before it, as through a proxy, stays), or that path appended to a URL whose path does not end in
    ``/metrics``."""
    parts = urlsplit(metrics_url)
    path = parts.path[:-len("/metrics")] if parts.path.endswith("/metrics") else parts.path.rstrip("/")
    return urlunsplit(parts._replace(path=path + MEMBERSHIP_ACK_PATH, query="", fragment=""))


def _waits_for_checkpoint(job: Mapping[str, Any]) -> bool:
    status = job.get("status") or {}
    request = status.get("checkpointRequest")
    return request is not None and ((status.get("membershipAck") or {}).get("checkpoint") or 0) < request


class ProgressReader:
    """Reads the chiefs' metrics and writes the jobs' ``status.progress`` (``run()`` until ``close()``).

    ``patch(namespace, name, body)`` writes a status merge patch (the Kubernetes client's ``patch_job_status``);
    ``url(job)`` is where a job's chief serves its metrics (tests point it at a server of their own); its
    membership ack is on the same host and port (:func:`chief_ack_url`)."""

    def __init__(self, cache: Cache, recorder: Recorder, patch: Callable[[str, str, dict], Any], *,
                 interval: float = 10.0, writes_per_second: float = 20.0,
                 url: Callable[[Mapping[str, Any]], str] = lambda job: chief_metrics_url(job, None)):
        self.cache = cache
        self.recorder = recorder
        self.patch = patch
        self.interval = interval
        self.gap = 1.0 / writes_per_second
        self.url = url
        self.readings: dict[str, ChiefReading] = {}
        self.hot: dict[str, tuple[tuple[str, str], ...]] = {}
        self.writes = 0
        #: the jobs whose first step was observed (``kubeps_job_time_to_first_step_seconds``)
        self.started: set[str] = set()
        self._next_write = 0.0
        self._write_lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="kubeps-progress")

    async def run(self) -> None:
        due = 0.0
        while True:
            try:
                if time.monotonic() >= due:
                    due = time.monotonic() + self.interval
                    await self.read_all()
                else:
                    await self.read_waiting()
            except Exception:  # noqa: BLE001 - progress is best effort: never stop the loop
                log.exception("reading the chiefs' progress failed")
            await asyncio.sleep(max(0.0, min(WAITING_INTERVAL_S, due - time.monotonic())))

    def _running(self) -> list[Mapping[str, Any]]:
        return [job for job in list(self.cache.jobs.values()) if phase_of(job) in ("Running", "Restarting")]

    async def read_waiting(self) -> None:
        """A pass over the jobs whose ps count change waits for the chief's checkpoint (every
        :data:`WAITING_INTERVAL_S`, so that the restart follows the save within a second)."""
        await asyncio.gather(*(self.read_one(job) for job in self._running() if _waits_for_checkpoint(job)))

    async def read_all(self) -> None:
        """One pass over the running jobs."""
        jobs = self._running()
        alive = {job["metadata"].get("uid") for job in jobs}
        for uid in [u for u in self.readings if u not in alive]:  # finished or gone: forget their last reading
            self.readings.pop(uid, None)
            self.hot.pop(uid, None)
            self.started.discard(uid)
        limit = asyncio.Semaphore(CONCURRENT_READS)

        async def one(job: Mapping[str, Any]) -> None:
            async with limit:
                await self.read_one(job)

        await asyncio.gather(*(one(job) for job in jobs))

    async def read_one(self, job: Mapping[str, Any]) -> None:
        meta = job["metadata"]
        uid = str(meta.get("uid"))
        url = self.url(job)
        text, ack_text = await asyncio.gather(self._get(job, url, "metrics"), self._get(job, chief_ack_url(url), "ack"))
        reading = None if text is None else read_chief(text, time.monotonic())
        ack = None if ack_text is None else self._ack(job, ack_text)
        new = progress(self.readings.get(uid), reading, fmt_time(datetime.now(timezone.utc)), ack)
        if reading is not None:
            self.readings[uid] = reading
            self._hot_ps(job, uid, reading)
        status = job.get("status") or {}
        old = status.get("progress") or {}
        write: dict[str, Any] = {}
        if new is not None and any(new.get(k) != old.get(k) for k in _WRITTEN_WHEN_CHANGED):
            write["progress"] = {**old, **new} if reading is None else new
        if ack is not None and ack.model_dump(mode="json") != status.get("membershipAck"):
            write["membershipAck"] = ack.model_dump(mode="json")
        if not write:
            return  # nothing moved: no write
        await self._spaced()
        try:
            await self.patch(meta["namespace"], meta["name"], {"status": write})
            self.writes += 1
            if not old.get("step") and (new or {}).get("step", 0) > 0 and uid not in self.started:  # once per job
                self.started.add(uid)
                self.recorder.first_step(job)
        except Exception as err:  # noqa: BLE001 - the job may be gone; the next pass tries again
            log.debug("progress of %s/%s not written: %s", meta["namespace"], meta["name"], err)

    async def _get(self, job: Mapping[str, Any], url: str, what: str) -> str | None:
        """The text the chief answers at ``url``; None when it does not answer 200 (logged)."""
        meta = job["metadata"]
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_S))
        try:
            async with self._session.get(url) as answer:
                if answer.status != 200:
                    log.debug("progress of %s/%s: the chief's %s answered %d", meta["namespace"], meta["name"],
                              what, answer.status)
                    return None
                return await answer.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            log.debug("progress of %s/%s: the chief's %s did not answer: %s", meta["namespace"], meta["name"],
                      what, err)
            return None

    @staticmethod
    def _ack(job: Mapping[str, Any], text: str) -> MembershipAck | None:
        """The chief's membership ack from its answer; None (logged) when it is not one."""
        try:
            return MembershipAck.model_validate_json(text)
        except ValidationError as err:
            meta = job["metadata"]
            log.warning("%s/%s: the chief's membership ack is malformed, ignored: %s", meta["namespace"],
                        meta["name"], err.errors(include_url=False)[:1])
            return None

    async def _spaced(self) -> None:
        """Wait for this write's turn: writes over all jobs at least ``gap`` seconds apart."""
        async with self._write_lock:
            now = time.monotonic()
            wait = self._next_write - now
            self._next_write = max(now, self._next_write) + self.gap
        if wait > 0:
            await asyncio.sleep(wait)

    def _hot_ps(self, job: Mapping[str, Any], uid: str, reading: ChiefReading) -> None:
        if reading.hot == self.hot.get(uid, ()):
            return
        self.hot[uid] = reading.hot
        for ps, variable in reading.hot:
            self.recorder.event(job, "Warning", "PSImbalance",
                                f"ps {ps} serves more than twice the mean of the other ps; its busiest variable shard "
                                f"is {variable!r}. Remedy: more shards than ps, or hash the ids "
                                "(docs/observability.md)")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing
                pass
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
