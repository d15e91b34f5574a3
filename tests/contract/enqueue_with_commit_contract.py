"""Enqueue with the commit (`OpLogStore.append_enqueuing`, docs/queue.md, "Start work with the
change that needs it"), written once and run against every backend: each backend's test class
gives `linked`, an op-log store bound to the queue store of the same database.

The ops and the requests commit in one transaction or not at all; requests are enqueued only by
a batch that newly applied an op (a retry enqueues nothing new), each naming the clock of the
batch's last applied op; the queue announces them only after that commit.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import pytest

from cv_mutations import new_op_id
from cv_server.oplog import Committed, IncomingOp, OpLogStore, Rejected
from cv_server.queue import QueueStore
from cv_server.queue.errors import RequestIdConflict
from cv_server.queue.model import (
    EnqueueAsk,
    NewRequest,
    RequestEvent,
    deterministic_request_id,
    random_request_id,
)
from tests.contract.oplog_contract import DOC, WS, all_entries, field_value, incoming, increment

STAGE = "evaluate"


class Linked(NamedTuple):
    oplog: OpLogStore
    queue: QueueStore


def ask(n: int = 1, *, ws: str = WS, job_id: str | None = None) -> EnqueueAsk:
    request_id = (
        deterministic_request_id(ws, job_id, "main", STAGE)
        if job_id is not None
        else random_request_id(f"{n:040x}")
    )
    return EnqueueAsk(
        NewRequest(
            workspace_id=ws,
            stage=STAGE,
            request_id=request_id,
            input={"n": n},
            job_id=job_id,
            branch_path="main" if job_id is not None else None,
        )
    )


def bad_op(op_id: str) -> IncomingOp:
    """An op the reducer rejects (its node does not exist)."""
    return incoming({"type": "node.delete", "node_id": "missing", "op_id": op_id})


async def requests_of(queue: QueueStore, ws: str = WS) -> list[str]:
    return [row.request_id for row in await queue.list(workspace_id=ws, limit=100)]


class EnqueueWithCommitContract:
    """Every op-log store bound to its queue commits an apply's enqueues with its ops."""

    async def test_the_ops_and_the_requests_commit_together_naming_the_last_clock(
        self, linked: Linked
    ) -> None:
        await linked.oplog.append(WS, DOC, [increment()])
        first, second = new_op_id(), new_op_id()
        done = await linked.oplog.append_enqueuing(
            WS, DOC, [increment(first), increment(second)], [ask(1), ask(2)]
        )
        assert done.outcomes == [Committed(first, 2), Committed(second, 3)]
        assert [entry.clock for entry in done.entries] == [2, 3]
        assert done.enqueued is not None
        assert [(e.row.request_id, e.coalesced) for e in done.enqueued] == [
            (ask(1).request.request_id, False),
            (ask(2).request.request_id, False),
        ]
        for n in (1, 2):
            row = await linked.queue.get(WS, ask(n).request.request_id)
            assert row is not None
            assert (row.status, row.caused_by_clock, row.input) == ("pending", 3, {"n": n})
        assert await field_value(linked.oplog) == 3

    async def test_a_retry_of_a_batch_that_committed_enqueues_nothing_new(
        self, linked: Linked
    ) -> None:
        op_id = new_op_id()
        await linked.oplog.append_enqueuing(WS, DOC, [increment(op_id)], [ask(1)])
        again = await linked.oplog.append_enqueuing(WS, DOC, [increment(op_id)], [ask(7)])
        assert again.outcomes == [Committed(op_id, 1, duplicate=True)]
        assert (again.entries, again.enqueued) == ([], None)
        assert await requests_of(linked.queue) == [ask(1).request.request_id]
        assert await field_value(linked.oplog) == 1

    async def test_a_stale_if_clock_leaves_neither_ops_nor_requests(self, linked: Linked) -> None:
        await linked.oplog.append(WS, DOC, [increment(), increment()])
        done = await linked.oplog.append_enqueuing(
            WS, DOC, [increment(new_op_id())], [ask(1)], if_clock=1
        )
        assert [o.code for o in done.outcomes if isinstance(o, Rejected)] == ["version_conflict"]
        assert (done.entries, done.enqueued) == ([], None)
        assert await requests_of(linked.queue) == []
        assert len(await all_entries(linked.oplog)) == 2

    async def test_a_rejected_atomic_batch_leaves_neither_ops_nor_requests(
        self, linked: Linked
    ) -> None:
        ops = [increment(new_op_id()), bad_op(new_op_id())]
        done = await linked.oplog.append_enqueuing(WS, DOC, ops, [ask(1)], atomic=True)
        assert [type(o) for o in done.outcomes] == [Rejected, Rejected]
        assert (done.entries, done.enqueued) == ([], None)
        assert await requests_of(linked.queue) == []
        assert await linked.oplog.head(WS, DOC) == 0

    async def test_a_batch_partly_rejected_enqueues_naming_its_last_applied_op(
        self, linked: Linked
    ) -> None:
        applied = new_op_id()
        done = await linked.oplog.append_enqueuing(
            WS,
            DOC,
            [increment(applied), bad_op(new_op_id())],
            [ask(1)],
        )
        assert done.outcomes[0] == Committed(applied, 1)
        assert done.enqueued is not None
        row = await linked.queue.get(WS, ask(1).request.request_id)
        assert row is not None
        assert row.caused_by_clock == 1

    async def test_a_refused_item_leaves_neither_ops_nor_requests(self, linked: Linked) -> None:
        # The id already names a request of another workspace: the queue refuses the item
        # after the ops were written in the same transaction, which then commits nothing.
        theirs = EnqueueAsk(
            NewRequest(workspace_id="ws-2", stage=STAGE, request_id=ask(9).request.request_id)
        )
        await linked.queue.enqueue_many([theirs], now=None)
        with pytest.raises(RequestIdConflict):
            await linked.oplog.append_enqueuing(WS, DOC, [increment(new_op_id())], [ask(1), ask(9)])
        assert await requests_of(linked.queue) == []
        assert await linked.oplog.head(WS, DOC) == 0
        # The store's cached state was rolled back with the rest: the next op takes clock 1.
        op_id = new_op_id()
        outcomes, _ = await linked.oplog.append(WS, DOC, [increment(op_id)])
        assert outcomes == [Committed(op_id, 1)]
        assert await field_value(linked.oplog) == 1

    async def test_an_item_coalesces_into_the_live_request_it_names(self, linked: Linked) -> None:
        await linked.oplog.append_enqueuing(WS, DOC, [increment(new_op_id())], [ask(job_id="j")])
        done = await linked.oplog.append_enqueuing(
            WS, DOC, [increment(new_op_id())], [ask(2, job_id="j")]
        )
        assert done.enqueued is not None
        (answer,) = done.enqueued
        assert answer.coalesced
        # The live request keeps the clock of the commit that made it: the stage reads the
        # sub-doc at that clock or later.
        assert answer.row.caused_by_clock == 1
        assert await requests_of(linked.queue) == [ask(job_id="j").request.request_id]

    async def test_the_queue_announces_the_requests_only_once_committed(
        self, linked: Linked
    ) -> None:
        seen: list[RequestEvent] = []
        read: list[asyncio.Task[object]] = []

        def heard(event: RequestEvent) -> None:
            # A listener that re-reads the row finds it: the announcement follows the commit.
            read.append(asyncio.ensure_future(linked.queue.get(WS, event.request_id)))
            seen.append(event)

        linked.queue.add_listener(heard)
        await linked.oplog.append_enqueuing(WS, DOC, [increment(new_op_id())], [ask(1)])
        assert [(e.request_id, e.status) for e in seen] == [(ask(1).request.request_id, "pending")]
        assert all(row is not None for row in await asyncio.gather(*read))
        # A batch that applies nothing announces nothing.
        await linked.oplog.append_enqueuing(WS, DOC, [bad_op(new_op_id())], [ask(2)])
        assert len(seen) == 1

    async def test_a_refused_item_fails_only_its_own_apply_not_those_committed_with_it(
        self, linked: Linked
    ) -> None:
        theirs = EnqueueAsk(
            NewRequest(workspace_id="ws-2", stage=STAGE, request_id=ask(9).request.request_id)
        )
        await linked.queue.enqueue_many([theirs], now=None)
        # Queued at once on one sub-doc (and another): the backends may group them into one
        # transaction, which the refused item must not take down with it.
        before, after, elsewhere = new_op_id(), new_op_id(), new_op_id()
        results = await asyncio.gather(
            linked.oplog.append(WS, DOC, [increment(before)]),
            linked.oplog.append_enqueuing(WS, DOC, [increment(new_op_id())], [ask(9)]),
            linked.oplog.append_enqueuing(WS, DOC, [increment(after)], [ask(1)]),
            linked.oplog.append(WS, "other", [increment(elsewhere)]),
            return_exceptions=True,
        )
        assert isinstance(results[1], RequestIdConflict)
        assert [e.op_id for e in await all_entries(linked.oplog)] == [before, after]
        assert [e.op_id for e in await all_entries(linked.oplog, WS, "other")] == [elsewhere]
        assert await requests_of(linked.queue) == [ask(1).request.request_id]
        row = await linked.queue.get(WS, ask(1).request.request_id)
        assert row is not None
        assert row.caused_by_clock == 2
