"""An SDK client behind a rate limit (`429 rate_limited` with Retry-After over HTTP, an error
frame with `retry_after` on the websocket) waits it out and still gets every op applied exactly
once, in order, on a real server on loopback (the limits themselves: tests/server/
test_rate_limits.py; the worker: tests/worker/test_rate_limited_worker.py)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from cv_mutations import NodeIncrement, NodeInsert
from cv_server import ServerConfig, create_app
from cv_server.keys import RATE_LIMITS
from cv_server.ratelimit import RateLimits
from cv_workspace_client import WorkspaceClient
from tests.clocks import TickingClock

from .conftest import ServerFactory
from .helpers import SECRET, WS, fast_config, server_log, server_state, token_for

DOCS = ("a", "b", "c")
OPS_PER_DOC = 15


async def _refusals(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        text = await r.text()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith('cv_rate_limited_total{route_class="ops"}')
    )


@pytest.mark.parametrize("transport", ["http", "ws"])
async def test_a_client_behind_the_limit_gets_every_op_applied_once_in_order(
    aiohttp_server: ServerFactory, tmp_path: Path, transport: str
) -> None:
    # 10 ops requests a second per token, 2 saved up. The limit's clock ticks a thirtieth of a
    # second per request, as if three sub-docs written at once asked for 3x that, however fast
    # this machine sends them: the limit is hit, and every third request gets through.
    config = ServerConfig(
        db_path=tmp_path / "server.db",
        token_secret=SECRET,
        rate_limit_ops_per_second=10.0,
        rate_limit_burst_seconds=0.2,
    )
    app = create_app(config)
    app[RATE_LIMITS] = RateLimits(config, clock=TickingClock(1 / 30))
    server: TestServer = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    client_config = fast_config(retry_attempts=100, ops_over_websocket=transport == "ws")
    intended: dict[str, list[str]] = {doc: [] for doc in DOCS}
    async with (
        WorkspaceClient(url, token=token_for(WS), config=client_config) as client,
        contextlib.AsyncExitStack() as stack,
    ):
        if transport == "ws":
            # The socket open before the first op: every op then goes over it (not over HTTP
            # while it connects), so the limit met is the apply frames'.
            await stack.enter_async_context(client.subscribe(WS, "other"))
            async with asyncio.timeout(30):
                async for status in client.watch_sync_status():
                    if WS in status.connected:
                        break

        async def write(doc: str) -> None:
            first = await client.apply_op(
                WS, doc, NodeInsert(node_id="n", parent_id="root", fields={"v": 0})
            )
            intended[doc].append(first.op_id)
            for _ in range(OPS_PER_DOC):
                commit = await client.apply_op(WS, doc, NodeIncrement(node_id="n", field="v", by=1))
                intended[doc].append(commit.op_id)

        async with asyncio.timeout(60):
            await asyncio.gather(*(write(doc) for doc in DOCS))
        assert client.pending_count() == 0

    assert await _refusals(url) > 0, "the limit was never hit: the test tested nothing"
    for doc in DOCS:
        log: list[dict[str, Any]] = await server_log(url, doc)
        assert [entry["op_id"] for entry in log] == intended[doc]  # once each, in order
        assert [entry["clock"] for entry in log] == list(range(1, OPS_PER_DOC + 2))
        state = await server_state(url, doc)
        assert state["state"]["nodes"]["n"]["fields"]["v"] == OPS_PER_DOC  # applied once each
