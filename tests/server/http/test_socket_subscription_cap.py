"""`ServerConfig.max_subscriptions_per_socket`: a socket holds at most that many subscriptions;
a subscribe past it is refused alone (an `error` frame naming its sub-doc and `since`), counted
in `/metrics`, and the socket and its other subscriptions go on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import ClientWebSocketResponse
from aiohttp.test_utils import TestClient

from cv_mutations import NodeInsert
from cv_server import ServerConfig, create_app
from cv_server.cli import parse_overrides
from cv_server.keys import HUB
from cv_workspace_client import InvalidRequestError, WorkspaceClient
from tests.client.helpers import collect, fast_config
from tests.server.conftest import ClientFactory, auth, token_for
from tests.server.helpers import insert
from tests.server.test_metrics import scrape

SOCKET = "/v1/workspaces/ws1/socket"
TIMEOUT = 10


async def _frames(ws: ClientWebSocketResponse, count: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async with asyncio.timeout(TIMEOUT):
        while len(out) < count:
            out.append(await ws.receive_json())
    return out


async def _capped(aiohttp_client: ClientFactory, config: ServerConfig) -> TestClient[Any, Any]:
    return await aiohttp_client(create_app(config))


def test_the_cap_is_1000_by_default_and_settable_with_set() -> None:
    assert ServerConfig().max_subscriptions_per_socket == 1000
    assert parse_overrides(["max_subscriptions_per_socket=5000"]) == {
        "max_subscriptions_per_socket": 5000
    }


async def test_a_subscribe_past_the_default_cap_is_refused_and_counted(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await _capped(aiohttp_client, make_config())
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    frames = [{"type": "subscribe", "sub_doc": f"d{i}", "since": 0} for i in range(1003)]
    await ws.send_json(frames)
    answers = await _frames(ws, 1003)
    synced = {f["sub_doc"] for f in answers if f["type"] == "synced"}
    refused = [f for f in answers if f["type"] == "error"]
    assert synced == {f"d{i}" for i in range(1000)}
    assert [(f["code"], f["sub_doc"], f["since"]) for f in refused] == [
        ("too_many_subscriptions", f"d{i}", 0) for i in (1000, 1001, 1002)
    ]
    assert client.app[HUB].subscriber_count == 1000
    metrics = await scrape(client)
    assert metrics["cv_subscriptions_refused_total"] == 3
    assert metrics["cv_subscriptions"] == 1000
    await ws.close()


async def test_resubscribing_or_unsubscribing_frees_or_keeps_a_slot_and_the_socket_goes_on(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await _capped(aiohttp_client, make_config(max_subscriptions_per_socket=2))
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    await ws.send_json([{"type": "subscribe", "sub_doc": d, "since": 0} for d in ("a", "b")])
    assert {f["type"] for f in await _frames(ws, 2)} == {"synced"}
    # A second subscribe of a sub-doc it holds replaces that subscription: no new slot.
    await ws.send_json({"type": "subscribe", "sub_doc": "a", "since": 0, "req": 1})
    assert (await _frames(ws, 1))[0]["type"] == "synced"
    await ws.send_json({"type": "subscribe", "sub_doc": "c", "since": 0, "req": 2})
    error = (await _frames(ws, 1))[0]
    assert (error["code"], error["sub_doc"], error["req"]) == ("too_many_subscriptions", "c", 2)
    await ws.send_json({"type": "unsubscribe", "sub_doc": "b"})
    await ws.send_json({"type": "subscribe", "sub_doc": "c", "since": 0})
    assert (await _frames(ws, 1))[0] == {"type": "synced", "sub_doc": "c", "clock": 0}
    # The subscriptions it holds are live, and applies are answered.
    await ws.send_json({"type": "apply", "sub_doc": "a", "req": 3, "ops": [insert("x")]})
    assert {f["type"] for f in await _frames(ws, 2)} == {"op", "ack"}
    assert (await scrape(client))["cv_subscriptions_refused_total"] == 1
    await ws.close()


async def test_the_sdk_fails_the_refused_subscription_alone(
    aiohttp_server: Any, make_config: Callable[..., ServerConfig]
) -> None:
    server = await aiohttp_server(create_app(make_config(max_subscriptions_per_socket=1)))
    url = str(server.make_url("")).rstrip("/")
    client = WorkspaceClient(url, token=token_for("ws1"), config=fast_config())
    async with (
        client,
        client.subscribe("ws1", "a") as first,
        client.subscribe("ws1", "b") as second,
    ):
        with pytest.raises(InvalidRequestError) as refused:
            await asyncio.wait_for(collect(second, 1), TIMEOUT)
        assert refused.value.code == "too_many_subscriptions"
        await client.apply_op("ws1", "a", NodeInsert(node_id="n", parent_id="root"))
        assert await asyncio.wait_for(collect(first, 1), TIMEOUT) == [1]
