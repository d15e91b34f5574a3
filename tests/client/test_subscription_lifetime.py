"""A subscription's lifetime follows the app's hold on it: one left with `break` and dropped (no
`aclose()`: `async for` never calls it) is released by itself, the server stops streaming it and
the client stops buffering for it; one whose consumer task nobody holds keeps delivering."""

from __future__ import annotations

import asyncio
import gc

import aiohttp

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import Subscription, WorkspaceClient

from .helpers import WS, fast_config

#: Every wait is bounded: a subscription that is never released fails the test, not hangs it.
BOUND = 20.0


async def _server_subscriptions(server_url: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{server_url}/metrics") as response:
        assert response.status == 200
        for line in (await response.text()).splitlines():
            if line.startswith("cv_subscriptions "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no cv_subscriptions sample in /metrics")


async def _until_server_subscriptions(server_url: str, expected: float) -> None:
    """Poll the server's gauge until it reads `expected` (the unsubscribe is a round trip)."""
    async with asyncio.timeout(BOUND):
        # Polled: the server's gauge is the observable, and it has no event to wait on.
        while await _server_subscriptions(server_url) != expected:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def _first_op(client: WorkspaceClient, sub_doc: str) -> int:
    """Iterate a subscription as apps do, leave it with `break`, never close it."""
    async for committed in client.subscribe(WS, sub_doc):
        return committed.clock
    raise AssertionError("the subscription ended")


async def test_a_subscription_left_with_break_is_released_without_aclose(
    server_url: str, token: str
) -> None:
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        assert await asyncio.wait_for(_first_op(client, "tree"), BOUND) == 1
        # Without the release the server streamed the sub-doc to this client, and the client
        # buffered up to `subscription_buffer` frames for it, for the client's whole life.
        await _until_server_subscriptions(server_url, 0)
        await asyncio.gather(
            *(client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c")) for _ in range(20))
        )
        # The registry is still coherent: a new subscription gets every clock once.
        clocks: list[int] = []
        async with client.subscribe(WS, "tree") as sub:
            async for committed in sub:
                clocks.append(committed.clock)
                if committed.clock == 21:
                    break
    assert clocks == list(range(1, 22))


async def test_abandoning_one_of_two_subscriptions_leaves_the_other_fed_exactly_once(
    server_url: str, token: str
) -> None:
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        async with client.subscribe(WS, "tree") as kept:
            assert (await asyncio.wait_for(anext(kept), BOUND)).clock == 1
            assert await asyncio.wait_for(_first_op(client, "tree"), BOUND) == 1
            gc.collect()
            await asyncio.gather(
                *(
                    client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                    for _ in range(30)
                )
            )
            clocks = [(await asyncio.wait_for(anext(kept), BOUND)).clock for _ in range(30)]
            # The kept subscription still holds the server's feed of the sub-doc.
            assert await _server_subscriptions(server_url) == 1
    assert clocks == list(range(2, 32))


async def test_a_consumer_task_nobody_holds_keeps_its_subscription_alive(
    server_url: str, token: str
) -> None:
    """The one reference to a fire-and-forget consumer parked on its subscription is the
    subscription's own waiter: releasing parked subscriptions would let the collector take the
    task, and the app's consumer would stop without a word."""
    seen: list[int] = []
    done = asyncio.Event()
    parked = asyncio.Event()

    async def consume(sub: Subscription) -> None:
        parked.set()
        async for committed in sub:
            seen.append(committed.clock)
            if committed.clock == 25:
                done.set()
                return

    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        # Deliberately not kept: the point of the test.
        asyncio.get_running_loop().create_task(consume(client.subscribe(WS, "tree")))
        await asyncio.wait_for(parked.wait(), BOUND)
        await asyncio.wait_for(_until_server_subscriptions(server_url, 1), BOUND)
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0)
        await asyncio.gather(
            *(client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c")) for _ in range(24))
        )
        await asyncio.wait_for(done.wait(), BOUND)
    assert seen == list(range(1, 26))
