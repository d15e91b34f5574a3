"""`WorkspaceClient.discard_pending()`: the app gives up, for good, on ops the server will never
take (access revoked, a user signing out who drops unsynced changes). Without it such ops sat in
the outbox for ever — replayed by every client opened on it, refused every time, the sync status
saying "refused" — and the app had no way out short of deleting the file under a live client.

A discarded op leaves the outbox durably and is never sent again; a batch in flight is never
discarded (the server may be applying it), so nothing the app was told is discarded gets applied.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import (
    ClientConfig,
    InvalidRequestError,
    OpDiscardedError,
    StillPendingError,
    WorkspaceClient,
)
from cv_workspace_client._core.machine import (
    Discard,
    LaneBacklog,
    Load,
    OutboxRow,
    Resolve,
    Send,
    Wait,
)
from cv_workspace_client.errors import AuthError, ConnectionFailedError
from cv_workspace_client.testing import FaultProxy, restart_client

from .helpers import WS, fast_config, server_log, token_for
from .machine_helpers import commit_results, inc, make_machine, of_type, persist_all

BOUND = 20.0


# -- the machine's rule --------------------------------------------------------------------------


def test_a_refused_lane_is_discarded_whole_and_the_workspace_is_no_longer_refused() -> None:
    machine = make_machine()
    machine.submit("ws", "tree", [inc(), inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_failed(send.batch_id, AuthError("unauthorized", "expired"))
    machine.decisions()
    assert machine.refused_workspaces() == {"ws"}

    count, resolve = machine.discard("ws")
    assert count == 3
    assert resolve is None  # their callers already heard StillPendingError at the refusal
    (discard,) = of_type(machine.decisions(), Discard)
    assert discard.seqs == tuple(row.seq for row in send.rows)
    assert machine.pending_count == 0
    assert machine.refused_workspaces() == frozenset()
    assert not machine.is_parked("ws", "tree")


def test_a_batch_in_flight_is_kept_and_answered_the_ops_behind_it_are_discarded() -> None:
    machine = make_machine()
    machine.submit("ws", "tree", [inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    behind = machine.submit("ws", "tree", [inc(), inc(), inc()])
    persist_all(machine)

    count, resolve = machine.discard("ws", "tree")
    assert count == 3
    assert resolve is not None
    assert [seq for seq, _ in resolve.outcomes] == [row.seq for row in behind]
    for _, error in resolve.outcomes:
        assert isinstance(error, OpDiscardedError)
        assert error.maybe_applied is False  # never sent
    (discard,) = of_type(machine.decisions(), Discard)
    assert discard.seqs == tuple(row.seq for row in behind)
    assert machine.pending_count == 2  # the batch in flight

    machine.batch_answered(send.batch_id, commit_results(send, 1))
    decisions = machine.decisions()
    (answered,) = of_type(decisions, Resolve)
    assert [seq for seq, _ in answered.outcomes] == [row.seq for row in send.rows]
    assert of_type(decisions, Send) == []  # nothing of the discarded ops leaves
    assert machine.pending_count == 0


def test_an_op_whose_send_lost_its_answer_is_discarded_as_maybe_applied() -> None:
    machine = make_machine()
    machine.submit("ws", "tree", [inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_failed(send.batch_id, ConnectionFailedError("connection_lost", "cut"))
    (wait,) = of_type(machine.decisions(), Wait)

    count, resolve = machine.discard("ws")
    assert count == 1
    assert resolve is not None
    ((_, error),) = resolve.outcomes
    assert isinstance(error, OpDiscardedError)
    assert error.maybe_applied is True
    machine.decisions()
    machine.timer_fired("ws", "tree", wait.token)  # the retry timer set before is stale
    assert of_type(machine.decisions(), Send) == []


def test_only_the_named_workspace_and_sub_doc_are_discarded() -> None:
    machine = make_machine()
    machine.submit("ws", "a", [inc()])
    machine.submit("ws", "b", [inc()])
    machine.submit("other", "a", [inc()])
    sends = of_type(persist_all(machine), Send)
    for send in sends:
        machine.batch_failed(send.batch_id, AuthError("unauthorized", "expired"))
    machine.decisions()

    assert machine.discard("ws", "a")[0] == 1
    assert machine.pending_count == 2
    assert machine.discard("nobody")[0] == 0
    assert of_type(machine.decisions(), Discard) == [Discard((sends[0].rows[0].seq,), ())]
    machine.retry_parked()
    resent = of_type(machine.decisions(), Send)
    assert {(s.workspace_id, s.sub_doc) for s in resent} == {("ws", "b"), ("other", "a")}


def test_a_backlog_still_on_disk_is_discarded_by_range_and_a_late_page_ignored() -> None:
    rows = [
        OutboxRow(seq, "ws", "tree", f"old{seq}", json.dumps({**inc(), "op_id": f"old{seq}"}), 1.0)
        for seq in range(1, 11)
    ]
    machine = make_machine(restore_page=4, max_batch_ops=4)
    machine.restore(rows[:4], [LaneBacklog("ws", "tree", 10, 10)])
    decisions = machine.decisions()
    (send,) = of_type(decisions, Send)
    assert len(of_type(decisions, Load)) == 1  # the next page is being read
    assert machine.pending_count == 10

    count, resolve = machine.discard("ws")
    assert count == 6  # the four loaded ones are in flight
    assert resolve is None  # restored ops have no awaiter in this process
    (discard,) = of_type(machine.decisions(), Discard)
    assert discard.seqs == ()
    assert [(r.after_seq, r.up_to_seq) for r in discard.backlog] == [(4, 10)]
    machine.loaded("ws", "tree", rows[4:8])  # the page that was being read comes back: ignored
    assert machine.pending_count == 4
    machine.batch_answered(send.batch_id, commit_results(send, 1))
    assert of_type(machine.decisions(), Send) == []
    assert machine.pending_count == 0
    assert machine.oldest_pending_seq() is None


def test_a_lane_discarded_takes_new_ops_as_usual() -> None:
    machine = make_machine()
    machine.submit("ws", "tree", [inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_failed(send.batch_id, AuthError("unauthorized", "expired"))
    machine.decisions()
    machine.discard("ws")
    machine.decisions()
    (row,) = machine.submit("ws", "tree", [inc()])
    (fresh,) = of_type(persist_all(machine), Send)
    assert [r.seq for r in fresh.rows] == [row.seq]


# -- through the real server ---------------------------------------------------------------------


async def test_ops_refused_for_a_revoked_workspace_are_discarded_and_never_come_back(
    server_url: str, tmp_path: Path
) -> None:
    outbox = tmp_path / "app.outbox"
    # HTTP only: a websocket would stay refused (rightly: the token still is) after the discard.
    config = fast_config(ops_over_websocket=False)
    client = WorkspaceClient(server_url, token=token_for("other"), outbox=outbox, config=config)
    await client.start()
    try:
        ops = [NodeInsert(node_id="n", parent_id="root")] + [
            NodeIncrement(node_id="n", field="c") for _ in range(4)
        ]
        for op in ops:
            with pytest.raises(StillPendingError):
                await asyncio.wait_for(client.apply_op(WS, "tree", op), BOUND)
        assert client.sync_status.refused == frozenset({WS})

        assert await asyncio.wait_for(client.discard_pending(WS), BOUND) == 5
        assert client.pending_count() == 0
        assert client.sync_status.refused == frozenset()
        await client.wait_synced(timeout=BOUND)  # nothing left to wait for
        # A crash now, and a new client on the outbox with a token that works: nothing replays.
        client = await restart_client(client, token=token_for(WS))
        assert client.pending_count() == 0
        await client.wait_synced(timeout=BOUND)
        commit = await asyncio.wait_for(client.apply_op(WS, "tree", ops[0]), BOUND)
    finally:
        await client.close()
    assert commit.clock == 1
    assert [entry["op_id"] for entry in await server_log(server_url, "tree")] == [commit.op_id]


async def test_callers_of_discarded_ops_hear_it_and_nothing_reaches_the_server(
    server_url: str, tmp_path: Path
) -> None:
    """Ops waiting out a retry (the server unreachable) are discarded: each caller gets
    `OpDiscardedError` at once, and the network coming back sends nothing."""
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True
        config = ClientConfig(backoff=lambda failures: 3600.0, ops_over_websocket=False)
        async with WorkspaceClient(
            proxy.url, token=token_for(WS), outbox=tmp_path / "app.outbox", config=config
        ) as client:
            calls = [
                asyncio.ensure_future(
                    client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                )
                for _ in range(3)
            ]
            async with asyncio.timeout(BOUND):  # a state: the first send failed, a retry waits
                while client._machine.in_flight_count or client.pending_count() < 3:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
            assert await asyncio.wait_for(client.discard_pending(WS, "tree"), BOUND) == 3
            for call in calls:
                with pytest.raises(OpDiscardedError) as discarded:
                    await asyncio.wait_for(call, BOUND)
                assert discarded.value.op_id
            proxy.refuse = False
            assert client.pending_count() == 0
            assert await client._outbox.pending() == []  # type: ignore[union-attr]
    assert await server_log(server_url, "tree") == []


async def test_a_large_backlog_restored_from_the_outbox_is_discarded_without_loading_it(
    server_url: str, tmp_path: Path
) -> None:
    outbox = tmp_path / "app.outbox"
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True  # offline: the ops wait in the outbox
        config = fast_config(max_batch_ops=2, retry_attempts=1)
        async with WorkspaceClient(
            proxy.url, token=token_for(WS), outbox=outbox, config=config
        ) as offline:
            results = await asyncio.gather(
                *(
                    offline.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                    for _ in range(50)
                ),
                return_exceptions=True,
            )
            assert all(isinstance(result, StillPendingError) for result in results)
        async with WorkspaceClient(
            proxy.url, token=token_for(WS), outbox=outbox, config=config
        ) as restored:
            assert restored.pending_count() == 50
            # The first restored batch (2 ops) is on its way: kept, the 48 behind it go (all 50
            # if its send has failed already).
            first = await asyncio.wait_for(restored.discard_pending(WS), BOUND)
            assert first in (48, 50)
            assert restored.pending_count() == 50 - first
            async with asyncio.timeout(BOUND):  # a state: its send failed (offline), it parked
                while restored._machine.in_flight_count:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
            assert await asyncio.wait_for(restored.discard_pending(WS), BOUND) == 50 - first
            assert restored.pending_count() == 0
        proxy.refuse = False
        async with WorkspaceClient(
            proxy.url, token=token_for(WS), outbox=outbox, config=config
        ) as again:
            assert again.pending_count() == 0
    assert await server_log(server_url, "tree") == []


async def test_discard_pending_refuses_an_invalid_id_before_touching_anything(
    server_url: str,
) -> None:
    async with WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as client:
        with pytest.raises(InvalidRequestError):
            await client.discard_pending("bad id!")
        with pytest.raises(InvalidRequestError):
            await client.discard_pending(WS, "bad sub doc!")


def test_pending_counts_one_workspace_or_sub_doc_backlog_on_disk_included() -> None:
    rows = [
        OutboxRow(seq, "ws", "tree", f"old{seq}", json.dumps({**inc(), "op_id": f"old{seq}"}), 1.0)
        for seq in range(1, 11)
    ]
    machine = make_machine(restore_page=4, max_batch_ops=4)
    machine.restore(rows[:4], [LaneBacklog("ws", "tree", 10, 10)])
    machine.submit("ws", "other", [inc(), inc()])
    machine.submit("elsewhere", "tree", [inc()])
    assert machine.pending_in("ws", "tree") == 10  # six of them not even loaded
    assert machine.pending_in("ws") == 12
    assert machine.pending_in("elsewhere", "tree") == 1
    assert machine.pending_in("nobody") == 0
    assert machine.pending_count == 13
