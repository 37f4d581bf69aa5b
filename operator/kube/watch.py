"""List, then watch, one kind of object in one scope (a namespace or the whole cluster), for as long as it runs.

The operator watches its jobs' pods and Services itself rather than through kopf: kopf gives every event of every
object its own queue, worker, handler kwargs and logger, which was most of the operator's CPU in a burst of jobs
(a pod has 3-4 events on its way to Running). Here an event is a parsed line handed to a callback.

* :meth:`Watcher.run` lists (in pages), reports the whole list (``on_list``: what is not in it is gone), then
  watches from the list's resourceVersion with bookmarks, reporting each change (``on_event``). A watch the
  server ends (its timeout) or a broken connection resumes from the last resourceVersion seen; only "410 Gone"
  (the version was compacted away) lists again. Errors back off from 1 s to 30 s.
* :attr:`Watcher.synced` is set once the first list is reported: the reconciler plans no job of the scope before
  it, so a restarted operator never plans from a half-known world.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from typing import Any, Callable, TypedDict

import aiohttp

from .client import ApiError, KubeClient

log = logging.getLogger("kubeps.operator.kube.watch")

PAGE = 500  # objects per list request


class Timeouts(TypedDict, total=False):
    """The timeouts of a :class:`Watcher` (seconds), as its keyword arguments."""

    server_timeout: float
    client_timeout: float
    connect_timeout: float
    inactivity_timeout: float


class Gone(Exception):
    """The resourceVersion a watch started from is too old: list again."""


class Watcher:
    """One list-then-watch loop; ``on_list(items)`` and ``on_event(type, object)`` run on the event loop."""

    def __init__(self, kube: KubeClient, path: str, *, on_list: Callable[[list[dict]], Any],
                 on_event: Callable[[str, dict], Any], label_selector: str | None = None,
                 field_selector: str | None = None, server_timeout: float = 120.0, client_timeout: float = 150.0,
                 connect_timeout: float = 10.0, inactivity_timeout: float = 180.0):
        self.kube = kube
        self.path = path
        self.on_list = on_list
        self.on_event = on_event
        self.selectors = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector))
                          if v}
        self.server_timeout = int(server_timeout)  # the API server wants an integer
        self.timeout = aiohttp.ClientTimeout(total=client_timeout, sock_connect=connect_timeout,
                                             sock_read=inactivity_timeout)
        self.synced = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.lists = 0  # lists done (the first one, and one per 410 Gone)
        self.version: str | None = None  # the last resourceVersion seen; None: list (again)

    def start(self) -> "Watcher":
        self.task = asyncio.get_running_loop().create_task(self.run(), name=f"watch {self.path}")
        return self

    async def stop(self) -> None:
        """Stop watching; a later :meth:`start` lists again."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
        self.version = None

    async def run(self) -> None:
        delay = 1.0
        while True:
            try:
                if self.version is None:
                    await self.list()
                await self.watch()
                delay = 1.0
            except Gone:
                log.debug("watch of %s: resourceVersion %s is gone; listing again", self.path, self.version)
                self.version = None
            except asyncio.CancelledError:
                raise
            except (ApiError, aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as err:
                log.warning("watch of %s failed (%s: %s); retrying in %.0f s", self.path, type(err).__name__, err,
                            delay)
                await asyncio.sleep(delay)
                delay = min(30.0, delay * 2)

    async def list(self) -> None:
        """List every object (in pages), report them, and go on from the list's resourceVersion."""
        items: list[dict] = []
        params = dict(self.selectors, limit=str(PAGE))
        while True:
            page = await self.kube.request("GET", f"{self.path}?{urllib.parse.urlencode(params)}", answer=True)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                break
            params["continue"] = meta["continue"]
        self.lists += 1
        self.on_list(items)
        self.synced.set()
        self.version = meta["resourceVersion"]

    async def watch(self) -> None:
        """Report changes after :attr:`version` until the stream ends; a stream that breaks resumes from the
        last version it delivered."""
        assert self.version is not None, "a watch starts from the version a list or an earlier watch gave"
        params = dict(self.selectors, watch="1", resourceVersion=self.version, allowWatchBookmarks="true",
                      timeoutSeconds=str(self.server_timeout))
        try:
            async for event in self.kube.watch(self.path, params, self.timeout):
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    raise ApiError("WATCH", self.path, int(obj.get("code") or 500), str(obj.get("message")))
                self.version = obj["metadata"]["resourceVersion"]
                if kind != "BOOKMARK":
                    self.on_event(kind, obj)
        except ApiError as err:  # "410 Gone", as an answer or as an event in the stream
            if err.status == 410:
                raise Gone() from err
            raise
