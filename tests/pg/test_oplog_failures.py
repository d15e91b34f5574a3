"""How the PostgreSQL op-log behaves when things fail: a statement failing mid-batch, a lost
connection while committing, a drainer that dies, a store closed while busy, a snapshot that does
not match the log. The promise in each: the cache equals a replay of the durable log, an op is
committed once, a failed batch leaves nothing behind, nothing hangs."""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_mutations import new_op_id
from cv_server.oplog import Committed
from cv_server.pg.oplog import OpLogCorrupted, PostgresOpLogStore
from cv_server.pg.oplog_sql import HEADS_TABLE, OPS_TABLE, SNAPSHOTS_TABLE
from cv_server.pg.retry import SerializationRetryPolicy
from tests.contract.oplog_contract import DOC, WS, all_entries, append_one, field_value, increment
from tests.pg.conftest import Opener

pytestmark = pytest.mark.postgres

#: Bound on anything that must not hang.
BOUND = 10.0


class RecordingSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


async def replayed_value(store: PostgresOpLogStore) -> int:
    """The value of `root.n` that a replay of the durable log gives (increments by 1 only)."""
    return len(await all_entries(store))


async def backends_blocked_by(conn: asyncpg.Connection) -> list[int]:
    """The backends waiting on a lock `conn`'s backend holds (exactly ours, never a neighbour's)."""
    holder = conn.get_server_pid()
    rows = await conn.fetch(
        "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", holder
    )
    return [int(row["pid"]) for row in rows]


async def wait_for_blocked(conn: asyncpg.Connection) -> list[int]:
    async with asyncio.timeout(BOUND):
        while True:
            # Polling the database for a condition it alone knows (no event to wait on).
            if pids := await backends_blocked_by(conn):
                return pids
            await asyncio.sleep(0.01)


# -- a statement failing mid-batch, and the retry policy as the store applies it -------------------


async def install_failing_trigger(
    pool: asyncpg.Pool, op_id: str, sqlstate: str, failures: int
) -> None:
    """The insert of `op_id` fails with `sqlstate` its first `failures` times. Every attempt is
    counted in a sequence, which a rollback does not undo."""
    async with pool.acquire() as conn:
        await conn.execute(
            f"""
            CREATE SEQUENCE attempts;
            CREATE FUNCTION fail_op() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.op_id = '{op_id}' THEN
                    IF nextval('attempts') <= {failures} THEN
                        RAISE EXCEPTION 'injected' USING ERRCODE = '{sqlstate}';
                    END IF;
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER fail_op BEFORE INSERT ON {OPS_TABLE}
                FOR EACH ROW EXECUTE FUNCTION fail_op();
            """
        )


async def attempts(pool: asyncpg.Pool) -> int:
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT last_value, is_called FROM attempts")
    return int(row["last_value"]) if row["is_called"] else 0


@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
async def test_a_batch_failing_twice_with_a_retryable_code_commits_once_on_the_third_run(
    open_store: Opener, pool: asyncpg.Pool, sqlstate: str
) -> None:
    sleep = RecordingSleep()
    store = await open_store(snapshot_every=2)
    store._sleep = sleep  # the store's injectable sleep: no real backoff in tests
    await append_one(store, increment(new_op_id()))
    flaky = new_op_id()
    await install_failing_trigger(pool, flaky, sqlstate, failures=2)
    outcomes, _ = await store.append(WS, DOC, [increment(), increment(flaky), increment()])
    assert outcomes == [Committed(None, 2), Committed(flaky, 3), Committed(None, 4)]
    assert await attempts(pool) == 3
    # 25 ms then 50 ms, each times random(0.5, 1.5).
    assert len(sleep.delays) == 2
    assert 0.0125 <= sleep.delays[0] <= 0.0375
    assert 0.025 <= sleep.delays[1] <= 0.075
    assert await field_value(store) == await replayed_value(store) == 4
    assert await append_one(store, increment()) == Committed(None, 5)


async def test_a_batch_that_keeps_deadlocking_gives_up_with_the_retryable_error_and_reverts(
    open_store: Opener, pool: asyncpg.Pool
) -> None:
    sleep = RecordingSleep()
    store = await open_store(snapshot_every=2)
    store._sleep = sleep
    await append_one(store, increment(new_op_id()))
    doomed = new_op_id()
    await install_failing_trigger(pool, doomed, "40P01", failures=1_000)
    with pytest.raises(asyncpg.DeadlockDetectedError):
        await store.append(WS, DOC, [increment(), increment(doomed)])
    runs = SerializationRetryPolicy().max_runs
    assert await attempts(pool) == runs
    assert len(sleep.delays) == runs - 1
    # Nothing half-applied: neither the cache nor the log holds the first op of the batch.
    assert (await store.get_state(WS, DOC))[0] == 1
    assert await field_value(store) == await replayed_value(store) == 1
    assert await store.head(WS, DOC) == 1
    assert await append_one(store, increment()) == Committed(None, 2)
    assert await field_value(store) == await replayed_value(store) == 2


@pytest.mark.parametrize("sqlstate", ["23505", "57014", "P0001", "40003"])
async def test_a_batch_failing_with_any_other_code_is_run_once_and_reverted(
    open_store: Opener, pool: asyncpg.Pool, sqlstate: str
) -> None:
    sleep = RecordingSleep()
    store = await open_store(snapshot_every=2)
    store._sleep = sleep
    await append_one(store, increment(new_op_id()))
    doomed = new_op_id()
    await install_failing_trigger(pool, doomed, sqlstate, failures=1)
    with pytest.raises(asyncpg.PostgresError) as raised:
        await store.append(WS, DOC, [increment(), increment(doomed)])
    assert raised.value.sqlstate == sqlstate
    assert await attempts(pool) == 1
    assert sleep.delays == []
    assert await field_value(store) == await replayed_value(store) == 1
    # The same op_id, sent again, is now applied once with the next clock.
    outcomes, _ = await store.append(WS, DOC, [increment(), increment(doomed)])
    assert outcomes == [Committed(None, 2), Committed(doomed, 3)]
    assert await field_value(store) == await replayed_value(store) == 3


# -- a connection lost while committing -----------------------------------------------------------


async def test_a_connection_killed_before_commit_answers_with_an_error_and_the_retry_applies_once(
    open_store: Opener, pool: asyncpg.Pool
) -> None:
    store = await open_store(snapshot_every=2)
    await append_one(store, increment(new_op_id()))
    lost = new_op_id()
    # A trigger waiting on an advisory lock the test holds stops the batch's backend after its
    # INSERT and before its COMMIT is durable; the test then kills exactly that backend.
    async with pool.acquire() as conn:
        await conn.execute(
            f"""
            CREATE FUNCTION hold_commit() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.op_id = '{lost}' THEN PERFORM pg_advisory_xact_lock(4242); END IF;
                RETURN NULL;
            END $$;
            CREATE CONSTRAINT TRIGGER hold_commit AFTER INSERT ON {OPS_TABLE}
                DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION hold_commit();
            """
        )
    holder = await pool.acquire()
    try:
        async with holder.transaction():
            await holder.execute("SELECT pg_advisory_xact_lock(4242)")
            appending = asyncio.create_task(store.append(WS, DOC, [increment(), increment(lost)]))
            # The batch's own backend: the only one waiting on lock 4242, which only the trigger
            # for `lost` takes. (Not identified by pg_stat_activity.query: inside this
            # transaction that view is a snapshot taken at its first read, possibly of an
            # earlier statement of the batch.)
            [victim] = await wait_for_blocked(holder)
            assert await holder.fetchval("SELECT pg_terminate_backend($1)", victim)
            with pytest.raises(Exception) as raised:  # noqa: PT011 - whichever the driver says
                await asyncio.wait_for(appending, BOUND)
            assert not isinstance(raised.value, OpLogCorrupted)
    finally:
        await pool.release(holder)
    assert await field_value(store) == await replayed_value(store) == 1
    outcomes, _ = await store.append(WS, DOC, [increment(lost)])
    assert outcomes == [Committed(lost, 2)]
    again, _ = await store.append(WS, DOC, [increment(lost)])
    assert again == [Committed(lost, 2, duplicate=True)]
    assert await field_value(store) == await replayed_value(store) == 2


# -- the drainer dying ----------------------------------------------------------------------------


async def test_a_cancelled_drainer_fails_its_appends_instead_of_leaving_them_hanging(
    open_store: Opener, pool: asyncpg.Pool
) -> None:
    store = await open_store(snapshot_every=2)
    await append_one(store, increment(new_op_id()))
    holder = await pool.acquire()
    try:
        async with holder.transaction():
            await holder.execute(
                f"SELECT 1 FROM {HEADS_TABLE} WHERE workspace_id = $1 AND sub_doc = $2 FOR UPDATE",
                WS,
                DOC,
            )
            in_flight = asyncio.create_task(store.append(WS, DOC, [increment()]))
            await wait_for_blocked(holder)
            queued = asyncio.create_task(store.append(WS, DOC, [increment()]))
            await asyncio.sleep(0)  # let `queued` reach the lane
            drainer = store._lanes[(WS, DOC)].drainer
            assert drainer is not None
            drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drainer
        done, _ = await asyncio.wait([in_flight, queued], timeout=BOUND)
        assert done == {in_flight, queued}, "an append hangs after its drainer died"
    finally:
        await pool.release(holder)
    for task in (in_flight, queued):  # both answered with an ordinary error, none cancelled
        with pytest.raises(Exception) as raised:  # noqa: PT011
            task.result()
        assert not isinstance(raised.value, asyncio.CancelledError)
    # The lane still works, and the cache still equals the log.
    committed = await append_one(store, increment())
    assert isinstance(committed, Committed)
    assert committed.clock == await store.head(WS, DOC)
    assert await field_value(store) == await replayed_value(store) == committed.clock


# -- close with busy lanes ------------------------------------------------------------------------


async def test_close_finishes_every_append_queued_on_every_lane_before_returning(
    open_store: Opener,
) -> None:
    store = await open_store(snapshot_every=3)
    docs = [f"doc{i}" for i in range(3)]
    appends = [
        asyncio.create_task(store.append(WS, doc, [increment()])) for doc in docs for _ in range(10)
    ]
    await asyncio.sleep(0)  # every append is queued on its lane
    await asyncio.wait_for(store.close(), BOUND)
    assert all(task.done() for task in appends)
    assert all(isinstance(task.result()[0][0], Committed) for task in appends)
    fresh = await open_store(snapshot_every=3)
    for doc in docs:
        assert await fresh.head(WS, doc) == 10
        assert await field_value(fresh, doc=doc) == 10


# -- reads concurrent with writes -----------------------------------------------------------------


async def test_get_state_during_appends_on_another_instance_is_never_ahead_of_the_log(
    open_store: Opener,
) -> None:
    writer = await open_store(snapshot_every=4)
    reader = await open_store(snapshot_every=4)
    await append_one(writer, increment())

    async def write() -> None:
        for _ in range(30):
            await writer.append(WS, DOC, [increment(), increment()])

    writing = asyncio.create_task(write())
    seen: list[int] = []
    while not writing.done():
        clock, state = await reader.get_state(WS, DOC)
        durable = await reader.head(WS, DOC)
        assert clock <= durable
        assert state.nodes["root"].fields["n"] == clock
        seen.append(clock)
    await writing
    assert seen == sorted(seen)
    assert await reader.get_state(WS, DOC) == (61, (await writer.get_state(WS, DOC))[1])


# -- a snapshot that does not match the log -------------------------------------------------------


async def rewind_log_under_snapshot(pool: asyncpg.Pool, to: int) -> None:
    """The log and the head go back to clock `to` but the snapshot stays ahead (e.g. a restore
    of the ops table alone)."""
    async with pool.acquire() as conn:
        await conn.execute(f"DELETE FROM {OPS_TABLE} WHERE clock > $1", to)
        await conn.execute(f"UPDATE {HEADS_TABLE} SET clock = $1", to)


async def test_a_snapshot_ahead_of_the_log_is_reported_as_corruption_by_get_state(
    open_store: Opener, pool: asyncpg.Pool
) -> None:
    writer = await open_store(snapshot_every=2)
    await writer.append(WS, DOC, [increment() for _ in range(4)])
    await rewind_log_under_snapshot(pool, to=2)
    async with pool.acquire() as conn:
        assert await conn.fetchval(f"SELECT clock FROM {SNAPSHOTS_TABLE}") == 4
    fresh = await open_store(snapshot_every=2)
    assert await fresh.head(WS, DOC) == 2
    with pytest.raises(OpLogCorrupted):
        await fresh.get_state(WS, DOC)
    with pytest.raises(OpLogCorrupted):
        await fresh.append(WS, DOC, [increment()])


async def test_a_cache_ahead_of_a_rewound_log_is_rebuilt_by_get_state_not_served(
    open_store: Opener, pool: asyncpg.Pool
) -> None:
    store = await open_store(snapshot_every=100)
    await store.append(WS, DOC, [increment() for _ in range(4)])
    assert await field_value(store) == 4  # cached at clock 4
    await rewind_log_under_snapshot(pool, to=2)
    clock, state = await store.get_state(WS, DOC)
    assert (clock, state.nodes["root"].fields["n"]) == (2, 2)
