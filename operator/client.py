"""A thin, rate-limited, thread-safe wrapper over the Kubernetes API calls the operator makes.

Every call waits for a token of a shared token bucket (``qps`` per second, ``burst`` at once), so a burst of jobs
cannot flood the API server and the limit is one number to tune (users of TFJob hit its low fixed QPS).
Errors are :class:`kubernetes.client.exceptions.ApiException` with ``status`` set.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from . import models

MERGE_PATCH = "application/merge-patch+json"


class TokenBucket:
    def __init__(self, qps: float, burst: int, clock=time.monotonic, sleep=time.sleep):
        self.qps = float(qps)
        self.burst = max(1, int(burst))
        self._tokens = float(self.burst)
        self._last = clock()
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()

    def acquire(self) -> float:
        """Take one token, sleeping as needed; returns the seconds waited."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.qps)
            self._last = now
            self._tokens -= 1.0
            wait = 0.0 if self._tokens >= 0 else -self._tokens / self.qps
        if wait:
            self._sleep(wait)
        return wait


def load_api_client(kubeconfig: str | None = None, pool_size: int = 16):
    """An ApiClient from a kubeconfig (KUBECONFIG or ~/.kube/config) or the in-cluster service account."""
    from kubernetes import client, config  # noqa: PLC0415 - loaded when the operator starts, not on import

    configuration = client.Configuration()
    try:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    except Exception:  # noqa: BLE001 - no kubeconfig: running in a pod
        config.load_incluster_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = max(pool_size, 4)
    return client.ApiClient(configuration)


class KubeClient:
    def __init__(self, api_client, qps: float = 100.0, burst: int = 200):
        from kubernetes import client  # noqa: PLC0415

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.limiter = TokenBucket(qps, burst)

    def _wait(self) -> None:
        self.limiter.acquire()

    # -- jobs ----------------------------------------------------------------------------------------------------
    def get_job(self, namespace: str, name: str) -> dict:
        self._wait()
        return self.custom.get_namespaced_custom_object(models.GROUP, models.VERSION, namespace, models.PLURAL, name)

    def patch_job_status(self, namespace: str, name: str, body: dict) -> dict:
        self._wait()
        return self.custom.patch_namespaced_custom_object_status(
            models.GROUP, models.VERSION, namespace, models.PLURAL, name, body, _content_type=MERGE_PATCH
        )

    def delete_job(self, namespace: str, name: str, uid: str | None) -> None:
        self._wait()
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        self.custom.delete_namespaced_custom_object(
            models.GROUP, models.VERSION, namespace, models.PLURAL, name, body=body
        )

    # -- children ------------------------------------------------------------------------------------------------
    def create_pod(self, namespace: str, body: dict) -> None:
        self._wait()
        self.core.create_namespaced_pod(namespace, body, _preload_content=False).release_conn()

    def delete_pod(self, namespace: str, name: str, uid: str | None, grace_seconds: int | None = None) -> None:
        self._wait()
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        self.core.delete_namespaced_pod(name, namespace, body=body, _preload_content=False).release_conn()

    def create_service(self, namespace: str, body: dict) -> None:
        self._wait()
        self.core.create_namespaced_service(namespace, body, _preload_content=False).release_conn()

    def delete_service(self, namespace: str, name: str) -> None:
        self._wait()
        self.core.delete_namespaced_service(name, namespace, _preload_content=False).release_conn()

    def read_secret(self, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        self._wait()
        try:
            resp = self.core.read_namespaced_secret(name, namespace, _preload_content=False)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return json.loads(resp.data)

    def create_secret(self, namespace: str, body: dict) -> None:
        self._wait()
        self.core.create_namespaced_secret(namespace, body, _preload_content=False).release_conn()
