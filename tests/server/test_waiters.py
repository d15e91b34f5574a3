"""The waiters of request streams (`cv_server.waiters`) through a real server on loopback, on both
backends: streams abandoned by their clients release their waiters before the deadline, and many
streams on one request all get its outcome and release theirs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.keys import WAITERS
from tests.server.conftest import auth
from tests.server.helpers import claim, enqueue

# -- request streams (SSE) -------------------------------------------------------------------------


@pytest.fixture
async def production_server(
    make_server_config: Callable[..., ServerConfig],
) -> AsyncIterator[tuple[str, web.Application]]:
    """The app served the way `cv-server serve` serves it (`web.AppRunner`, whose handlers are
    *not* cancelled when their client hangs up, unlike the test server's); sweeps shrunk."""
    app = create_app(make_server_config(sweep_seconds=0.1))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


async def _until(condition: Callable[[], bool], patience: float = 30.0) -> None:
    """Wait for a state (not for time): poll `condition` until true, fail after `patience`
    (half the waiters' 60 s deadline: what a sweep must beat)."""
    async with asyncio.timeout(patience):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_streams_abandoned_by_their_clients_release_their_waiters_before_the_deadline(
    production_server: tuple[str, web.Application],
) -> None:
    base, app = production_server
    headers = auth("ws1")
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            f"{base}/v1/workspaces/ws1/requests",
            json={"stage": "evaluate", "job_id": "J"},
            headers=headers,
        )
        stream_url = base + (await resp.json())["stream_url"]
    for _ in range(20):  # each on its own connection, hung up after the first event
        async with aiohttp.ClientSession() as session:
            stream = await session.get(stream_url, headers=headers)  # default deadline: 60 s
            assert await stream.content.readline() == b"event: queued\n"
            stream.close()
    # The waiter was registered before the first event was written; with the client gone it
    # must be released at the next sweep, not 60 s later (a flapping client would otherwise
    # pile up deadline x reconnect-rate waiters, each re-reading its row every sweep).
    await _until(lambda: app[WAITERS].count == 0)


async def test_many_streams_on_one_request_all_get_its_outcome_and_release_their_waiters(
    server: TestClient[Any, Any],
) -> None:
    assert server.app is not None
    _, answer = await enqueue(server, {"stage": "evaluate", "job_id": "many"})
    url = answer["stream_url"]

    async def events() -> list[str]:
        resp = await server.get(url, headers=auth("ws1"))
        return [
            line.split(": ", 1)[1]
            for line in (await resp.text()).splitlines()
            if line.startswith("event: ")
        ]

    streams = [asyncio.create_task(events()) for _ in range(40)]
    waiters = server.app[WAITERS]
    await _until(lambda: waiters.count == 40)  # every stream registered before the outcome
    row = await claim(server)
    resp = await server.post(
        f"/v1/workspaces/ws1/requests/{row['request_id']}/complete",
        json={"claim_token": row["claim_token"], "result": 1},
        headers=auth("ws1"),
    )
    assert resp.status == 200
    async with asyncio.timeout(10):
        outcomes = await asyncio.gather(*streams)
    assert outcomes == [["queued", "done"]] * 40
    assert waiters.count == 0
