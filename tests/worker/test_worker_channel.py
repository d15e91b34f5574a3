"""The SDK worker on its worker channel (docs/queue.md, "The worker channel"), through a real
server on loopback: it falls back to HTTP when the server has no channel or the channel keeps
failing, and a channel dropped while the worker holds requests loses nothing and runs nothing
twice."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cv_server import ServerConfig, create_app
from cv_server.keys import CONNECTIONS, STORES
from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue import requester as api
from cv_workspace_client.stage import StageContext
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.observe.scrape import Samples
from tests.worker.conftest import SECRET, WS, ServerFactory, open_client, running

CHANNEL = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05, transport="channel")
BOUND = 30.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture(autouse=True)
def worker_transport() -> str:
    """These tests are about the channel itself (the conftest's runs every test on both)."""
    return "channel"


async def _server_answering(
    aiohttp_server: ServerFactory, tmp_path: Path, status: int
) -> TestServer:
    """A server whose channel route answers `status` (404: an older server without one)."""

    @web.middleware
    async def no_channel(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/v1/queue/channel":
            return web.json_response({"code": "x"}, status=status)
        return await handler(request)

    app = create_app(ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET))
    app.middlewares.insert(0, no_channel)
    return await aiohttp_server(app)


async def _http_claims(client: WorkspaceClient) -> float:
    async with client.session.get(client.url + "/metrics") as resp:
        samples = Samples(await resp.text())
    return samples.total("cv_http_requests_total", route="/v1/queue/claim")


async def _echo(ctx: StageContext) -> Any:
    return ctx.input


@pytest.mark.parametrize("status", [404, 503])
async def test_a_server_without_a_working_channel_is_served_over_http(
    aiohttp_server: ServerFactory, tmp_path: Path, status: int
) -> None:
    server = await _server_answering(aiohttp_server, tmp_path, status)
    async with open_client(server) as client:
        ids = [
            (await api.enqueue(client, WS, {"stage": "e", "input": i})).request_id for i in range(5)
        ]
        worker = Worker(client, {"e": _echo}, config=CHANNEL)
        async with running(worker):
            outcomes = [await api.wait_request(client, WS, rid, timeout=BOUND) for rid in ids]
        assert [o.result for o in outcomes] == list(range(5))
        assert await _http_claims(client) >= 1  # claimed over HTTP, not over a channel


async def test_a_channel_dropped_mid_report_loses_nothing_and_runs_nothing_twice(
    make_server: Callable[..., Awaitable[TestServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The channel drops while the worker holds requests and its first completions are on
    their way (committed, unanswered): the worker sends them again over HTTP (answered with the
    finished rows), keeps its leases, and every request runs once and is acknowledged."""
    server = await make_server(lease_seconds=2.0)
    assert server.app is not None
    connections = server.app[CONNECTIONS]
    queue = server.app[STORES].queue
    runs: Counter[str] = Counter()
    release = asyncio.Event()
    holding = asyncio.Event()
    dropped: list[bool] = []

    def dropping(verb: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def report(*args: Any, **kwargs: Any) -> Any:
            if not dropped:  # the first report over a channel: drop every channel, then commit
                dropped.append(True)
                for conn in list(connections):
                    conn.close(1011, b"dropped by the test")
            return await verb(*args, **kwargs)

        return report

    monkeypatch.setattr(queue, "complete_many", dropping(queue.complete_many))
    monkeypatch.setattr(queue, "complete_then_claim", dropping(queue.complete_then_claim))

    async def held(ctx: StageContext) -> Any:
        runs[ctx.request.request_id] += 1
        if len(runs) >= 2:
            holding.set()
        await release.wait()
        return ctx.input

    async with open_client(server) as client:
        ids = [
            (await api.enqueue(client, WS, {"stage": "h", "input": i})).request_id for i in range(6)
        ]
        config = WorkerConfig(
            idle_initial_seconds=0.01, concurrency=2, heartbeat_seconds=0.5, transport="channel"
        )
        worker = Worker(client, {"h": held}, config=config)
        async with running(worker):
            await asyncio.wait_for(holding.wait(), BOUND)
            release.set()
            outcomes = [await api.wait_request(client, WS, rid, timeout=BOUND) for rid in ids]
    assert dropped == [True]
    assert [o.status for o in outcomes] == ["done"] * 6
    assert [o.result for o in outcomes] == list(range(6))
    assert runs == dict.fromkeys(ids, 1)  # nothing ran twice
    assert worker.stats.completed == 6  # every completion was acknowledged to the worker
    assert worker.stats.leases_lost == 0
