"""`LiveDoc` across a restart and with no server: ops a new client replays from its outbox are
in the view from the moment it opens (`WorkspaceClient.pending_ops`, the machine's
`lane_pending`), a view opens offline from a state the app cached, a re-read that fails is
retried with the pending edits kept, and a discarded edit never leaves the view to come back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from cv_mutations import NodeDelete, NodeIncrement, NodeInsert, apply_op, new_op_id
from cv_workspace_client import (
    OpDiscardedError,
    StillPendingError,
    WorkspaceClient,
)
from cv_workspace_client._core.machine import BacklogRange, LaneBacklog, Load, OutboxRow, Send
from cv_workspace_client.live import LiveDoc
from cv_workspace_client.testing import FaultProxy

from .helpers import WS, fast_config, server_log, token_for
from .live_helpers import BOUND, Gate, count_of, counts_seen, settled, until
from .machine_helpers import commit_results, inc, make_machine, of_type, persist_all


def _increments(n: int) -> list[NodeIncrement]:
    return [NodeIncrement(node_id="n", field="c", op_id=new_op_id()) for _ in range(n)]


async def _left_offline(proxy: FaultProxy, outbox: Path, ops: list[NodeIncrement]) -> None:
    """A client that applied `ops` with the server unreachable, then quit: they wait in
    `outbox`. The proxy stays refusing."""
    proxy.refuse = True
    config = fast_config(retry_attempts=1, ops_over_websocket=False)
    async with WorkspaceClient(proxy.url, token=token_for(WS), outbox=outbox, config=config) as a:
        with pytest.raises(StillPendingError):
            await asyncio.wait_for(a.apply_ops(WS, "tree", ops), BOUND)


# -- the machine's listing ------------------------------------------------------------------------


def _row(seq: int) -> OutboxRow:
    body = {**inc(), "op_id": f"r{seq}"}
    return OutboxRow(seq, "ws", "tree", f"r{seq}", orjson.dumps(body).decode(), 0.0)


def test_a_lanes_pending_ops_list_a_batch_in_flight_once_and_merge_a_disk_read_made_meanwhile() -> (
    None
):
    """Ten restored rows, four loaded (one batch of two in flight), two new ops. The shell reads
    the six on disk; meanwhile the batch is answered and a page loaded: the merged list is every
    unanswered op once, in seq order."""
    machine = make_machine(max_batch_ops=2)  # pages of 4
    rows = [_row(seq) for seq in range(1, 11)]
    machine.restore(rows[:4], [LaneBacklog("ws", "tree", 10, 10)])
    (send,) = of_type(machine.decisions(), Send)
    machine.submit("ws", "tree", [inc(), inc()])
    persist_all(machine)

    lane = machine.lane_pending("ws", "tree")
    assert [row.seq for row in lane.rows] == [1, 2, 3, 4, 11, 12]  # the batch in flight once
    assert lane.on_disk == BacklogRange("ws", "tree", 4, 10)
    read = rows[4:]  # what the shell reads for that range

    machine.batch_answered(send.batch_id, commit_results(send, 1))
    (load,) = of_type(machine.decisions(), Load)
    machine.loaded("ws", "tree", rows[load.after_seq : load.after_seq + load.limit])
    now = machine.lane_pending("ws", "tree")
    assert [row.seq for row in now.with_disk(read)] == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]


# -- pending_ops and the view after a restart -----------------------------------------------------


async def test_pending_ops_lists_a_restored_backlog_in_order_without_loading_it(
    server_url: str, tmp_path: Path
) -> None:
    outbox = tmp_path / "app.outbox"
    ops = _increments(10)
    async with FaultProxy(server_url) as proxy:
        await _left_offline(proxy, outbox, ops)
        config = fast_config(retry_attempts=1, max_batch_ops=2, ops_over_websocket=False)
        async with WorkspaceClient(
            proxy.url, token=token_for(WS), outbox=outbox, config=config
        ) as b:
            later = NodeIncrement(node_id="n", field="c", by=5, op_id=new_op_id())
            with pytest.raises(StillPendingError):
                await asyncio.wait_for(b.apply_op(WS, "tree", later), BOUND)
            listed = await b.pending_ops(WS, "tree")
            assert listed == [(op.op_id, op) for op in [*ops, later]]
            assert b.pending_count(WS, "tree") == 11
            # Read through the outbox: the machine still holds no more than its page.
            assert b._machine.lane_pending(WS, "tree").on_disk is not None
            assert await b.pending_ops(WS, "other") == []


async def test_edits_left_in_the_outbox_show_in_a_view_opened_after_a_restart(
    server_url: str, tmp_path: Path
) -> None:
    """The user edited offline and quit; the app reopens with the server back. The edits are
    in the view from the start, and land once each — never shown missing, never twice."""
    outbox = tmp_path / "app.outbox"
    async with FaultProxy(server_url) as proxy:
        async with WorkspaceClient(server_url, token=token_for(WS)) as theirs:
            await theirs.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        await _left_offline(proxy, outbox, _increments(3))
        config = fast_config(retry_attempts=2, ops_over_websocket=False)
        async with WorkspaceClient(
            proxy.url, token=token_for(WS), outbox=outbox, config=config
        ) as b:
            # Its replay gives up while the proxy refuses; it goes again once the view's
            # websocket opens (after the view has read the state and listed the ops).
            await asyncio.wait_for(proxy.wait_until(lambda s: s.refused >= 3), BOUND)
            proxy.refuse = False
            async with LiveDoc(b, WS, "tree") as doc:
                assert doc.clock == 1
                assert count_of(doc.state) == 3
                assert len(doc.pending) == 3
                seen: list[Any] = []
                watcher = asyncio.ensure_future(counts_seen(doc, seen))
                truth = await settled(doc, server_url)
                assert doc.state.to_json() == truth["state"]
                watcher.cancel()
                assert set(seen) == {3}


async def test_a_replayed_op_the_state_already_holds_shows_twice_only_until_it_is_answered(
    server_url: str, tmp_path: Path
) -> None:
    """The rule for an op committed before the view read the state but not yet answered when
    it listed the pending ops (here: the replay's answer lost, its retry held back): the view
    shows it on top of the state that holds it, and takes it out once the client has its
    answer and the feed has reached the server's head."""
    outbox = tmp_path / "app.outbox"
    gate = Gate()
    async with FaultProxy(server_url) as proxy:
        async with WorkspaceClient(server_url, token=token_for(WS)) as theirs:
            await theirs.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        (op,) = _increments(1)
        await _left_offline(proxy, outbox, [op])
        proxy.refuse = False
        proxy.cut_next(1)  # the replay: committed, its answer lost
        config = fast_config(ops_over_websocket=False, sleep=gate)
        async with WorkspaceClient(
            proxy.url, token=token_for(WS), outbox=outbox, config=config
        ) as b:
            await asyncio.wait_for(gate.entered.wait(), BOUND)  # its retry waits on the gate
            assert proxy.stats.cuts == 1
            async with LiveDoc(b, WS, "tree") as doc:
                assert doc.clock == 2
                assert count_of(doc.state) == 2  # committed, and still pending in the client
                gate.open()
                truth = await settled(doc, server_url)
                assert doc.state.to_json() == truth["state"]
                assert count_of(doc.state) == 1
        assert [e["op_id"] for e in await server_log(server_url, "tree")].count(op.op_id) == 1


# -- no server at open -------------------------------------------------------------------------


async def test_a_view_opens_offline_from_a_cached_state_and_converges_when_the_server_is_back(
    server_url: str, tmp_path: Path
) -> None:
    outbox = tmp_path / "app.outbox"
    async with FaultProxy(server_url) as proxy:
        async with WorkspaceClient(server_url, token=token_for(WS)) as theirs:
            await theirs.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            cached = await theirs.get_state(WS, "tree")  # what the app kept from last time
            restored = _increments(2)
            await _left_offline(proxy, outbox, restored)
            config = fast_config(retry_attempts=2)
            async with (
                WorkspaceClient(proxy.url, token=token_for(WS), outbox=outbox, config=config) as b,
                LiveDoc(b, WS, "tree", initial=cached) as doc,
            ):
                assert (doc.clock, count_of(doc.state), len(doc.pending)) == (1, 2, 2)
                assert count_of(cached[1]) == 0  # the app's copy is left alone
                edit = NodeIncrement(node_id="n", field="c", op_id=new_op_id())
                with pytest.raises(StillPendingError):
                    await asyncio.wait_for(doc.apply_op(edit), BOUND)
                assert count_of(doc.state) == 3
                await theirs.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=10))

                proxy.refuse = False  # the server is back
                b.retry_pending()
                truth = await settled(doc, server_url)
                assert doc.state.to_json() == truth["state"]
                assert count_of(doc.state) == 13
        log = [e["op_id"] for e in await server_log(server_url, "tree")]
        for op in [*restored, edit]:
            assert log.count(op.op_id) == 1


async def test_a_views_snapshot_reopens_it_offline_with_each_pending_edit_once(
    server_url: str, tmp_path: Path
) -> None:
    """What an app keeps to reopen a view offline is `doc.snapshot()`: the confirmed state.
    A copy of `doc.state` holds the pending edits, which the outbox applies again on it: each
    edit would show twice. This test pins that the snapshot carries each pending edit once."""
    outbox = tmp_path / "app.outbox"
    async with FaultProxy(server_url) as proxy:
        async with WorkspaceClient(server_url, token=token_for(WS)) as theirs:
            await theirs.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            cached = await theirs.get_state(WS, "tree")
        await _left_offline(proxy, outbox, _increments(2))
        config = fast_config(retry_attempts=1)
        async with (
            WorkspaceClient(proxy.url, token=token_for(WS), outbox=outbox, config=config) as b,
            LiveDoc(b, WS, "tree", initial=cached) as doc,
        ):
            with pytest.raises(StillPendingError):
                await asyncio.wait_for(doc.apply_op(_increments(1)[0]), BOUND)
            assert count_of(doc.state) == 3
            kept = doc.snapshot()
            assert kept[0] == doc.clock == 1
            assert count_of(kept[1]) == 0  # the server's state, without the pending edits
            assert count_of(doc.state) == 3  # the view is untouched
        async with (  # the app again, still offline
            WorkspaceClient(proxy.url, token=token_for(WS), outbox=outbox, config=config) as b,
            LiveDoc(b, WS, "tree", initial=kept) as doc,
        ):
            assert (count_of(doc.state), len(doc.pending)) == (3, 3)


async def test_a_kept_state_ahead_of_the_servers_log_is_replaced_by_the_servers(
    server_url: str, tmp_path: Path
) -> None:
    """`initial` at a clock the server never reached (it was restored from an older copy): the
    view re-reads the server's state and follows from it, its edits kept, rather than keep showing
    the kept state with `error` set."""
    async with WorkspaceClient(server_url, token=token_for(WS)) as theirs:
        await theirs.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        await theirs.apply_op(WS, "elsewhere", NodeInsert(node_id="n", parent_id="root"))
        for _ in range(5):
            await theirs.apply_op(WS, "elsewhere", NodeIncrement(node_id="n", field="c", by=10))
        kept = await theirs.get_state(WS, "elsewhere")  # clock 6, c = 50: not this log's
        assert kept[0] == 6
        async with (
            WorkspaceClient(server_url, token=token_for(WS), outbox=tmp_path / "o") as b,
            LiveDoc(b, WS, "tree", initial=kept) as doc,
        ):
            edit = _increments(1)[0]
            await asyncio.wait_for(doc.apply_op(edit), BOUND)
            truth = await settled(doc, server_url)
            # `settled` alone passes on the kept clock (6 >= 2) if the edit's answer beat the
            # feed's refusal: wait for the re-read itself.
            await until(doc, lambda d: d.clock == truth["clock"])
            assert doc.error is None
            assert doc.state.to_json() == truth["state"]
            assert count_of(doc.state) == 1
            assert doc.clock == 2
    log = [e["op_id"] for e in await server_log(server_url, "tree")]
    assert log.count(edit.op_id) == 1


# -- a re-read that fails ----------------------------------------------------------------------


async def test_a_diverged_view_whose_reread_fails_tries_again_until_the_server_answers(
    server_url: str,
) -> None:
    async with FaultProxy(server_url) as proxy:
        config = fast_config(retry_attempts=2, ops_over_websocket=False)
        async with (
            WorkspaceClient(proxy.url, token=token_for(WS), config=config) as mine,
            WorkspaceClient(server_url, token=token_for(WS)) as theirs,
        ):
            await theirs.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            await theirs.apply_op(WS, "tree", NodeInsert(node_id="m", parent_id="root"))
            async with LiveDoc(mine, WS, "tree") as doc:
                # Only the feed's websocket stays: the HTTP connection of the open is dropped.
                accepted = proxy.stats.accepted
                proxy.drop_all()
                await asyncio.wait_for(proxy.wait_until(lambda s: s.accepted > accepted), BOUND)
                await mine.connect(WS, timeout=BOUND)
                assert proxy.stats.open == 1
                proxy.refuse = True  # HTTP unreachable from now on; the feed goes on
                apply_op(doc.state, NodeDelete(node_id="m"))  # a copy gone wrong (by hand)
                refused = proxy.stats.refused
                await theirs.apply_op(WS, "tree", NodeIncrement(node_id="m", field="c"))
                # Three failed `get_state` calls of two tries each: the view went on trying.
                await asyncio.wait_for(proxy.wait_until(lambda s: s.refused >= refused + 6), BOUND)
                assert doc.error is None
                proxy.refuse = False
                truth = await settled(doc, server_url)
                assert doc.state.to_json() == truth["state"]
                # Still following: what is committed next shows.
                await theirs.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                truth = await settled(doc, server_url)
                assert doc.state.to_json() == truth["state"]
                assert count_of(doc.state) == 1


async def test_a_view_whose_reread_waits_out_a_backoff_stops_when_its_client_closes(
    server_url: str,
) -> None:
    """The client closed while the view's re-read waited out its backoff: the view went on
    until the backoff ended (up to `retry_cap_seconds`), a task outliving its client. It now
    stops with the client: its feed of changes ends, its tasks are done."""
    gate = Gate()  # every retry delay is held: the backoff never ends by itself
    async with FaultProxy(server_url) as proxy:
        config = fast_config(retry_attempts=2, ops_over_websocket=False, sleep=gate)
        async with (
            WorkspaceClient(proxy.url, token=token_for(WS), config=config) as mine,
            WorkspaceClient(server_url, token=token_for(WS)) as theirs,
        ):
            await theirs.apply_op(WS, "tree", NodeInsert(node_id="m", parent_id="root"))
            doc = LiveDoc(mine, WS, "tree")
            async with doc:
                # Only the feed's websocket stays: the HTTP connection of the open is dropped.
                accepted = proxy.stats.accepted
                proxy.drop_all()
                await asyncio.wait_for(proxy.wait_until(lambda s: s.accepted > accepted), BOUND)
                await mine.connect(WS, timeout=BOUND)
                assert proxy.stats.open == 1
                proxy.refuse = True  # HTTP unreachable from now on; the feed goes on
                apply_op(doc.state, NodeDelete(node_id="m"))  # a copy gone wrong (by hand)
                await theirs.apply_op(WS, "tree", NodeIncrement(node_id="m", field="c"))
                await asyncio.wait_for(gate.entered.wait(), BOUND)  # the re-read's backoff
                await mine.close()
                async with asyncio.timeout(BOUND):
                    async for _ in doc.changes():
                        pass  # ends when the view stops
                assert all(task.done() for task in doc._tasks)


# -- discarding ------------------------------------------------------------------------------------


async def test_a_discarded_edit_the_server_may_hold_never_leaves_the_view_to_come_back(
    server_url: str,
) -> None:
    """The edit reached the server, which committed it; its answer was lost, and the feed is
    down. The app discards it (`maybe_applied`). Taken out of the view then, it came back when
    the feed caught up: the view keeps it until it knows, and here the server holds it."""
    gate = Gate()
    async with FaultProxy(server_url) as proxy:
        config = fast_config(ops_over_websocket=False, sleep=gate)
        async with (
            WorkspaceClient(proxy.url, token=token_for(WS), config=config) as mine,
            WorkspaceClient(server_url, token=token_for(WS)) as theirs,
        ):
            await theirs.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            async with LiveDoc(mine, WS, "tree") as doc:
                await mine.connect(WS, timeout=BOUND)
                seen: list[Any] = []
                watcher = asyncio.ensure_future(counts_seen(doc, seen))
                proxy.refuse = True
                proxy.drop_all()  # the feed is down; its reconnect waits on the gate
                await asyncio.wait_for(gate.entered.wait(), BOUND)
                proxy.refuse = False
                gate.entered.clear()
                proxy.cut_next(1)
                call = asyncio.ensure_future(doc.apply_op(NodeIncrement(node_id="n", field="c")))
                await asyncio.wait_for(gate.entered.wait(), BOUND)  # its retry waits too
                assert proxy.stats.cuts == 1
                assert await mine.discard_pending(WS, "tree") == 1
                with pytest.raises(OpDiscardedError) as caught:
                    await asyncio.wait_for(call, BOUND)
                assert caught.value.maybe_applied
                gate.open()
                truth = await settled(doc, server_url)
                assert doc.state.to_json() == truth["state"]
                assert count_of(doc.state) == 1
                watcher.cancel()
                shown = seen.index(1)
                assert 0 not in seen[shown:], seen
