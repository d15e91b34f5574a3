"""The worker reports and claims in one call (docs/queue.md, "report and claim"), through a real
server on loopback: a busy worker at concurrency 1 makes one HTTP call per request (counted by the
server's own `/metrics`), every request runs exactly once, and a row a report claimed just as the
worker stopped is run within the drain, never held until its lease lapses."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cv_server import ServerConfig, create_app
from cv_server.keys import STORES
from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue import requester as api
from cv_workspace_client.stage import StageContext
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.observe.scrape import Samples
from tests.worker.conftest import SECRET, WS, ServerFactory, open_client, running

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)
CLAIM = "/v1/queue/claim"
BATCH = "/v1/queue/complete"
COMPLETE = "/v1/workspaces/{ws}/requests/{id}/complete"
FAIL = "/v1/workspaces/{ws}/requests/{id}/fail"


async def _scrape(client: WorkspaceClient) -> Samples:
    async with client.session.get(client.url + "/metrics") as resp:
        assert resp.status == 200
        return Samples(await resp.text())


def _calls(samples: Samples, route: str, *status: str) -> float:
    labels = {"route": route} | ({"status": status[0]} if status else {})
    return samples.total("cv_http_requests_total", **labels)


async def _enqueue(client: WorkspaceClient, n: int, stage: str = "job") -> list[str]:
    return [
        (await api.enqueue(client, WS, {"stage": stage, "input": i})).request_id for i in range(n)
    ]


async def _all_done(client: WorkspaceClient, ids: list[str]) -> list[api.RequestOutcome]:
    return [await api.wait_request(client, WS, rid, timeout=60) for rid in ids]


async def test_a_busy_worker_at_concurrency_1_makes_one_call_per_request(
    client: WorkspaceClient, worker_transport: str
) -> None:
    ids = await _enqueue(client, 30)
    ran: list[Any] = []

    async def job(ctx: StageContext) -> Any:
        ran.append(ctx.input)
        return ctx.input

    before = await _scrape(client)
    worker = Worker(client, {"job": job}, config=FAST)
    async with running(worker):
        outcomes = await _all_done(client, ids)
    after = await _scrape(client)
    assert [o.status for o in outcomes] == ["done"] * 30
    assert sorted(ran) == list(range(30))
    reports = sum(_calls(after, r) - _calls(before, r) for r in (BATCH, COMPLETE, FAIL))
    claims = _calls(after, CLAIM, "200") - _calls(before, CLAIM, "200")
    if worker_transport == "channel":
        # No HTTP call at all: one frame per request, each completion carrying the slot it
        # frees (the server claims for it in the completion's commit).
        assert (claims, reports) == (0, 0)
        frames = after.total("cv_channel_frames_total", direction="in", type="complete")
        frames -= before.total("cv_channel_frames_total", direction="in", type="complete")
        assert frames == 30
        handed = after["cv_channel_claimed_total"] - before["cv_channel_claimed_total"]
        assert handed == 30
    else:
        # One claim to start, then each report carries the next claim (the claims answered 204
        # once the queue is empty are the idle worker's).
        assert (claims, reports) == (1, 30)
    claimed = after["cv_queue_claimed_total"] - before["cv_queue_claimed_total"]
    assert claimed == 30  # the claims that rode on reports are counted like the route's


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_every_request_runs_exactly_once_when_reports_claim(
    client: WorkspaceClient, concurrency: int
) -> None:
    ids = await _enqueue(client, 60)
    runs: Counter[str] = Counter()
    fails_left = {ids[3], ids[17]}  # a failure's report carries the next claim too

    async def job(ctx: StageContext) -> Any:
        runs[ctx.request.request_id] += 1
        await asyncio.sleep(0)
        if ctx.request.request_id in fails_left:
            fails_left.discard(ctx.request.request_id)
            raise RuntimeError("once")
        return ctx.input

    config = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05, concurrency=concurrency)
    worker = Worker(client, {"job": job}, config=config)
    async with running(worker):
        outcomes = await _all_done(client, ids)
    assert [o.status for o in outcomes] == ["done"] * 60
    assert [o.result for o in outcomes] == list(range(60))
    assert set(runs) == set(ids)
    assert {rid: n for rid, n in runs.items() if n != 1} == {ids[3]: 2, ids[17]: 2}
    assert worker.stats.failed == 2
    assert worker.stats.completed == 60
    assert worker.stats.leases_lost == 0


@pytest.fixture
def failing_fast_server(aiohttp_server: ServerFactory, tmp_path: Path) -> Callable[..., Any]:
    async def make(**overrides: Any) -> TestServer:
        config = ServerConfig(
            db_path=tmp_path / "server.db",
            token_secret=SECRET,
            failure_backoff_seconds=0.0,
            **overrides,
        )
        return await aiohttp_server(create_app(config))

    return make


@pytest.fixture
async def server(failing_fast_server: Callable[..., Awaitable[TestServer]]) -> TestServer:
    """The worker fixtures' server, with no failure backoff (a failed request re-runs at once)."""
    return await failing_fast_server()


async def test_a_row_claimed_by_a_report_as_the_worker_stops_runs_within_the_drain(
    aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    """The report's claim is taken, then `stop()` comes while its call is on the way: the row it
    brings back is run and completed in the drain, not left leased until the lease lapses."""
    worker_box: list[Worker] = []

    @web.middleware
    async def stop_during_a_report_that_claims(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.method == "POST" and request.path == BATCH:
            body = await request.json()
            if body.get("claim_next") is not None and worker_box:
                worker_box[0].stop()
        return await handler(request)

    app = create_app(ServerConfig(db_path=tmp_path / "server.db", token_secret=SECRET))
    app.middlewares.append(stop_during_a_report_that_claims)
    server = await aiohttp_server(app)
    async with open_client(server) as client:
        ids = await _enqueue(client, 2)
        ran: list[str] = []

        async def job(ctx: StageContext) -> Any:
            ran.append(ctx.request.request_id)
            if len(ran) == 2:  # a stage that outlasts the report that claimed it
                for _ in range(20):
                    await asyncio.sleep(0.01)
            return len(ran)

        # The stop comes from a middleware on the HTTP report routes.
        worker = Worker(client, {"job": job}, config=replace(FAST, transport="http"))
        worker_box.append(worker)
        stats = await asyncio.wait_for(worker.run(), 30)
        assert server.app is not None
        rows = [await server.app[STORES].queue.get(WS, rid) for rid in ids]
    assert ran == ids
    assert [row.status if row else None for row in rows] == ["done", "done"]
    assert (stats.claimed, stats.completed, stats.cancelled_at_drain) == (2, 2, 0)
