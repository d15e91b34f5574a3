"""Compare-and-set on the op-log (`append(..., if_clock=)`, docs/ops.md#conflicts), written once
and run against every backend: mixed into `OpLogContract`, so each backend's test class runs it
with its own `store` fixture.

The clock check is decided inside the append's transaction, after dedupe: a stale `if_clock`
applies nothing and answers `version_conflict` with the head; a retry of a batch that committed
is answered from its records, never as a conflict.
"""

from __future__ import annotations

import asyncio

from cv_mutations import new_op_id
from cv_server.oplog import Committed, OpLogStore, Rejected
from tests.contract.oplog_contract import (
    DOC,
    WS,
    all_entries,
    field_value,
    in_lane,
    increment,
)


def conflict(op_id: str | None, clock: int) -> tuple[str | None, str, int | None]:
    return (op_id, "version_conflict", clock)


def shape(outcome: object) -> object:
    """A rejection as (op_id, code, clock); anything else as it is."""
    if isinstance(outcome, Rejected):
        return (outcome.op_id, outcome.code, outcome.clock)
    return outcome


class CompareAndSetContract:
    """Every `OpLogStore` decides `if_clock` in the append's transaction, after dedupe."""

    async def test_an_append_based_on_the_head_commits(self, store: OpLogStore) -> None:
        first, second = new_op_id(), new_op_id()
        outcomes, _ = await store.append(WS, DOC, [increment(first)], if_clock=0)
        assert outcomes == [Committed(first, 1)]
        outcomes, entries = await store.append(WS, DOC, [increment(second)], if_clock=1)
        assert outcomes == [Committed(second, 2)]
        assert [entry.clock for entry in entries] == [2]

    async def test_an_append_based_on_a_stale_clock_applies_nothing_and_answers_the_head(
        self, store: OpLogStore
    ) -> None:
        await store.append(WS, DOC, [increment(), increment()])
        ops = [increment(new_op_id()), increment(new_op_id(), by=5)]
        outcomes, entries = await store.append(WS, DOC, ops, if_clock=1)
        assert [shape(o) for o in outcomes] == [conflict(op.op_id, 2) for op in ops]
        assert entries == []
        assert await store.head(WS, DOC) == 2
        assert await field_value(store) == 2
        assert len(await all_entries(store)) == 2

    async def test_a_stale_atomic_batch_answers_every_op_with_the_conflict(
        self, store: OpLogStore
    ) -> None:
        await store.append(WS, DOC, [increment()])
        ops = [increment(new_op_id()) for _ in range(3)]
        outcomes, entries = await store.append(WS, DOC, ops, atomic=True, if_clock=0)
        assert [shape(o) for o in outcomes] == [conflict(op.op_id, 1) for op in ops]
        assert entries == []
        assert await field_value(store) == 1

    async def test_a_retry_of_a_conditional_batch_that_committed_is_a_duplicate_not_a_conflict(
        self, store: OpLogStore
    ) -> None:
        ops = [increment(new_op_id()), increment(new_op_id())]
        first, _ = await store.append(WS, DOC, ops, if_clock=0)
        assert first == [Committed(ops[0].op_id, 1), Committed(ops[1].op_id, 2)]
        # The head moved past the batch's base: a retry is still answered from the records.
        retried, entries = await store.append(WS, DOC, ops, if_clock=0)
        assert retried == [Committed(ops[0].op_id, 1, True), Committed(ops[1].op_id, 2, True)]
        assert entries == []
        assert await field_value(store) == 2

    async def test_a_conflict_is_recorded_and_answered_again_with_the_head_it_meets(
        self, store: OpLogStore
    ) -> None:
        await store.append(WS, DOC, [increment()])
        op = increment(new_op_id())
        (first,), _ = await store.append(WS, DOC, [op], if_clock=0)
        assert shape(first) == conflict(op.op_id, 1)
        await store.append(WS, DOC, [increment()])
        # A retry of the same op_id, even based on the head now, gets its decision again: a
        # new attempt is a new op (docs/ops.md#conflicts).
        (again,), _ = await store.append(WS, DOC, [op], if_clock=2)
        assert isinstance(again, Rejected)
        assert again.duplicate
        assert shape(again) == conflict(op.op_id, 2)
        assert await field_value(store) == 2

    async def test_ops_decided_before_keep_their_answers_in_a_conflicting_batch(
        self, store: OpLogStore
    ) -> None:
        done = increment(new_op_id())
        await store.append(WS, DOC, [done])
        await store.append(WS, DOC, [increment()])
        fresh = increment(new_op_id())
        outcomes, entries = await store.append(WS, DOC, [done, fresh], if_clock=1)
        assert outcomes[0] == Committed(done.op_id, 1, True)
        assert shape(outcomes[1]) == conflict(fresh.op_id, 2)
        assert entries == []

    async def test_if_clock_zero_creates_a_sub_doc_once(self, store: OpLogStore) -> None:
        first, second = increment(new_op_id()), increment(new_op_id())
        (won,), _ = await store.append(WS, DOC, [first], if_clock=0)
        (lost,), _ = await store.append(WS, DOC, [second], if_clock=0)
        assert won == Committed(first.op_id, 1)
        assert shape(lost) == conflict(second.op_id, 1)

    async def test_of_concurrent_appends_based_on_one_clock_exactly_one_commits(
        self, store: OpLogStore
    ) -> None:
        await store.append(WS, DOC, [increment()])
        ops = [increment(new_op_id()) for _ in range(20)]
        answers = await asyncio.gather(*(store.append(WS, DOC, [op], if_clock=1) for op in ops))
        outcomes = [outcome for found, _ in answers for outcome in found]
        assert sum(type(o) is Committed for o in outcomes) == 1
        assert sum(shape(o) == conflict(o.op_id, 2) for o in outcomes) == 19
        assert await field_value(store) == 2

    async def test_a_conflict_decides_its_lane_ops_so_the_lane_moves_on(
        self, store: OpLogStore
    ) -> None:
        await store.append(WS, DOC, [increment()])
        lost = in_lane(increment(), "client-cas", 1)
        (outcome,), _ = await store.append(WS, DOC, [lost], if_clock=0)
        assert shape(outcome) == conflict(lost.op_id, 1)
        assert await store.client_mark(WS, DOC, "client-cas") == 1
        (after,), _ = await store.append(WS, DOC, [in_lane(increment(), "client-cas", 2)])
        assert type(after) is Committed

    async def test_an_append_without_if_clock_is_unconditional(self, store: OpLogStore) -> None:
        await store.append(WS, DOC, [increment()], if_clock=0)
        (outcome,), _ = await store.append(WS, DOC, [increment(new_op_id())])
        assert type(outcome) is Committed
        assert outcome.clock == 2
