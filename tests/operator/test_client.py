"""The operator's API client against a small HTTP server on loopback: answers read to their end, errors, re-login."""

from __future__ import annotations

import asyncio
import json

import kopf
from aiohttp import web

from kubeps.operator.kube.client import ApiError, KubeClient


async def _serve(handler):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _client(server: str, tokens: list[str], pool_size: int = 1) -> KubeClient:
    logins = iter(tokens)
    return KubeClient(qps=1000, burst=1000, pool_size=pool_size,
                      login=lambda: kopf.ConnectionInfo(server=server, token=next(logins)))


def test_unread_answers_never_leak_into_the_next_request():
    """One pooled connection, a large answer the caller does not want, then a request whose answer it reads."""
    big = json.dumps({"kind": "Pod", "metadata": {"ownerReferences": [{"name": "x" * 100}] * 2000}})

    async def handler(request: web.Request) -> web.Response:
        if request.method == "POST":
            return web.Response(text=big, content_type="application/json")
        return web.json_response({"path": request.path, "auth": request.headers.get("Authorization")})

    async def main():
        runner, server = await _serve(handler)
        client = _client(server, ["t1"])
        try:
            for i in range(5):
                assert await client.request("POST", "/api/v1/namespaces/a/pods", {"i": i}) is None
                got = await client.request("GET", f"/api/v1/namespaces/a/secrets/s{i}", answer=True)
                assert got == {"path": f"/api/v1/namespaces/a/secrets/s{i}", "auth": "Bearer t1"}
            assert client.requests == 10
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(main())


def test_error_status_raises_with_the_body_and_401_logs_in_again():
    seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") == "Bearer old":
            return web.json_response({"reason": "Unauthorized"}, status=401)
        if request.path.endswith("/missing"):
            return web.json_response({"message": "not found"}, status=404)
        return web.json_response({"ok": True})

    async def main():
        runner, server = await _serve(handler)
        client = _client(server, ["old", "new"], pool_size=4)
        try:
            assert await client.request("GET", "/api/v1/namespaces/a/pods/p", answer=True) == {"ok": True}
            assert seen == ["Bearer old", "Bearer new"]  # a rotated token: read again, the request retried
            try:
                await client.request("GET", "/api/v1/namespaces/a/pods/missing")
            except ApiError as err:
                assert err.status == 404 and "not found" in err.body
            else:
                raise AssertionError("no ApiError")
            assert await client.read_secret("a", "missing") is None
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(main())
