"""How the SDK's websocket paces its reconnects against a server that keeps dropping it.

A server in a crash loop behind a load balancer accepts the upgrade, may even answer a frame or
two, and drops the connection; thousands of clients reconnecting at once to each such server
is a thundering herd that keeps it down. A connection only proves the server healthy once it
stayed up longer than the first backoff step (`retry_base_seconds`, the default 1 s): then the
next reconnect is immediate; a shorter one counts as a failure and the delay grows (full jitter
up to the cap), as after a refused connect.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from cv_mutations import NodeInsert
from cv_workspace_client import StillPendingError, WorkspaceClient
from cv_workspace_client.testing import FaultProxy

from .helpers import WS, RecordingSleep, fast_config, server_log, token_for

#: Every wait here is bounded.
TIMEOUT = 10.0
#: Connections the server drops before it behaves.
FLAPS = 6


class FlappingServer:
    """Drops each of its first `FLAPS` websocket connections: after answering the subscribe with
    `synced` when `answer`, at once otherwise; then behaves (the client stays)."""

    def __init__(self, *, answer: bool, lifetime: float = 0.0) -> None:
        self.answer = answer
        #: How long a dropped connection stays up after its answer (loop time).
        self.lifetime = lifetime
        self.connections = 0
        self.calm = asyncio.Event()

    async def socket(self, request: web.Request) -> web.WebSocketResponse:
        self.connections += 1
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        if self.connections > FLAPS:
            self.calm.set()
            async for _ in ws:
                pass
            return ws
        if self.answer:
            frame = await ws.receive_json(timeout=TIMEOUT)
            await ws.send_json({"type": "synced", "sub_doc": frame["sub_doc"], "clock": 0})
        if self.lifetime:
            await asyncio.sleep(self.lifetime)  # the scenario: how long the connection lives
        await ws.close()  # a normal close (1000): nothing says the server is failing
        return ws

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/workspaces/{ws}/socket", self.socket)
        return app


async def _failures_before_calm(
    aiohttp_server: Any, server: FlappingServer, **config: Any
) -> list[int]:
    """The failure counts the socket asked the backoff for until the server behaved."""
    failures_seen: list[int] = []

    def backoff(failures: int) -> float:
        failures_seen.append(failures)
        return 0.0

    running = await aiohttp_server(server.app())
    url = str(running.make_url("")).rstrip("/")
    settings = fast_config(backoff=backoff, sleep=RecordingSleep(), **config)
    async with WorkspaceClient(url, token=token_for(WS), config=settings) as client:
        sub = client.subscribe(WS, "tree")
        sub._register()
        await asyncio.wait_for(server.calm.wait(), TIMEOUT)
        await sub.aclose()
    assert server.connections == FLAPS + 1
    return failures_seen


@pytest.mark.parametrize("answer", [True, False], ids=["after_a_frame", "before_a_frame"])
async def test_a_server_that_drops_every_connection_at_once_is_backed_off_more_each_time(
    aiohttp_server: Any, answer: bool
) -> None:
    # Dropped after a frame, each connection was reconnected to at once, forever: a tight loop
    # of connects, upgrades and catch-up reads against a server that cannot stay up. Dropped
    # before one, the delay stayed at the first step (up to 1 s) however often it happened.
    server = FlappingServer(answer=answer)
    failures = await _failures_before_calm(aiohttp_server, server, retry_base_seconds=1.0)
    assert failures == list(range(1, FLAPS + 1))


async def test_a_connection_that_stayed_up_past_the_first_backoff_step_is_followed_at_once(
    aiohttp_server: Any,
) -> None:
    # An idle socket cut now and then (a NAT, a deploy) is reconnected to without a wait, and a
    # long outage's backoff does not carry over to a connection that proved the server up.
    server = FlappingServer(answer=True, lifetime=0.05)
    failures = await _failures_before_calm(aiohttp_server, server, retry_base_seconds=0.01)
    assert failures == []


async def test_wait_synced_retries_an_op_that_gave_up_instead_of_waiting_for_ever(
    server_url: str, token: str
) -> None:
    # An op whose attempts ran out stays pending; it is retried on the next connect or the next
    # submit to its sub-doc. A client sending over HTTP has no connect to wait for: an app that
    # then waited for it (the last op of a run, say) waited out its whole timeout.
    config = fast_config(ops_over_websocket=False)
    async with (
        FaultProxy(server_url) as proxy,
        WorkspaceClient(proxy.url, token=token, config=config) as client,
    ):
        proxy.refuse = True
        with pytest.raises(StillPendingError):
            await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        assert client.pending_count() == 1
        proxy.refuse = False
        await client.wait_synced(timeout=TIMEOUT)
        assert client.pending_count() == 0
    assert len(await server_log(server_url, "tree")) == 1
