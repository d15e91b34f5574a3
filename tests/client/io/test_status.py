"""`sync_status` / `watch_sync_status()`: what an app shows as "saving…", "saved" and "offline",
followed through the real server and a FaultProxy that refuses and drops connections, and across
a restart on an outbox holding ops the server never saw."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import SyncStatus, WorkspaceClient
from cv_workspace_client._core.machine import OutboxMachine
from cv_workspace_client._io.status import SyncSignals
from cv_workspace_client.testing import FaultProxy

from ..helpers import WS, fast_config, server_state, token_for

#: Every wait is bounded: a status that never comes fails the test instead of hanging it.
BOUND = 20.0


async def until(
    watch: AsyncIterator[SyncStatus], predicate: Callable[[SyncStatus], bool]
) -> SyncStatus:
    """The first status the watch yields that satisfies `predicate`."""
    async with asyncio.timeout(BOUND):
        async for status in watch:
            if predicate(status):
                return status
    raise AssertionError("the watch ended first")


async def test_the_status_follows_ops_in_flight_and_the_socket_going_and_coming_back(
    server_url: str, token: str
) -> None:
    async with (
        FaultProxy(server_url) as proxy,
        WorkspaceClient(proxy.url, token=token, config=fast_config()) as client,
    ):
        watch = client.watch_sync_status()
        first = await asyncio.wait_for(anext(watch), BOUND)
        assert first == SyncStatus(pending=0, connected=frozenset())
        assert first.synced
        await client.connect(WS, timeout=BOUND)
        assert await until(watch, lambda s: WS in s.connected) == client.sync_status

        # The server unreachable: the socket is lost and the ops wait, "offline, saving".
        proxy.refuse = True
        proxy.drop_all()
        offline = await until(watch, lambda s: not s.connected)
        assert offline.synced
        ops = [
            asyncio.ensure_future(client.apply_op(WS, "tree", op))
            for op in [NodeInsert(node_id="n", parent_id="root")]
            + [NodeIncrement(node_id="n", field="c") for _ in range(9)]
        ]
        saving = await until(watch, lambda s: s.pending == 10)
        assert not saving.synced
        assert not saving.connected

        # Back: the ops are sent under their op_ids and the status says saved, connected.
        proxy.refuse = False
        client.retry_pending()
        saved = await until(watch, lambda s: s.synced and WS in s.connected)
        assert saved == SyncStatus(pending=0, connected=frozenset({WS}))
        assert all(op.done() and not op.exception() for op in ops)
    assert (await server_state(server_url, "tree"))["state"]["nodes"]["n"]["fields"]["c"] == 9


async def test_a_watcher_that_falls_behind_gets_the_latest_status_not_a_backlog(
    server_url: str, token: str
) -> None:
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        watch = client.watch_sync_status()
        assert (await anext(watch)).synced
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        for _ in range(20):  # 20 rounds of pending → answered, none of them read meanwhile
            await client.apply_ops(WS, "tree", [NodeIncrement(node_id="n", field="c")] * 5)
        latest = await asyncio.wait_for(anext(watch), BOUND)
        assert latest == client.sync_status
        assert latest.synced
        await client.close()
        # The client closed: the watch yields what changed (the socket closed), then ends.
        rest = [status async for status in watch]
    assert rest == [SyncStatus(pending=0, connected=frozenset())]


async def test_a_client_restarted_on_an_outbox_with_pending_ops_says_so_until_they_are_sent(
    server_url: str, token: str, tmp_path: Path
) -> None:
    outbox = tmp_path / "app.outbox"
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True  # the first client never reaches the server
        async with WorkspaceClient(
            proxy.url, token=token, outbox=outbox, config=fast_config()
        ) as c:
            tasks = [
                asyncio.ensure_future(
                    c.apply_op(WS, "tree", NodeInsert(node_id=f"n{i}", parent_id="root"))
                )
                for i in range(3)
            ]
            await until(c.watch_sync_status(), lambda s: s.pending == 3)
        for task in tasks:
            assert task.done()
            task.exception()  # StillPendingError: they stay in the outbox
        async with WorkspaceClient(
            proxy.url, token=token, outbox=outbox, config=fast_config()
        ) as client:
            watch = client.watch_sync_status()
            restored = await until(watch, lambda s: s.pending > 0)
            assert restored.pending == 3
            assert not restored.connected
            proxy.refuse = False
            await client.connect(WS, timeout=BOUND)
            client.retry_pending()
            assert (await until(watch, lambda s: s.synced)).pending == 0
    state = await server_state(server_url, "tree")
    assert {"n0", "n1", "n2"} <= set(state["state"]["nodes"])


async def test_a_value_watcher_sees_a_change_the_shared_status_does_not() -> None:
    """One sub-doc's count can move while the client-wide one stays (an op answered as another
    sub-doc's is submitted, in one pump): a watcher of the shared status sees nothing, and a
    `LiveDoc` woken by it left an unanswered op in its view until some later change."""
    counts = {"a": 1, "b": 0}
    signals = SyncSignals(
        OutboxMachine(now=lambda: 0.0, new_op_id=str, backoff=float),
        lambda: SyncStatus(
            pending=sum(counts.values()), connected=frozenset(), refused=frozenset()
        ),
    )
    shared = signals.watch()
    mine = signals.watch_value(lambda: counts["a"])
    assert (await anext(shared)).pending == 1
    assert await anext(mine) == 1
    shared_next = asyncio.ensure_future(anext(shared))
    mine_next = asyncio.ensure_future(anext(mine))
    await asyncio.sleep(0)
    counts.update(a=0, b=1)  # one pump: "a" answered, "b" submitted
    signals.update()
    assert await asyncio.wait_for(mine_next, 1) == 0
    assert not shared_next.done()  # the client-wide count did not move
    signals.update()  # nothing changed: nothing yielded
    again = asyncio.ensure_future(anext(mine))
    await asyncio.sleep(0)
    assert not again.done()
    signals.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(again, 1)
    with pytest.raises(StopAsyncIteration):  # the shared status never moved: it just ends
        await asyncio.wait_for(shared_next, 1)


async def test_watch_pending_follows_one_sub_docs_count_to_zero(server_url: str) -> None:
    async with WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as client:
        seen: list[int] = []

        async def watch() -> None:
            async for count in client.watch_pending(WS, "tree"):
                seen.append(count)
                if count == 0 and len(seen) > 1:
                    return

        watching = asyncio.ensure_future(watch())
        await asyncio.sleep(0)
        await asyncio.gather(
            client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root")),
            client.apply_op(WS, "other", NodeInsert(node_id="n", parent_id="root")),
        )
        await asyncio.wait_for(watching, 10)
    assert seen[0] == 0
    assert seen[-1] == 0
    assert max(seen) == 1  # "other"'s op never counts for "tree"
