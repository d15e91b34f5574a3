"""What only the PostgreSQL op-log has to show: several instances on one database, the row lock,
catch-up, NOTIFY on commit, group commit, and a cache that never runs ahead of the database."""

from __future__ import annotations

import asyncio

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_mutations import new_op_id
from cv_server.oplog import Committed
from cv_server.pg import Notifier
from cv_server.pg.oplog import (
    oplog_payload,
    parse_oplog_payload,
)
from cv_server.pg.oplog_sql import OPS_TABLE
from tests.contract.oplog_contract import DOC, WS, all_entries, append_one, field_value, increment
from tests.pg.conftest import Opener

pytestmark = pytest.mark.postgres

TIMEOUT = 60.0


async def test_two_instances_writing_one_sub_doc_get_gap_free_clocks_and_no_double_apply(
    open_store: Opener,
) -> None:
    first, second = await open_store(), await open_store()
    writers, ops_per_writer = 8, 40

    async def writer(index: int) -> list[tuple[str, int]]:
        mine, other = (first, second) if index % 2 else (second, first)
        sent = []
        for i in range(ops_per_writer):
            op = increment(new_op_id(), field=f"w{index}")
            outcome = await append_one(mine, op)
            assert isinstance(outcome, Committed)
            assert not outcome.duplicate
            if i % 8 == 0:  # the client's retry lands on the other instance
                again = await append_one(other, op)
                assert again == Committed(op.op_id, outcome.clock, duplicate=True)
            sent.append((str(op.op_id), outcome.clock))
        return sent

    results = await asyncio.wait_for(asyncio.gather(*(writer(i) for i in range(writers))), TIMEOUT)
    total = writers * ops_per_writer
    entries = await all_entries(first)
    assert [e.clock for e in entries] == list(range(1, total + 1))
    assert {str(e.op_id): e.clock for e in entries} == {
        op_id: clock for sent in results for op_id, clock in sent
    }
    first_state, second_state = await first.get_state(WS, DOC), await second.get_state(WS, DOC)
    assert first_state == second_state
    assert first_state[0] == total
    assert first_state[1].nodes["root"].fields == {f"w{i}": ops_per_writer for i in range(writers)}
    for sent in results:  # each writer's ops committed in the order it sent them
        assert [clock for _, clock in sent] == sorted(clock for _, clock in sent)


async def test_an_instance_catches_up_with_what_another_committed_before_applying(
    open_store: Opener,
) -> None:
    first, second = await open_store(), await open_store()
    await append_one(first, increment(by=1))
    assert await field_value(first) == 1  # cached at clock 1
    await second.append(WS, DOC, [increment(by=10), increment(by=100)])
    assert await first.get_state(WS, DOC) == await second.get_state(WS, DOC)
    assert await field_value(first) == 111
    outcome = await append_one(first, increment(by=1000))
    assert outcome == Committed(None, 4)
    assert await field_value(second) == 1111


async def test_a_writer_waits_for_the_sub_doc_row_lock_held_elsewhere(
    open_store: Opener, postgres_url: str, schema: str
) -> None:
    store = await open_store()
    await append_one(store, increment())
    holder = await asyncpg.connect(postgres_url, server_settings={"search_path": schema})
    watcher = await asyncpg.connect(postgres_url)
    try:
        transaction = holder.transaction()
        await transaction.start()
        await holder.execute(
            "SELECT clock FROM workspace_sub_doc_heads"
            " WHERE workspace_id = $1 AND sub_doc = $2 FOR UPDATE",
            WS,
            DOC,
        )
        blocked = asyncio.ensure_future(append_one(store, increment()))

        async def someone_waits_on_our_lock() -> None:
            query = (
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND $1 = ANY(pg_blocking_pids(pid))"
            )
            # The condition lives in the server's lock table: no event to wait on, so poll it
            # (bounded by the wait_for below).
            while not await watcher.fetchval(query, holder.get_server_pid()):  # noqa: ASYNC110
                await asyncio.sleep(0.01)

        await asyncio.wait_for(someone_waits_on_our_lock(), TIMEOUT)
        assert not blocked.done()
        await transaction.rollback()
        assert await asyncio.wait_for(blocked, TIMEOUT) == Committed(None, 2)
    finally:
        await holder.close()
        await watcher.close()


async def test_a_commit_is_announced_with_its_clock_and_a_rejection_is_not(
    open_store: Opener, postgres_url: str
) -> None:
    store = await open_store()
    received: list[str] = []
    arrived = asyncio.Event()

    def on_payload(payload: str) -> None:
        received.append(payload)
        arrived.set()

    notifier = Notifier(postgres_url)
    await notifier.start()
    try:
        await notifier.listen(store.channel, on_payload)
        await store.append(WS, DOC, [increment(), increment()])
        await asyncio.wait_for(arrived.wait(), TIMEOUT)
        assert received == [oplog_payload(WS, DOC, 2)]
        arrived.clear()
        rejected = await append_one(store, increment(new_op_id(), node="missing"))
        assert not isinstance(rejected, Committed)
        await append_one(store, increment(), doc="other")
        await asyncio.wait_for(arrived.wait(), TIMEOUT)
        assert received == [oplog_payload(WS, DOC, 2), oplog_payload(WS, "other", 1)]
        assert parse_oplog_payload(received[-1]) == (WS, "other", 1)
    finally:
        await notifier.close()


def test_the_largest_commit_payload_stays_far_under_the_notify_limit() -> None:
    payload = oplog_payload("W" * 64, "d" * 64, 2**63 - 1)
    assert len(payload.encode()) < 200
    assert parse_oplog_payload(payload) == ("W" * 64, "d" * 64, 2**63 - 1)


async def test_concurrent_appends_to_one_sub_doc_share_transactions(open_store: Opener) -> None:
    store = await open_store()
    results = await asyncio.wait_for(
        asyncio.gather(*(store.append(WS, DOC, [increment(new_op_id())]) for _ in range(200))),
        TIMEOUT,
    )
    clocks = sorted(
        o.clock for outcomes, _ in results for o in outcomes if isinstance(o, Committed)
    )
    assert clocks == list(range(1, 201))
    assert store.appends_committed == 200
    assert store.groups_committed < 200


async def test_a_failed_transaction_leaves_cache_and_database_unchanged(
    open_store: Opener, pool: asyncpg.Pool
) -> None:
    store = await open_store(snapshot_every=2)
    await append_one(store, increment(new_op_id()))
    poison = new_op_id()
    async with pool.acquire() as conn:
        await conn.execute(
            f"""
            CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.op_id = '{poison}' THEN RAISE EXCEPTION 'refused'; END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER refuse_poison BEFORE INSERT ON {OPS_TABLE}
                FOR EACH ROW EXECUTE FUNCTION refuse_poison();
            """
        )
    retried = new_op_id()
    with pytest.raises(asyncpg.RaiseError, match="refused"):
        await store.append(WS, DOC, [increment(retried), increment(poison), increment()])
    assert (await store.get_state(WS, DOC))[0] == 1
    assert await field_value(store) == 1
    assert await store.head(WS, DOC) == 1
    outcomes, _ = await store.append(WS, DOC, [increment(retried), increment()])
    assert outcomes == [Committed(retried, 2), Committed(None, 3)]
    assert [e.clock for e in await all_entries(store)] == [1, 2, 3]
    assert await field_value(store) == 3
