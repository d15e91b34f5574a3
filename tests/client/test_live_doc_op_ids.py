"""`LiveDoc` / `OptimisticDoc`: the view is the confirmed state plus the unanswered
ops, and ends as the server's state, when op_ids repeat, the view re-reads the server, and an
op shares its op_id with another writer's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from cv_mutations import NodeDelete, NodeIncrement, NodeInsert, SubDocState, apply_op, new_op_id
from cv_workspace_client import StillPendingError, WorkspaceClient
from cv_workspace_client._core.optimistic import OptimisticDoc
from cv_workspace_client.live import LiveDoc
from cv_workspace_client.testing import FaultProxy
from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token

from .helpers import WS, fast_config, server_state, token_for
from .live_helpers import BOUND, count_of, offline_view, settled


def _with_n() -> SubDocState:
    state = SubDocState.empty()
    apply_op(state, NodeInsert(node_id="n", parent_id="root"))
    return state


# -- an op answered as a duplicate of a commit the confirmed state already holds ----------------


async def test_an_edit_committed_before_the_view_opened_is_not_shown_twice(
    server_url: str,
) -> None:
    """The SDK's advice after a cancel: send the same op (same op_id) again. If the first send
    committed before the LiveDoc read the state, the server answers `duplicate` with a clock the
    view already holds, and no feed frame will ever come for it."""
    async with WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        op = NodeIncrement(node_id="n", field="c", op_id=new_op_id())
        await client.apply_op(WS, "tree", op)
        async with LiveDoc(client, WS, "tree") as doc:
            commit = await asyncio.wait_for(doc.apply_op(op), BOUND)
            assert commit.duplicate
            assert commit.clock <= doc.clock
            assert doc.pending == ()
            truth = await server_state(server_url, "tree")
            assert doc.state.to_json() == truth["state"]
            assert count_of(doc.state) == 1


async def test_an_edit_sent_again_after_its_caller_gave_up_shows_once_offline(
    server_url: str,
) -> None:
    async with offline_view(server_url) as net:
        doc = net.doc
        op = NodeIncrement(node_id="n", field="c", op_id=new_op_id())
        for _ in range(2):  # the app's retry of one intent, as the SDK advises
            with pytest.raises(StillPendingError):
                await asyncio.wait_for(doc.apply_op(op), BOUND)
        assert count_of(doc.state) == 1
        net.back_online()
        truth = await settled(doc, server_url)
        assert doc.state.to_json() == truth["state"]
        assert count_of(doc.state) == 1


def test_a_pending_op_the_feed_delivers_at_or_below_the_confirmed_clock_leaves() -> None:
    """After a re-read (`resync`) at clock 2 that already holds our op committed at clock 2,
    the feed still delivers clock 2: old for the clock, but it says our op is confirmed."""
    doc = OptimisticDoc(1, _with_n())
    op = NodeIncrement(node_id="n", field="c", op_id="mine0000")
    doc.local("mine0000", op)
    fresh = _with_n()
    apply_op(fresh, op)
    doc.resync(2, fresh)
    assert count_of(doc.state) == 2  # confirmed 1 + pending 1: right until the feed speaks
    doc.committed(2, "mine0000", op)
    assert doc.pending == ()
    assert count_of(doc.state) == 1


def test_the_same_op_submitted_twice_shows_once_before_and_after_its_commit() -> None:
    """Two `apply_op` calls with one op_id (the SDK's advice after a cancel): the server applies
    it once, so the view shows it once, and nothing of it stays once the feed confirms it."""
    doc = OptimisticDoc(1, _with_n())
    op = NodeIncrement(node_id="n", field="c", op_id="again000")
    doc.local("again000", op)
    doc.orphaned("again000")  # its caller gave up
    doc.local("again000", op)
    assert count_of(doc.state) == 1
    assert doc.orphans() == []  # someone waits for it again
    doc.committed(2, "again000", op)
    assert doc.pending == ()
    assert count_of(doc.state) == 1


def test_another_writers_op_under_our_op_id_is_not_taken_for_ours() -> None:
    """Our head op and another writer's different op share an op_id (the server refuses ours
    as `op_id_reuse`): the feed's op is what the server holds, ours never commits."""
    doc = OptimisticDoc(1, _with_n())
    ours = NodeIncrement(node_id="n", field="c", by=1, op_id="shared00")
    theirs = NodeIncrement(node_id="n", field="c", by=100, op_id="shared00")
    doc.local("shared00", ours)
    doc.committed(2, "shared00", theirs)
    assert doc.pending == ()
    assert count_of(doc.state) == 100


# -- everything at once, through a network that cuts ---------------------------------------------


async def test_two_views_end_as_the_servers_state_whatever_the_app_and_others_do(
    server_url: str,
) -> None:
    """Two LiveDocs of one sub-doc in one client, the app also writing it directly (single ops
    and atomic groups), ops rejected, callers that give up, another client, and a proxy that
    cuts connections mid-stream: both views end as the server's state."""
    async with (
        FaultProxy(server_url, seed=7) as proxy,
        WorkspaceClient(proxy.url, token=token_for(WS), config=fast_config()) as mine,
        WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as theirs,
    ):
        await mine.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        async with LiveDoc(mine, WS, "tree") as one, LiveDoc(mine, WS, "tree") as two:
            proxy.cut_chunks(0.2, skip_chunks=1)
            calls: list[asyncio.Future[Any]] = []
            for i in range(40):
                doc = one if i % 2 else two
                calls.append(
                    asyncio.ensure_future(doc.apply_op(NodeIncrement(node_id="n", field="c")))
                )
                # Rejected: no such node (the view cannot take it either).
                calls.append(
                    asyncio.ensure_future(doc.apply_op(NodeIncrement(node_id="x", field="c")))
                )
                if i % 5 == 0:  # a caller that gives up once its op is sent: it goes on
                    call = asyncio.ensure_future(
                        doc.apply_op(NodeIncrement(node_id="n", field="c", by=3))
                    )
                    asyncio.get_running_loop().call_soon(call.cancel)
                    calls.append(call)
                if i % 4 == 0:
                    calls.append(
                        asyncio.ensure_future(
                            mine.apply_ops(
                                WS,
                                "tree",
                                [
                                    NodeIncrement(node_id="n", field="c", by=100),
                                    NodeInsert(node_id=f"g{i}", parent_id="root"),
                                ],
                                atomic=True,
                            )
                        )
                    )
                if i % 3 == 0:
                    calls.append(
                        asyncio.ensure_future(
                            theirs.apply_op(WS, "tree", NodeInsert(node_id=f"t{i}", parent_id="n"))
                        )
                    )
                calls.append(
                    asyncio.ensure_future(
                        mine.apply_op(WS, "tree", NodeIncrement(node_id="n", field="d"))
                    )
                )
                await asyncio.sleep(0)
            await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), BOUND)
            proxy.cut_chunks(0)
            assert proxy.stats.cuts > 0  # the feed resumed by catch-up, ops were resent
            for doc in (one, two):
                truth = await settled(doc, server_url)
                assert doc.state.to_json() == truth["state"]
            assert count_of(one.state) == 40 + 8 * 3 + 10 * 100


@pytest.mark.acceptance
async def test_the_view_survives_the_server_being_killed_and_restarted(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "server.db", free_port(), tmp_path / "server.log")
    server.start()
    try:
        token = mint_cli_token(tmp_path / "server.db", WS)
        async with WorkspaceClient(server.url, token=token, config=fast_config()) as client:
            await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            async with LiveDoc(client, WS, "tree") as doc:
                first = [
                    asyncio.ensure_future(doc.apply_op(NodeIncrement(node_id="n", field="c")))
                    for _ in range(20)
                ]
                await asyncio.sleep(0)
                server.kill()
                more = [
                    asyncio.ensure_future(doc.apply_op(NodeIncrement(node_id="n", field="c")))
                    for _ in range(20)
                ]
                await asyncio.sleep(0)
                assert count_of(doc.state) == 40  # shown at once, server or no server
                server.start()
                outcomes = await asyncio.wait_for(
                    asyncio.gather(*first, *more, return_exceptions=True), BOUND
                )
                assert all(
                    not isinstance(o, BaseException) or isinstance(o, StillPendingError)
                    for o in outcomes
                ), outcomes
                truth = await settled(doc, server.url, token)
                assert doc.state.to_json() == truth["state"]
                assert count_of(doc.state) == 40
    finally:
        server.stop()


# -- lifetime: the client closing under the view, the view closing under its calls -------------


async def test_the_client_closing_under_the_view_ends_its_changes_and_its_close_is_quiet(
    server_url: str, tmp_path: Path
) -> None:
    client = WorkspaceClient(
        server_url, token=token_for(WS), config=fast_config(), outbox=tmp_path / "o.db"
    )
    await client.start()
    await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
    async with LiveDoc(client, WS, "tree") as doc:
        seen: list[int] = []

        async def watch() -> None:
            async for state in doc.changes():
                seen.append(count_of(state))

        watcher = asyncio.ensure_future(watch())
        call = asyncio.ensure_future(doc.apply_op(NodeIncrement(node_id="n", field="c")))
        await asyncio.sleep(0)
        await client.close()
        await asyncio.wait_for(watcher, BOUND)  # ended, not left waiting forever
        outcome = await asyncio.gather(call, return_exceptions=True)
        if isinstance(outcome[0], StillPendingError):
            assert count_of(doc.state) == 1  # it waits in the outbox: still shown
        assert doc.error is None


async def test_changes_consumers_that_lag_or_are_cancelled_leave_the_others_current(
    server_url: str,
) -> None:
    async with (
        WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as client,
    ):
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        async with LiveDoc(client, WS, "tree") as doc:
            lagging = doc.changes()
            assert count_of(await anext(lagging)) == 0

            async def next_change() -> SubDocState:
                changes = doc.changes()
                await anext(changes)  # the view now
                return await anext(changes)  # waits for a change

            cancelled = asyncio.ensure_future(next_change())
            await asyncio.sleep(0)
            assert len(doc._wakers) == 1
            cancelled.cancel()
            await asyncio.gather(cancelled, return_exceptions=True)
            assert not doc._wakers  # the cancelled consumer left nothing behind
            for _ in range(5):
                await asyncio.wait_for(doc.apply_op(NodeIncrement(node_id="n", field="c")), BOUND)
            await settled(doc, server_url)
            # The lagging consumer gets the latest view at once, not every step in between.
            assert count_of(await asyncio.wait_for(anext(lagging), BOUND)) == 5
        async for _ in lagging:  # the view closed: its changes end
            pass


async def test_closing_the_view_with_calls_in_flight_lets_them_finish(server_url: str) -> None:
    async with WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        doc = LiveDoc(client, WS, "tree")
        await doc.__aenter__()
        calls = [
            asyncio.ensure_future(doc.apply_op(NodeIncrement(node_id="n", field="c")))
            for _ in range(5)
        ]
        await asyncio.sleep(0)
        await doc.aclose()
        commits = await asyncio.wait_for(asyncio.gather(*calls), BOUND)
        assert len({c.clock for c in commits}) == 5
        truth = await server_state(server_url, "tree")
        assert truth["state"]["nodes"]["n"]["fields"]["c"] == 5


# -- a view that diverged from the server --------------------------------------------------------


async def test_a_diverged_view_rereads_the_server_and_keeps_its_pending_edits(
    server_url: str,
) -> None:
    async with (
        WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as mine,
        WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as theirs,
    ):
        await mine.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        await mine.apply_op(WS, "tree", NodeInsert(node_id="m", parent_id="root"))
        async with LiveDoc(mine, WS, "tree") as doc:
            # A copy gone wrong (it never should: the test breaks it by hand).
            apply_op(doc.state, NodeDelete(node_id="m"))
            await asyncio.wait_for(doc.apply_op(NodeIncrement(node_id="n", field="c")), BOUND)
            await theirs.apply_op(WS, "tree", NodeIncrement(node_id="m", field="c"))
            truth = await settled(doc, server_url)
            assert doc.state.to_json() == truth["state"]


async def test_an_edit_the_reread_state_already_holds_leaves_the_view(server_url: str) -> None:
    """The view diverges (Diverged) and re-reads the server: the state it reads already holds
    our pending edit (committed meanwhile, here by the app's other process under the same
    op_id). The feed goes on to deliver that edit's clock, which the view is now past: it
    must still take the edit out of the pending ops, or the view shows it twice for good."""
    async with FaultProxy(server_url) as proxy:
        config = fast_config(retry_attempts=50, ops_over_websocket=False)
        async with (
            WorkspaceClient(proxy.url, token=token_for(WS), config=config) as mine,
            WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as theirs,
        ):
            await mine.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            await mine.apply_op(WS, "tree", NodeInsert(node_id="m", parent_id="root"))
            async with LiveDoc(mine, WS, "tree") as doc:
                apply_op(doc.state, NodeDelete(node_id="m"))  # broken by hand, as above
                proxy.refuse = True
                proxy.drop_all()
                op = NodeIncrement(node_id="n", field="c", op_id=new_op_id())
                call = asyncio.ensure_future(doc.apply_op(op))
                await asyncio.sleep(0)
                assert count_of(doc.state) == 1
                await theirs.apply_op(WS, "tree", NodeIncrement(node_id="m", field="c"))
                await theirs.apply_op(WS, "tree", op)
                proxy.refuse = False
                commit = await asyncio.wait_for(call, BOUND)
                assert commit.duplicate
                truth = await settled(doc, server_url)
                assert doc.state.to_json() == truth["state"]
                assert count_of(doc.state) == 1


async def test_another_writers_op_under_our_op_id_shows_as_theirs(server_url: str) -> None:
    """Offline, the app applies an op whose op_id another process then uses for a different
    op (an app bug the server answers with `op_id_reuse`). The feed's op is what the server
    holds: the view must show theirs, never keep ours as if it had been committed."""
    async with offline_view(server_url) as net:
        doc = net.doc
        shared = new_op_id()
        ours = NodeIncrement(node_id="n", field="c", by=1, op_id=shared)
        with pytest.raises(StillPendingError):
            await asyncio.wait_for(doc.apply_op(ours), BOUND)
        await net.theirs.apply_op(
            WS, "tree", NodeIncrement(node_id="n", field="c", by=100, op_id=shared)
        )
        net.back_online()
        truth = await settled(doc, server_url)
        assert doc.state.to_json() == truth["state"]
        assert count_of(doc.state) == 100
