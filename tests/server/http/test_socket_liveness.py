"""The server's websocket heartbeat: a peer that stopped answering (power lost, a NAT that forgot
the flow) is closed and its subscriptions dropped, instead of being held, with its buffers and
hub entries, until the OS gives up on the TCP connection hours later; a peer that answers its
pings is never closed by it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import ClientWebSocketResponse, WSMsgType

from cv_mutations import new_op_id
from cv_server import ServerConfig, create_app
from cv_server.cli import parse_overrides
from tests.server.conftest import ClientFactory, auth
from tests.server.helpers import insert
from tests.server.test_metrics import scrape

SOCKET = "/v1/workspaces/ws1/socket"
#: The server pings every HEARTBEAT and closes a peer whose pong is not back within half of it
#: (aiohttp's heartbeat, whose clock is the event loop's: nothing to inject). The healthy peer
#: answers from this same process, so on a loaded machine its pong may take a good part of a
#: second: one second to answer, and the silent peer is closed about three seconds in.
HEARTBEAT = 2.0
#: Every wait is bounded: a server without a heartbeat fails here instead of hanging.
BOUND = 10.0


async def _subscribe(ws: ClientWebSocketResponse) -> None:
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    async with asyncio.timeout(BOUND):
        while True:
            message = await ws.receive()
            if message.type is WSMsgType.TEXT and message.json()["type"] == "synced":
                return


async def test_a_peer_that_never_answers_a_ping_is_closed_and_its_subscription_dropped(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_config(socket_heartbeat_seconds=HEARTBEAT)))
    # autoping=False: the pings reach this test as messages and are never answered, as from
    # a peer that is gone. The healthy one answers its pings (aiohttp does, while reading).
    silent = await client.ws_connect(SOCKET, headers=auth("ws1"), autoping=False)
    healthy = await client.ws_connect(SOCKET, headers=auth("ws1"))
    await _subscribe(silent)
    await _subscribe(healthy)
    assert (await scrape(client))["cv_subscriptions"] == 2
    # aiohttp answers a ping only while the application reads: the healthy peer reads all along.
    frames: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def read_healthy() -> None:
        async for message in healthy:
            if message.type is WSMsgType.TEXT:
                frames.put_nowait(message.json())

    reader = asyncio.create_task(read_healthy())

    pings = 0
    async with asyncio.timeout(BOUND):
        while True:
            message = await silent.receive()
            if message.type is WSMsgType.PING:
                pings += 1
            elif message.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING):
                break
    assert pings >= 1

    # The handler's clean-up runs just after the close; it has no event to await from here.
    async with asyncio.timeout(BOUND):
        while (samples := await scrape(client))["cv_ws_connections"] != 1:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert samples["cv_subscriptions"] == 1

    # The healthy peer, several heartbeats later, still has its socket and its subscription.
    await healthy.send_json(
        {
            "type": "apply",
            "req": 1,
            "sub_doc": "tree",
            "ops": [insert("n", op_id=new_op_id())],
        }
    )
    kinds: set[str] = set()
    async with asyncio.timeout(BOUND):
        while kinds != {"ack", "op"}:
            kinds.add((await frames.get())["type"])
    assert not healthy.closed
    await healthy.close()
    await reader
    await silent.close()


async def test_the_server_heartbeat_can_be_switched_off(
    make_config: Callable[..., ServerConfig],
) -> None:
    assert make_config(socket_heartbeat_seconds=None).socket_heartbeat_seconds is None
    assert make_config().socket_heartbeat_seconds == 60.0  # The default heartbeat


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_server_heartbeat_that_cannot_work_is_refused(
    make_config: Callable[..., ServerConfig], value: float
) -> None:
    with pytest.raises(ValueError, match="socket_heartbeat_seconds"):
        make_config(socket_heartbeat_seconds=value)


def test_the_server_heartbeat_is_set_or_switched_off_from_the_command_line() -> None:
    assert parse_overrides(["socket_heartbeat_seconds=5"]) == {"socket_heartbeat_seconds": 5.0}
    assert parse_overrides(["socket_heartbeat_seconds=off"]) == {"socket_heartbeat_seconds": None}
    with pytest.raises(SystemExit, match="not a number"):
        parse_overrides(["socket_heartbeat_seconds=soon"])
