"""What every part of the actuator (:mod:`.control` and the parts it names) shares: the delays before a refused
write is tried again, the API server's own words for a refusal, writes run with bounded concurrency, and
:class:`ControlPart`, the collaborators each part writes with."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Awaitable, Callable, TypeVar

from kubeps.operator.kube.client import ApiError, KubeClient

from .cache import Cache, Key
from .recorder import Recorder

T = TypeVar("T")

#: Seconds before a create the API server refused for a reason that may pass (or a foreign Secret) is retried.
RETRY_CREATE_AFTER = 5.0
RETRY_SECRET_AFTER = 2.0


async def bounded(calls: list[Awaitable[T]], limit: int) -> list[T | BaseException]:
    """``asyncio.gather(*calls, return_exceptions=True)`` with at most ``limit`` of them running at once."""
    slots = asyncio.Semaphore(max(1, limit))

    async def one(call: Awaitable[T]) -> T:
        async with slots:
            return await call

    return await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)


class ControlPart:
    """A part of the actuator: writes through ``kube``, remembers in ``cache``, tells ``recorder``;
    ``retry(key, delay)`` reconciles the job again later, ``fail(key, reason, message)`` fails it (the
    reconciler's)."""

    def __init__(self, kube: KubeClient, cache: Cache, recorder: Recorder, retry: Callable[[Key, float], None],
                 fail: Callable[[Key, str, str], Awaitable[None]]):
        self.kube, self.cache, self.recorder = kube, cache, recorder
        self.retry, self.fail = retry, fail


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def api_message(err: ApiError) -> str:
    """What the API server said of a refusal (its Status object's message), else the error's text."""
    try:
        return str(json.loads(err.body)["message"])
    except Exception:  # noqa: BLE001 - any answer that is not a Status object: say what the error says
        return str(err)
