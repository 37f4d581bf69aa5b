"""The operator's own Kubernetes API calls: a few REST requests on kopf's event loop, behind one token bucket.

Every call waits for a token of a shared token bucket (``qps`` per second, ``burst`` at once), so a burst of jobs
cannot flood the API server and the limit is one number to tune (users of TFJob hit its low fixed QPS).

Why not the ``kubernetes`` package: its API classes walk every body into and out of client models, run in a
thread pool, and importing it costs about 20 MB of memory; the operator makes seven kinds of request with plain
dicts. Requests go through :meth:`KubeClient.request`, the one place that sends, reads the whole answer (so a
pooled connection is never handed back with an unread body, whose bytes the next request on it would read as its
status line) and turns a failure into :class:`ApiError`. Credentials come from :func:`login` (kopf's service
account and kubeconfig readers, plus kubeconfig ``exec`` plugins), which the operator also gives kopf.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import urllib.parse
import os
import subprocess
import threading
import time
from typing import Any, AsyncIterator, Callable

import aiohttp
import kopf
import yaml

from kubeps.operator.api import models

APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
JOBS = f"/apis/{models.GROUP}/{models.VERSION}/namespaces"


class ApiError(Exception):
    """A request the API server answered with an error status (``status``; ``body`` is its text)."""

    def __init__(self, method: str, path: str, status: int, body: str):
        self.status, self.body = status, body
        super().__init__(f"{method} {path}: {status} {body[:300]}")


class TokenBucket:
    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.qps = float(qps)
        self.burst = max(1, int(burst))
        self._tokens = float(self.burst)
        self._last = clock()
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()

    def reserve(self) -> float:
        """Take one token; returns the seconds to wait before using it."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.qps)
            self._last = now
            self._tokens -= 1.0
            return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    def acquire(self) -> float:
        """Take one token, sleeping as needed; returns the seconds waited."""
        wait = self.reserve()
        if wait:
            self._sleep(wait)
        return wait


def login(settings: kopf.OperatorSettings | None = None, **_: Any) -> kopf.ConnectionInfo:
    """Credentials as a ``kopf.ConnectionInfo``: the pod's service account, else the kubeconfig (whose ``exec``
    plugin, e.g. a cloud provider's token helper, is run when the user has one)."""
    settings = settings or kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no service account and no kubeconfig (KUBECONFIG or ~/.kube/config)")
    if not (info.token or info.certificate_path or info.certificate_data or info.username):
        token = _exec_token()
        if token:
            info = kopf.ConnectionInfo(**{**_fields(info), "token": token})
    return info


def _fields(info: kopf.ConnectionInfo) -> dict[str, Any]:
    return {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}


def _exec_token() -> str | None:
    """The token of the current kubeconfig user's ``exec`` credential plugin, if it has one."""
    path = (os.environ.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep)[0]
    with open(os.path.expanduser(path), encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    context = next((c.get("context") or {} for c in config.get("contexts") or []
                    if c.get("name") == config.get("current-context")), {})
    user = next((u.get("user") or {} for u in config.get("users") or [] if u.get("name") == context.get("user")), {})
    plugin = user.get("exec")
    if not plugin:
        return None
    env = dict(os.environ, **{e["name"]: e["value"] for e in plugin.get("env") or []})
    out = subprocess.run([plugin["command"], *(plugin.get("args") or [])], env=env, capture_output=True,
                         check=True, timeout=60).stdout
    return (json.loads(out).get("status") or {}).get("token")


class KubeClient:
    """The API calls of the operator, on the running event loop (one aiohttp session, ``pool_size`` connections)."""

    def __init__(self, qps: float = 100.0, burst: int = 200, pool_size: int = 16,
                 login: Callable[[], kopf.ConnectionInfo] = login):
        self.limiter = TokenBucket(qps, burst)
        self.pool_size = max(4, pool_size)
        self.requests = 0
        self._login = login
        self._session: aiohttp.ClientSession | None = None
        self._server = ""
        self._connecting = asyncio.Lock()
        self._slots = asyncio.Semaphore(self.pool_size)
        self._retired: list[aiohttp.ClientSession] = []  # sessions replaced after a 401, closed a little later

    async def _connect(self, stale: aiohttp.ClientSession | None = None) -> aiohttp.ClientSession:
        """The session, opened on first use or when ``stale`` (refused with 401) is still the current one."""
        async with self._connecting:
            if self._session is not None and self._session is not stale:
                return self._session
            info = await asyncio.get_running_loop().run_in_executor(None, self._login)
            headers = {"Accept": "application/json", "User-Agent": "kubeps-operator"}
            if info.token:
                headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
            auth = aiohttp.BasicAuth(info.username, info.password or "") if info.username else None
            ssl = info.as_ssl_context() if info.server.startswith("https") else False
            old = self._session
            self._server = info.server.rstrip("/")
            self._session = aiohttp.ClientSession(
                headers=headers, auth=auth,
                # At most pool_size requests at once (self._slots), so the connector never makes one wait for a
                # connection (its timeouts count from the moment a request is really sent); watch streams, which
                # hold theirs for minutes, come on top.
                connector=aiohttp.TCPConnector(ssl=ssl, limit=0),
                timeout=aiohttp.ClientTimeout(total=60, sock_connect=10))
            if old is not None:  # requests still on it may finish (the total timeout): close it after that
                self._retired.append(old)
                asyncio.get_running_loop().call_later(61, self._close_retired, old)
            return self._session

    def _close_retired(self, session: aiohttp.ClientSession) -> None:
        if session in self._retired:
            self._retired.remove(session)
            asyncio.ensure_future(session.close())

    async def close(self) -> None:
        sessions, self._retired = [self._session, *self._retired], []
        self._session = None
        for session in sessions:
            if session is not None:
                await session.close()

    async def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                      answer: bool = False) -> Any:
        """Send one request; returns the decoded answer when ``answer``, else None. Raises :class:`ApiError`.

        The answer is always read to its end, also when it is not wanted, before the connection is reused; a
        401 logs in again (a rotated service-account token) and retries once.
        """
        data = None if body is None else json.dumps(body)
        async with self._slots:
            wait = self.limiter.reserve()
            if wait:
                await asyncio.sleep(wait)
            session = self._session or await self._connect()
            for attempt in (0, 1):
                self.requests += 1
                async with session.request(method, self._server + path, data=data,
                                           headers={"Content-Type": content_type}) as resp:
                    raw = await resp.read()
                    status = resp.status
                if status == 401 and attempt == 0:
                    session = await self._connect(stale=session)
                    continue
                if status >= 400:
                    raise ApiError(method, path, status, raw.decode(errors="replace"))
                return json.loads(raw) if answer else None

    async def watch(self, path: str, params: dict[str, str], timeout: aiohttp.ClientTimeout) -> AsyncIterator[dict]:
        """The events of one watch request (``{"type": ..., "object": ...}``), until the server ends the stream.

        Not rate-limited (a stream is one request for minutes) and not counted against the pool; lines are split
        here rather than by aiohttp, whose line reader refuses lines over 64 KiB (a pod of a big job is more).
        """
        session = self._session or await self._connect()
        for attempt in (0, 1):
            self.requests += 1
            async with session.get(self._server + path, params=params, timeout=timeout) as resp:
                if resp.status == 401 and attempt == 0:
                    await resp.read()
                    session = await self._connect(stale=session)
                    continue
                if resp.status >= 400:
                    raise ApiError("GET", path, resp.status, (await resp.read()).decode(errors="replace"))
                tail = b""
                async for chunk in resp.content.iter_any():
                    lines = (tail + chunk).split(b"\n")
                    tail = lines.pop()
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)
                if tail.strip():
                    yield json.loads(tail)
                return

    # -- jobs ----------------------------------------------------------------------------------------------------
    async def get_job(self, namespace: str, name: str) -> dict:
        return await self.request("GET", f"{JOBS}/{namespace}/{models.PLURAL}/{name}", answer=True)

    async def patch_job_status(self, namespace: str, name: str, body: dict) -> dict:
        return await self.request("PATCH", f"{JOBS}/{namespace}/{models.PLURAL}/{name}/status", body,
                                  content_type=MERGE_PATCH, answer=True)

    async def delete_job(self, namespace: str, name: str, uid: str | None) -> None:
        await self.request("DELETE", f"{JOBS}/{namespace}/{models.PLURAL}/{name}", _delete_options(uid))

    # -- children ------------------------------------------------------------------------------------------------
    async def create_pod(self, namespace: str, body: dict) -> None:
        await self.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)

    async def delete_pod(self, namespace: str, name: str, uid: str | None, grace_seconds: int | None = None) -> None:
        await self.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", _delete_options(uid, grace_seconds))

    async def patch_pod(self, namespace: str, name: str, body: dict) -> None:
        """A merge patch of a pod (``metadata.uid`` in ``body`` makes it apply to that pod only)."""
        await self.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}", body, content_type=MERGE_PATCH)

    async def create_service(self, namespace: str, body: dict) -> None:
        await self.request("POST", f"/api/v1/namespaces/{namespace}/services", body)

    async def delete_service(self, namespace: str, name: str) -> None:
        await self.request("DELETE", f"/api/v1/namespaces/{namespace}/services/{name}", _delete_options(None))

    async def read_secret(self, namespace: str, name: str) -> dict | None:
        try:
            return await self.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}", answer=True)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def create_secret(self, namespace: str, body: dict) -> None:
        await self.request("POST", f"/api/v1/namespaces/{namespace}/secrets", body)

    async def patch_secret(self, namespace: str, name: str, body: dict) -> dict:
        """A merge patch; with ``metadata.resourceVersion`` in ``body``, a concurrent change answers 409."""
        return await self.request("PATCH", f"/api/v1/namespaces/{namespace}/secrets/{name}", body,
                                  content_type=MERGE_PATCH, answer=True)

    async def read_config_map(self, namespace: str, name: str) -> dict | None:
        try:
            return await self.request("GET", f"/api/v1/namespaces/{namespace}/configmaps/{name}", answer=True)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def write_config_map(self, namespace: str, body: dict) -> None:
        """Create the ConfigMap, or (it exists) merge-patch its ``data`` with ``body``'s."""
        try:
            await self.request("POST", f"/api/v1/namespaces/{namespace}/configmaps", body)
            return
        except ApiError as err:
            if err.status != 409:
                raise
        name = body["metadata"]["name"]
        await self.request("PATCH", f"/api/v1/namespaces/{namespace}/configmaps/{name}", {"data": body["data"]},
                           content_type=MERGE_PATCH)

    async def create_network_policy(self, namespace: str, body: dict) -> None:
        await self.request("POST", f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies", body)

    # -- PodGroups of the gang scheduler (``api_version`` says whose: Kubernetes', Volcano's, scheduler-plugins') --
    async def read_pod_group(self, api_version: str, namespace: str, name: str) -> dict | None:
        try:
            return await self.request("GET", f"/apis/{api_version}/namespaces/{namespace}/podgroups/{name}",
                                      answer=True)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def create_pod_group(self, namespace: str, body: dict) -> None:
        api_version = body["apiVersion"]
        await self.request("POST", f"/apis/{api_version}/namespaces/{namespace}/podgroups", body)

    async def delete_pod_group(self, api_version: str, namespace: str, name: str) -> None:
        await self.request("DELETE", f"/apis/{api_version}/namespaces/{namespace}/podgroups/{name}",
                           _delete_options(None))


    # -- Kueue ---------------------------------------------------------------------------------------------------
    async def served(self, group_version: str) -> bool:
        """Whether the API server serves ``group/version`` (discovery; e.g. ``kueue.x-k8s.io/v1beta2``)."""
        try:
            await self.request("GET", f"/apis/{group_version}", answer=True)
        except ApiError as err:
            if err.status in (403, 404, 503):
                return False
            raise
        return True

    # The paths below are written out (not built from constants): tests/packaging/test_rbac.py reads the chart's
    # rules off them.
    async def create_workload(self, namespace: str, body: dict) -> None:
        await self.request("POST", f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads", body)

    async def patch_workload(self, namespace: str, name: str, body: dict) -> None:
        await self.request("PATCH", f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads/{name}", body,
                           content_type=MERGE_PATCH)

    async def apply_workload_status(self, namespace: str, name: str, status: dict, field_manager: str) -> None:
        """Server-side apply of a Workload's status as ``field_manager`` (forced, as Kueue applies its own)."""
        body = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                "metadata": {"name": name, "namespace": namespace}, "status": status}
        query = urllib.parse.urlencode({"fieldManager": field_manager, "force": "true"})
        await self.request("PATCH", f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads/{name}/status"
                                    f"?{query}", body, content_type=APPLY_PATCH)

    async def delete_workload(self, namespace: str, name: str, uid: str | None) -> None:
        await self.request("DELETE", f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads/{name}",
                           _delete_options(uid))

    async def read_resource_flavor(self, name: str) -> dict | None:
        return await self._read_or_none(f"/apis/kueue.x-k8s.io/v1beta2/resourceflavors/{name}")

    async def read_workload_priority_class(self, name: str) -> dict | None:
        return await self._read_or_none(f"/apis/kueue.x-k8s.io/v1beta2/workloadpriorityclasses/{name}")

    async def read_priority_class(self, name: str) -> dict | None:
        return await self._read_or_none(f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")

    async def _read_or_none(self, path: str) -> dict | None:
        try:
            found: dict = await self.request("GET", path, answer=True)
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        return found

    async def create_pod_disruption_budget(self, namespace: str, body: dict) -> None:
        await self.request("POST", f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets", body)

    async def delete_pod_disruption_budget(self, namespace: str, name: str) -> None:
        await self.request("DELETE", f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}",
                           _delete_options(None))


def _delete_options(uid: str | None, grace_seconds: int | None = None) -> dict:
    body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
    if uid:
        body["preconditions"] = {"uid": uid}
    if grace_seconds is not None:
        body["gracePeriodSeconds"] = grace_seconds
    return body
