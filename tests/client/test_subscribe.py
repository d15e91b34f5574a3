"""Subscriptions through the real server: every clock once, in order, across cuts, overflow and
shared feeds; auth errors end them."""

from __future__ import annotations

import asyncio
import time

import pytest

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import Committed, ForbiddenError, WorkspaceClient
from cv_workspace_client.testing import FaultProxy

from .helpers import WS, collect, fast_config, token_for

TIMEOUT = 30


async def write_increments(client: WorkspaceClient, sub_doc: str, count: int) -> None:
    await asyncio.gather(
        *(client.apply_op(WS, sub_doc, NodeIncrement(node_id="n", field="c")) for _ in range(count))
    )


async def test_a_subscription_sees_the_log_then_live_ops_each_once_in_order(
    server_url: str, token: str
) -> None:
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        await write_increments(client, "tree", 9)
        async with client.subscribe(WS, "tree", since=3) as sub:
            reader = asyncio.create_task(collect(sub, 30))
            await write_increments(client, "tree", 20)
            clocks = await asyncio.wait_for(reader, TIMEOUT)
            first = await anext(aiter(client.subscribe(WS, "tree", since=0)))
    assert clocks == list(range(4, 31))
    assert isinstance(first, Committed)
    assert first.clock == 1
    assert first.op == NodeInsert(node_id="n", parent_id="root", op_id=first.op_id)


async def test_a_subscription_cut_again_and_again_resumes_without_gap_or_duplicate(
    server_url: str, token: str
) -> None:
    async with (
        FaultProxy(server_url) as proxy,
        WorkspaceClient(server_url, token=token, config=fast_config()) as writer,
        WorkspaceClient(proxy.url, token=token, config=fast_config()) as reader,
    ):
        await writer.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        async with reader.subscribe(WS, "tree") as sub:
            seen = asyncio.create_task(collect(sub, 301))
            for round_ in range(6):
                await write_increments(writer, "tree", 50)
                # A fault landing while the reader is between connections hits nothing (the
                # count below then came out short now and then): wait for its socket first.
                await reader.connect(WS, timeout=TIMEOUT)
                if round_ % 2:
                    proxy.cut_open(forward_bytes=3)  # the next frame arrives torn in half
                else:
                    proxy.drop_all()
            clocks = await asyncio.wait_for(seen, TIMEOUT)
    assert clocks == list(range(1, 302))
    assert proxy.stats.dropped + proxy.stats.cuts >= 3


async def test_a_slow_consumer_overflowing_its_buffer_catches_up_from_the_log(
    server_url: str, token: str
) -> None:
    async with (
        WorkspaceClient(server_url, token=token, config=fast_config()) as writer,
        WorkspaceClient(
            server_url, token=token, config=fast_config(subscription_buffer=4, catchup_page=7)
        ) as reader,
    ):
        await writer.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        async with reader.subscribe(WS, "tree", since=1) as sub:
            await reader.connect(WS, timeout=TIMEOUT)
            await write_increments(writer, "tree", 60)  # nobody reads meanwhile
            clocks = await asyncio.wait_for(collect(sub, 61), TIMEOUT)
            assert sub.frames_dropped > 0  # the buffer did overflow
    assert clocks == list(range(2, 62))


async def test_two_subscriptions_to_one_sub_doc_each_get_their_own_exact_stream(
    server_url: str, token: str
) -> None:
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        await write_increments(client, "tree", 10)
        async with (
            client.subscribe(WS, "tree", since=8) as late,
            client.subscribe(WS, "tree", since=2) as early,
        ):
            late_seen = asyncio.create_task(collect(late, 31))
            early_seen = asyncio.create_task(collect(early, 31))
            await write_increments(client, "tree", 20)
            assert await asyncio.wait_for(late_seen, TIMEOUT) == list(range(9, 32))
            assert await asyncio.wait_for(early_seen, TIMEOUT) == list(range(3, 32))


async def test_a_subscription_refused_by_the_server_raises_its_typed_error(
    server_url: str,
) -> None:
    async with WorkspaceClient(
        server_url, token=token_for("other"), config=fast_config()
    ) as client:
        with pytest.raises(ForbiddenError):
            await asyncio.wait_for(anext(aiter(client.subscribe(WS, "tree"))), TIMEOUT)


async def test_a_subscription_s_ops_carry_the_commit_time_the_log_read_shows(
    server_url: str, token: str
) -> None:
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        before = time.time()
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        async with client.subscribe(WS, "tree") as sub:
            caught_up = await asyncio.wait_for(anext(aiter(sub)), TIMEOUT)
            await write_increments(client, "tree", 1)
            live = await asyncio.wait_for(anext(aiter(sub)), TIMEOUT)
        after = time.time()
        _, logged = await client.read_ops(WS, "tree")
    assert isinstance(caught_up, Committed)
    assert isinstance(live, Committed)
    stamps = [caught_up.committed_at, live.committed_at]
    assert all(at is not None and before - 1 <= at <= after + 1 for at in stamps), stamps
    assert [e.committed_at for e in logged] == stamps
