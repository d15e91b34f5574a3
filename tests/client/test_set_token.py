"""`set_token()` racing what the old token is still doing, through the real server on loopback: a
token refreshed before it expires keeps the websocket and its subscriptions, an op refused for the
token just replaced is sent with the new one, and a token set while the websocket connects with
the old one is used."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from cv_mutations import NodeIncrement, NodeInsert
from cv_server.auth import mint_token
from cv_workspace_client import SyncStatus, WorkspaceClient
from cv_workspace_client.testing import FaultProxy
from tests.clocks import stop_token_clock

from .helpers import SECRET, WS, fast_config, server_log, token_for

#: Every wait is bounded: what never comes fails the test instead of hanging it.
BOUND = 10.0


async def _until(client: WorkspaceClient, predicate: Callable[[SyncStatus], bool]) -> SyncStatus:
    """The first status the client's watch yields that satisfies `predicate`."""
    async with asyncio.timeout(BOUND):
        async for status in client.watch_sync_status():
            if predicate(status):
                return status
    raise AssertionError("the watch ended first")


async def test_a_token_refreshed_before_it_expires_keeps_the_websocket_and_subscriptions(
    server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usual refresh: a new token set before the old one expires. The server closes a socket
    with 4001 when the token it was opened with expires; the socket took that for a refusal of
    the client's token and stopped for good, failing every subscription with `AuthError`, though
    the client held a valid token."""
    # Accepted at the handshake whenever it comes, the token then closes the socket 5 s later:
    # time enough to subscribe and set the new one first.
    short = mint_token(SECRET, [WS], now=stop_token_clock(monkeypatch), ttl=5)
    async with WorkspaceClient(server_url, token=short, config=fast_config()) as client:
        await client.connect(WS, timeout=BOUND)
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        async with client.subscribe(WS, "tree") as sub:
            assert (await asyncio.wait_for(anext(sub), BOUND)).clock == 1
            client.set_token(token_for(WS))  # long before the old one expires
            await _until(client, lambda s: WS not in s.connected)  # the old token's expiry
            await _until(client, lambda s: WS in s.connected)
            commit = await client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
            assert (await asyncio.wait_for(anext(sub), BOUND)).clock == commit.clock == 2


async def test_an_op_refused_for_the_token_set_token_just_replaced_is_sent_with_the_new_one(
    server_url: str,
) -> None:
    """`set_token()` while a request made with the old token is out: its refusal arrives after the
    swap and parked the lane, and nothing unparked it (set_token had already retried the parked
    lanes): the op waited in the outbox, its caller told `StillPendingError`, until some later
    connect or submit to the sub-doc."""
    async with FaultProxy(server_url) as proxy:
        proxy.delay = 0.5  # the refusal is on its way back while the app swaps the token
        async with WorkspaceClient(
            proxy.url, token="expired-token", config=fast_config(ops_over_websocket=False)
        ) as client:
            call = asyncio.ensure_future(
                client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            )
            await asyncio.wait_for(proxy.wait_until(lambda s: s.accepted >= 1), BOUND)
            client.set_token(token_for(WS))
            commit = await asyncio.wait_for(call, BOUND)
            assert commit.clock == 1
    assert [entry["clock"] for entry in await server_log(server_url, "tree")] == [1]


async def test_a_token_set_while_the_websocket_connects_with_the_old_one_is_used(
    server_url: str,
) -> None:
    """`set_token()` while the socket's handshake with the refused token is under way: the socket
    had not given up yet (nothing to reconnect), then took the refusal of the old token as final:
    the websocket stayed dead after `set_token`, and the subscription failed with `AuthError`."""
    async with WorkspaceClient(server_url, token="expired-token", config=fast_config()) as client:
        async with client.subscribe(WS, "tree") as sub:
            await asyncio.sleep(0)  # one step: the socket connects, with the old token's headers
            client.set_token(token_for(WS))
            commit = await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            assert (await asyncio.wait_for(anext(sub), BOUND)).clock == commit.clock == 1
        await _until(client, lambda s: WS in s.connected)
