"""How the SDK's websocket paces its reconnects against a server that keeps dropping it, and
against a lossy link that keeps cutting it.

A connection that delivered data proved the server up: the next reconnect waits on the
dropped-listener schedule (full jitter up to `reconnect_after_drop_seconds[0]`, 2 s by default),
however short the connection lived, so a subscriber whose link recovers is current within
seconds. It is never at once, so a server in a crash loop that accepts, answers and drops is not
reconnected to in a tight loop. A connection that delivered nothing counts as a failure, and the
wait grows as after a refused connect (the retry backoff, full jitter up to the cap).
The pure rules are pinned in `tests/client/core/test_reconnect.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from aiohttp import web

from cv_mutations import NodeInsert
from cv_workspace_client import ClientConfig, ReconnectPolicy, StillPendingError, WorkspaceClient
from cv_workspace_client.testing import FaultProxy

from ..helpers import WS, RecordingSleep, fast_config, server_log, token_for

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


async def _reconnects_before_calm(
    aiohttp_server: Any, server: FlappingServer, **config: Any
) -> tuple[list[int], list[float]]:
    """(the failure counts the socket asked the retry backoff for, the waits it slept) until the
    server behaved."""
    failures_seen: list[int] = []

    def backoff(failures: int) -> float:
        failures_seen.append(failures)
        return 0.0

    sleep = RecordingSleep()
    running = await aiohttp_server(server.app())
    url = str(running.make_url("")).rstrip("/")
    settings = fast_config(backoff=backoff, sleep=sleep, **config)
    async with WorkspaceClient(url, token=token_for(WS), config=settings) as client:
        sub = client.subscribe(WS, "tree")
        sub._register()
        await asyncio.wait_for(server.calm.wait(), TIMEOUT)
        await sub.aclose()
    assert server.connections == FLAPS + 1
    return failures_seen, sleep.delays


async def test_a_server_that_drops_every_connection_before_a_frame_is_backed_off_more_each_time(
    aiohttp_server: Any,
) -> None:
    # Dropped before a frame, the connection proved nothing: each drop is one more failure.
    server = FlappingServer(answer=False)
    failures, _ = await _reconnects_before_calm(aiohttp_server, server, retry_base_seconds=1.0)
    assert failures == list(range(1, FLAPS + 1))


@pytest.mark.parametrize("lifetime", [0.0, 0.05], ids=["dropped_at_once", "dropped_later"])
async def test_a_connection_that_delivered_data_is_followed_on_the_dropped_listener_schedule(
    aiohttp_server: Any, lifetime: float
) -> None:
    # However short it lived, a connection that answered resets the waits: each reconnect waits
    # the schedule's first step (full jitter, never at once, never growing), and the retry
    # backoff is never asked.
    server = FlappingServer(answer=True, lifetime=lifetime)
    step = 0.5
    failures, waits = await _reconnects_before_calm(
        aiohttp_server, server, retry_base_seconds=1.0, reconnect_after_drop_seconds=(step, 5.0)
    )
    assert failures == []
    assert len(waits) == FLAPS
    assert all(0.0 < wait <= step for wait in waits), waits


class AnswersOnceServer(FlappingServer):
    """Answers its first connection's subscribe, then drops it; drops the next ones at once,
    before any frame (the upgrade accepted: the server is up), until `FLAPS`; then behaves."""

    async def socket(self, request: web.Request) -> web.WebSocketResponse:
        self.answer = self.connections == 0
        return await super().socket(request)


async def test_connections_cut_before_a_frame_after_a_drop_keep_the_wait_at_the_last_step(
    aiohttp_server: Any,
) -> None:
    # The server accepts every upgrade and the link cuts each connection before its first
    # frame: after the drop, the waits walk the schedule and stay at its last step. Doubling
    # there left a subscriber on a lossy link many seconds behind a server that was up.
    steps = (0.01, 0.025)
    rules = ReconnectPolicy(
        backoff=lambda failures: 0.0, after_drop=steps, cap=10.0, uniform=lambda low, high: high
    )
    server = AnswersOnceServer(answer=True)
    sleep = RecordingSleep()
    running = await aiohttp_server(server.app())
    url = str(running.make_url("")).rstrip("/")
    settings = fast_config(reconnect_policy=rules, sleep=sleep, retry_cap_seconds=10.0)
    async with WorkspaceClient(url, token=token_for(WS), config=settings) as client:
        sub = client.subscribe(WS, "tree")
        sub._register()
        await asyncio.wait_for(server.calm.wait(), TIMEOUT)
        await sub.aclose()
    assert server.connections == FLAPS + 1
    assert sleep.delays == [steps[0]] + [steps[1]] * (FLAPS - 1)


class SocketWaits:
    """An injected `sleep` that returns at once and records the waits of the websocket's run
    loop (its task is named `cv-socket-*`), apart from every other retry of the client."""

    def __init__(self) -> None:
        self.socket: list[float] = []

    async def __call__(self, delay: float) -> None:
        task = asyncio.current_task()
        if task is not None and task.get_name().startswith("cv-socket-"):
            self.socket.append(delay)
        await asyncio.sleep(0)


async def test_a_subscriber_behind_a_lossy_link_waits_no_longer_after_each_short_connection(
    server_url: str, token: str
) -> None:
    # A link that cuts 15% of the server's chunks: every connection delivers its first frames
    # and dies a few broadcasts later. Counted as failures, those short connections pushed the
    # wait up the retry backoff (1, 2, 4, ... s, towards 300 s) while data was flowing, and the
    # subscriber fell a minute behind. Each reconnect must wait the first step of the dropped-
    # listener schedule, and the subscriber must still get every op once, in order.
    socket_backoffs: list[int] = []

    def backoff(failures: int) -> float:
        task = asyncio.current_task()
        if task is not None and task.get_name().startswith("cv-socket-"):
            socket_backoffs.append(failures)
        return 0.0

    waits = SocketWaits()
    config = ClientConfig(backoff=backoff, sleep=waits)  # the shipped 1 s / 2 s / 5 s steps
    reconnects = 10
    async with FaultProxy(server_url, seed=11) as proxy:
        # The handshake's 101 and the first frame always pass: every connection delivers.
        proxy.cut_chunks(0.15, skip_chunks=2)
        async with (
            WorkspaceClient(proxy.url, token=token, config=config) as reader,
            WorkspaceClient(server_url, token=token) as writer,
        ):
            seen: list[int] = []
            advanced = asyncio.Condition()
            sub = reader.subscribe(WS, "tree")

            async def follow() -> None:
                async for committed in sub:
                    async with advanced:
                        seen.append(committed.clock)
                        advanced.notify_all()

            follower = asyncio.create_task(follow())
            try:
                async with asyncio.timeout(4 * TIMEOUT):
                    last = 0
                    for n in range(3000):
                        socket = reader._sockets.get(WS)
                        if socket is not None and socket.connections > reconnects:
                            break
                        commit = await writer.apply_op(
                            WS, "tree", NodeInsert(node_id=f"n{n}", parent_id="root")
                        )
                        last = commit.clock
                    async with advanced:
                        await advanced.wait_for(lambda: bool(seen) and seen[-1] >= last)
            finally:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follower
        assert proxy.stats.cuts >= reconnects
    assert seen == list(range(1, last + 1))
    assert socket_backoffs == []
    assert len(waits.socket) >= reconnects
    assert all(0.0 < wait <= 2.0 for wait in waits.socket), waits.socket


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
