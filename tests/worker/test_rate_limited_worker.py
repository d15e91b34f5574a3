"""A worker behind rate limits on the queue routes (its claims, heartbeats and completions
answered `429 rate_limited` with Retry-After now and then) waits them out: every request is
done, each stage ran once, on a real server on loopback. Its idle polling, far over the claim
budget, does not starve its completions (they are another class)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from cv_server import ServerConfig, create_app
from cv_server.keys import RATE_LIMITS
from cv_server.ratelimit import RateLimits
from cv_workspace_client._queue import requester as api
from cv_workspace_client.stage import StageContext
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.clocks import TickingClock
from tests.worker.conftest import SECRET, WS, ServerFactory, open_client, running, url_of

REQUESTS = 12


async def _refused(url: str, route_class: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        text = await r.text()
    prefix = f'cv_rate_limited_total{{route_class="{route_class}"}} '
    return sum(
        int(float(line.removeprefix(prefix)))
        for line in text.splitlines()
        if line.startswith(prefix)
    )


async def test_a_worker_over_its_claim_budget_still_runs_every_request_once(
    aiohttp_server: ServerFactory, tmp_path: Path, worker_transport: str
) -> None:
    # Eight claims and eight completions a second for the worker's token, one saved up. The
    # limits' clock ticks a twentieth of a second per request: an idle worker polls at 20 a
    # second on it, however fast this machine runs its polls, and so goes over its budget.
    config = ServerConfig(
        db_path=tmp_path / "server.db",
        token_secret=SECRET,
        rate_limit_claim_per_second=8.0,
        rate_limit_queue_per_second=8.0,
        rate_limit_burst_seconds=0.125,
    )
    app = create_app(config)
    app[RATE_LIMITS] = RateLimits(config, clock=TickingClock(1 / 20))
    server = await aiohttp_server(app)
    runs: list[str | None] = []

    async def stage(ctx: StageContext) -> dict[str, Any]:
        runs.append(ctx.job_id)
        return {"job": ctx.job_id}

    async with open_client(server) as client:
        worker = Worker(
            client,
            {"s": stage},
            worker_id="limited",
            config=WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05),
        )
        async with running(worker):
            enqueued = [
                await api.enqueue(client, WS, {"stage": "s", "job_id": f"J{i:02d}"})
                for i in range(REQUESTS)
            ]
            async with asyncio.timeout(60):
                outcomes = [
                    await api.wait_request(client, WS, e.request_id, timeout=60) for e in enqueued
                ]
    # Over HTTP the idle polls spend the claim budget; over the channel a worker claims by
    # offering slots, and its report frames are the ones refused (error frames it waits out).
    limited = "claim" if worker_transport == "http" else "queue"
    assert await _refused(url_of(server), limited) > 0, "the limit was never hit"
    assert [o.status for o in outcomes] == ["done"] * REQUESTS
    assert [o.result for o in outcomes] == [{"job": f"J{i:02d}"} for i in range(REQUESTS)]
    assert sorted(runs, key=str) == [f"J{i:02d}" for i in range(REQUESTS)]  # each ran once
    assert all(o.request is not None and o.request.dequeue_count == 1 for o in outcomes)
