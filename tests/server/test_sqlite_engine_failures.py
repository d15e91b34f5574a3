"""The embedded SQLite engine and the op-log on it, under failures the contract suite does not
reach: jobs raising odd exceptions, a transaction lost mid-group, a COMMIT that fails after the
LRU cache churned, snapshots rolled back, a snapshot ahead of its log, readers during a group.

The ground truth after every step is a second store opened on the same file: the cached state
must always equal a replay of the durable log.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from cv_mutations import new_op_id
from cv_server.oplog import Committed
from cv_server.sqlite.engine import SQLiteDatabase, Transaction
from cv_server.sqlite.oplog import (
    OPS_TABLE,
    SNAPSHOTS_TABLE,
    OpLogCorrupted,
    SQLiteOpLogStore,
    create_schema,
)
from tests.contract.oplog_contract import WS, increment

T = TypeVar("T")

#: Bound on every wait for the writer thread: a hang fails the test instead of stalling it.
WAIT_SECONDS = 10.0


async def wait(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, WAIT_SECONDS)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "engine.db"


@pytest.fixture
async def db(path: Path) -> AsyncIterator[SQLiteDatabase]:
    db = await SQLiteDatabase.open(path, schema=create_schema)
    yield db
    await wait(db.close())


@contextlib.asynccontextmanager
async def writer_paused(db: SQLiteDatabase) -> AsyncIterator[None]:
    """Keep the writer busy for the block; the jobs queued in it then form the next group."""
    started, release = threading.Event(), threading.Event()

    def hold(tx: Transaction) -> None:
        started.set()
        release.wait(WAIT_SECONDS)

    held = asyncio.ensure_future(db.write(hold))
    try:
        assert await wait(asyncio.to_thread(started.wait, WAIT_SECONDS))
        yield
        # Tasks created in the block run their first step (up to the queue put) before this.
        queued = asyncio.Event()
        asyncio.get_running_loop().call_soon(queued.set)
        await wait(queued.wait())
    finally:
        release.set()
        await wait(held)


async def settled(*futures: asyncio.Future[Any]) -> None:
    """Wait until every future is done, without raising what they hold."""
    _, pending = await asyncio.wait(futures, timeout=WAIT_SECONDS)
    assert not pending, f"{len(pending)} job(s) never resolved"


async def disk_truth(path: Path, doc: str) -> tuple[int, dict[str, Any], int]:
    """(clock, state, head) as a store freshly opened on `path` rebuilds them from the log."""
    store = SQLiteOpLogStore(await SQLiteDatabase.open(path, schema=create_schema), owns_db=True)
    try:
        clock, state = await wait(store.get_state(WS, doc))
        return clock, state.to_json(), await wait(store.head(WS, doc))
    finally:
        await wait(store.close())


async def assert_cache_matches_disk(store: SQLiteOpLogStore, path: Path, *docs: str) -> None:
    for doc in docs:
        clock, state = await wait(store.get_state(WS, doc))
        assert (clock, state.to_json(), await wait(store.head(WS, doc))) == await disk_truth(
            path, doc
        )


def counter(n: int) -> dict[str, Any]:
    return {"nodes": {"root": {"parent": None, "children": [], "fields": {"n": n}}}}


async def add_deferred_check(db: SQLiteDatabase) -> None:
    """A table whose foreign key is checked at COMMIT: one row in it fails the whole group."""

    def create(tx: Transaction) -> None:
        tx.execute("CREATE TABLE parent_rows (id INTEGER PRIMARY KEY)")
        tx.execute(
            "CREATE TABLE child_rows (parent INTEGER"
            " REFERENCES parent_rows(id) DEFERRABLE INITIALLY DEFERRED)"
        )

    await db.write(create)


def fail_the_commit(tx: Transaction) -> None:
    tx.execute("INSERT INTO child_rows VALUES (42)")


async def read_snapshot_clock(db: SQLiteDatabase, doc: str) -> int | None:
    def read(conn: sqlite3.Connection) -> int | None:
        row = conn.execute(
            f"SELECT clock FROM {SNAPSHOTS_TABLE} WHERE workspace_id = ? AND sub_doc = ?",
            (WS, doc),
        ).fetchone()
        return None if row is None else int(row[0])

    return await db.read(read)


def insert_marker(value: int) -> Any:
    def job(tx: Transaction) -> int:
        tx.execute("INSERT INTO markers VALUES (?)", (value,))
        return value

    return job


async def markers(db: SQLiteDatabase) -> list[int]:
    def read(conn: sqlite3.Connection) -> list[int]:
        return [row[0] for row in conn.execute("SELECT value FROM markers ORDER BY value")]

    return await db.read(read)


async def create_markers(db: SQLiteDatabase) -> None:
    await db.write(lambda tx: tx.execute("CREATE TABLE markers (value INTEGER)"))


# -- jobs raising what is not an Exception --------------------------------------------------------


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, GeneratorExit])
async def test_a_job_raising_a_base_exception_fails_alone_and_the_writer_lives_on(
    db: SQLiteDatabase, error: type[BaseException]
) -> None:
    await create_markers(db)

    def explode(tx: Transaction) -> None:
        tx.execute("INSERT INTO markers VALUES (99)")
        raise error

    async with writer_paused(db):
        before = db.submit(insert_marker(1))
        failing = db.submit(explode)
        after = db.submit(insert_marker(2))
    await settled(before, failing, after)
    assert isinstance(failing.exception(), error)
    assert (before.result(), after.result()) == (1, 2)
    # Its savepoint was rolled back and released: the group committed without its row.
    assert await markers(db) == [1, 2]
    assert await wait(db.write(insert_marker(3))) == 3


async def test_a_job_alone_in_its_group_that_raises_leaves_no_write_and_no_open_transaction(
    db: SQLiteDatabase,
) -> None:
    # A lone job runs without a savepoint: its failure rolls back the whole transaction.
    await create_markers(db)

    def explode(tx: Transaction) -> None:
        tx.execute("INSERT INTO markers VALUES (98)")
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        await wait(db.write(explode))
    assert await markers(db) == []
    assert await wait(db.write(insert_marker(4))) == 4
    assert await markers(db) == [4]


async def test_a_job_raising_stop_iteration_does_not_strand_the_rest_of_its_group(
    db: SQLiteDatabase,
) -> None:
    # `next()` on an empty cursor inside a job is an easy way to get here. asyncio refuses
    # StopIteration in `Future.set_exception` (TypeError on Python 3.11); that must not escape
    # from the one callback settling the whole group: every later job of the group is answered.
    await create_markers(db)

    def first_row(tx: Transaction) -> Any:
        return next(iter(tx.execute("SELECT value FROM markers WHERE value < 0")))

    async with writer_paused(db):
        empty = db.submit(first_row)
        after = db.submit(insert_marker(7))
    await settled(empty, after)
    assert isinstance(empty.exception(), RuntimeError)
    assert isinstance(empty.exception().__cause__, StopIteration)  # type: ignore[union-attr]
    assert after.result() == 7
    assert await markers(db) == [7]


async def test_a_job_raising_cancelled_error_fails_its_caller_instead_of_cancelling_it(
    db: SQLiteDatabase,
) -> None:
    # concurrent.futures.CancelledError is asyncio.CancelledError: a job that reads a cancelled
    # concurrent future raises it. Delivered as is, it would cancel the awaiting task, which was
    # never cancelled; its caller would take a failed write for its own cancellation.
    def cancelled(tx: Transaction) -> None:
        raise asyncio.CancelledError

    caller = asyncio.ensure_future(db.write(cancelled))
    await settled(caller)
    assert not caller.cancelled()
    assert isinstance(caller.exception(), RuntimeError)
    assert isinstance(caller.exception().__cause__, asyncio.CancelledError)  # type: ignore[union-attr]


# -- a job that loses the whole group transaction -------------------------------------------------


async def test_a_trigger_rolling_back_the_whole_transaction_fails_only_its_own_append(
    db: SQLiteDatabase, path: Path
) -> None:
    # RAISE(ROLLBACK) (like SQLITE_FULL or an I/O error) ends the whole transaction, not just the
    # statement: the job's savepoint is gone with the earlier jobs' writes. The writer must not die
    # on `ROLLBACK TO job` ("no such savepoint"): every future of the group, and every later
    # write, is resolved.
    store = SQLiteOpLogStore(db, snapshot_every=2)
    await wait(store.append(WS, "a", [increment()]))
    poison = new_op_id()
    await db.write(
        lambda tx: tx.execute(
            f"CREATE TRIGGER lose_everything BEFORE INSERT ON {OPS_TABLE}"
            f" WHEN NEW.op_id = '{poison}' BEGIN SELECT RAISE(ROLLBACK, 'lost'); END"
        )
    )
    early, late = new_op_id(), new_op_id()
    async with writer_paused(db):
        first = store.append_nowait(WS, "a", [increment(early), increment()])
        doomed = store.append_nowait(WS, "b", [increment(), increment(poison)])
        last = store.append_nowait(WS, "a", [increment(late)])
    await settled(first, doomed, last)
    assert isinstance(doomed.exception(), sqlite3.IntegrityError)
    assert first.result()[0] == [Committed(early, 2), Committed(None, 3)]
    assert last.result()[0] == [Committed(late, 4)]
    await assert_cache_matches_disk(store, path, "a", "b")
    assert (await disk_truth(path, "a"))[:2] == (4, counter(4))
    # The writer is alive and the failed sub-doc starts from its (empty) disk state.
    assert (await wait(store.append(WS, "b", [increment()])))[0] == [Committed(None, 1)]
    await assert_cache_matches_disk(store, path, "a", "b")
    await wait(store.close())


async def test_a_job_that_rolls_back_the_group_itself_fails_and_the_others_commit(
    db: SQLiteDatabase,
) -> None:
    await create_markers(db)

    def rollback(tx: Transaction) -> None:
        tx.execute("INSERT INTO markers VALUES (99)")
        tx.execute("ROLLBACK")

    async with writer_paused(db):
        jobs = [db.submit(insert_marker(1)), db.submit(rollback), db.submit(insert_marker(2))]
    await settled(*jobs)
    assert isinstance(jobs[1].exception(), RuntimeError)
    assert (jobs[0].result(), jobs[2].result()) == (1, 2)
    assert await markers(db) == [1, 2]


# -- a failed COMMIT after the cache churned ------------------------------------------------------


async def test_a_failed_commit_undoes_sub_docs_loaded_and_evicted_within_the_group(
    db: SQLiteDatabase, path: Path
) -> None:
    store = SQLiteOpLogStore(db, snapshot_every=3, cache_limit=1)
    await add_deferred_check(db)
    await wait(store.append(WS, "x", [increment(), increment()]))  # x cached at clock 2
    async with writer_paused(db):
        touched = [
            store.append_nowait(WS, "x", [increment()]),  # x: clock 3, snapshot due
            store.append_nowait(WS, "y", [increment()]),  # y loaded fresh: evicts x
            store.append_nowait(WS, "x", [increment()]),  # x reloaded from uncommitted rows
            store.append_nowait(WS, "z", [increment()]),  # z loaded fresh: evicts x again
            store.append_nowait(WS, "y", [increment()]),  # y reloaded, clock 2
        ]
        poison = db.submit(fail_the_commit)
    await settled(*touched, poison)
    failed: list[asyncio.Future[Any]] = [*touched, poison]
    for future in failed:
        assert isinstance(future.exception(), sqlite3.IntegrityError)
    assert await read_snapshot_clock(db, "x") is None  # the snapshot went with its ops
    await assert_cache_matches_disk(store, path, "x", "y", "z")
    assert (await disk_truth(path, "x"))[:2] == (2, counter(2))
    # Later appends take the next clocks of what is on disk, and the snapshot schedule resumes.
    assert (await wait(store.append(WS, "x", [increment()])))[0] == [Committed(None, 3)]
    assert (await wait(store.append(WS, "y", [increment()])))[0] == [Committed(None, 1)]
    assert await read_snapshot_clock(db, "x") == 3
    await assert_cache_matches_disk(store, path, "x", "y", "z")
    await wait(store.close())


@pytest.mark.parametrize("snapshot_every", [1, 2])
async def test_an_append_failing_after_its_snapshot_was_written_takes_the_snapshot_back(
    db: SQLiteDatabase, path: Path, snapshot_every: int
) -> None:
    store = SQLiteOpLogStore(db, snapshot_every=snapshot_every)
    await wait(store.append(WS, "d", [increment(), increment()]))
    assert await read_snapshot_clock(db, "d") == 2
    # The snapshot upsert is the job's last write: refusing it fails the job after its ops went in.
    await db.write(
        lambda tx: tx.execute(
            f"CREATE TRIGGER refuse_snapshot BEFORE UPDATE ON {SNAPSHOTS_TABLE}"
            " WHEN NEW.clock = 4 BEGIN SELECT RAISE(ABORT, 'no snapshot'); END"
        )
    )
    with pytest.raises(sqlite3.IntegrityError, match="no snapshot"):
        await wait(store.append(WS, "d", [increment(), increment()]))
    assert await read_snapshot_clock(db, "d") == 2
    await assert_cache_matches_disk(store, path, "d")
    # One op at a time steps over the refused clock: clocks continue from the disk's head.
    assert (await wait(store.append(WS, "d", [increment()])))[0] == [Committed(None, 3)]
    assert await read_snapshot_clock(db, "d") == (3 if snapshot_every == 1 else 2)
    await db.write(lambda tx: tx.execute("DROP TRIGGER refuse_snapshot"))
    assert (await wait(store.append(WS, "d", [increment()])))[0] == [Committed(None, 4)]
    assert await read_snapshot_clock(db, "d") == 4
    await assert_cache_matches_disk(store, path, "d")
    assert (await disk_truth(path, "d"))[:2] == (4, counter(4))
    await wait(store.close())


# -- a snapshot the log does not back -------------------------------------------------------------


async def test_a_snapshot_ahead_of_the_log_is_reported_as_corruption(path: Path) -> None:
    store = await SQLiteOpLogStore.open(path, snapshot_every=2)
    await wait(store.append(WS, "d", [increment() for _ in range(4)]))
    await wait(store.close())

    db = await SQLiteDatabase.open(path, schema=create_schema)
    # A damaged file: the log lost its tail (clocks 3, 4) but the snapshot at 4 survived. Replaying
    # it would serve clock 4 with a state no log entry backs, and the next op would take clock 5
    # after a gap, with the log's head (what readers use) disagreeing with the cache.
    await db.write(lambda tx: tx.execute(f"DELETE FROM {OPS_TABLE} WHERE clock > 2"))
    store = SQLiteOpLogStore(db, snapshot_every=2)
    with pytest.raises(OpLogCorrupted, match="snapshot"):
        await wait(store.append(WS, "d", [increment()]))
    with pytest.raises(OpLogCorrupted, match="snapshot"):
        await wait(store.get_state(WS, "d"))
    assert await wait(store.head(WS, "d")) == 2
    await wait(store.close())
    await wait(db.close())


# -- readers, loops, close and group bounds -------------------------------------------------------


async def test_readers_never_see_part_of_a_group_still_being_written(
    db: SQLiteDatabase,
) -> None:
    store = SQLiteOpLogStore(db)
    inside, release = threading.Event(), threading.Event()

    def hold(tx: Transaction) -> None:
        inside.set()
        release.wait(WAIT_SECONDS)

    async with writer_paused(db):
        written = store.append_nowait(WS, "d", [increment(), increment()])
        held = db.submit(hold)
    try:
        # The append is released into the group's transaction; the group has not committed.
        assert await wait(asyncio.to_thread(inside.wait, WAIT_SECONDS))
        assert await wait(store.read_since(WS, "d", 0, 100)) == (0, [])
        assert await wait(store.head(WS, "d")) == 0
        assert not written.done()
    finally:
        release.set()
    await settled(written, held)
    head, entries = await wait(store.read_since(WS, "d", 0, 100))
    assert (head, [e.clock for e in entries]) == (2, [1, 2])
    await wait(store.close())


async def test_a_job_whose_event_loop_closed_before_it_resolved_does_not_hurt_the_writer(
    db: SQLiteDatabase,
) -> None:
    await create_markers(db)

    def from_another_loop() -> None:
        async def submit_and_leave() -> None:
            db.submit(insert_marker(5))  # never awaited: the loop closes first

        loop = asyncio.new_event_loop()
        loop.run_until_complete(submit_and_leave())
        loop.close()

    async with writer_paused(db):
        await wait(asyncio.to_thread(from_another_loop))
        mine = db.submit(insert_marker(6))
    await settled(mine)
    assert mine.result() == 6
    assert await markers(db) == [5, 6]
    assert await wait(db.write(insert_marker(8))) == 8


async def test_close_resolves_every_job_queued_before_it(path: Path) -> None:
    db = await SQLiteDatabase.open(path, schema=create_schema, max_group=3)
    await create_markers(db)
    async with writer_paused(db):
        jobs = [db.submit(insert_marker(n)) for n in range(10)]
        closing = asyncio.ensure_future(db.close())
        await asyncio.sleep(0)  # close() has queued its stop behind the jobs
    await settled(*jobs, closing)
    assert [job.result() for job in jobs] == list(range(10))
    with pytest.raises(RuntimeError, match="closed"):
        db.submit(insert_marker(11))
    reopened = await SQLiteDatabase.open(path)
    try:
        assert await markers(reopened) == list(range(10))
    finally:
        await wait(reopened.close())


async def test_max_group_bounds_a_group_and_a_failed_commit_spares_the_next_group(
    path: Path,
) -> None:
    db = await SQLiteDatabase.open(path, schema=create_schema, max_group=2)
    store = SQLiteOpLogStore(db, snapshot_every=2)
    await add_deferred_check(db)
    groups = db.groups_committed
    async with writer_paused(db):
        doomed = store.append_nowait(WS, "d", [increment()])
        poison = db.submit(fail_the_commit)  # same group of two: the COMMIT fails
        kept = [store.append_nowait(WS, "d", [increment()]) for _ in range(3)]  # groups of 2, 1
    await settled(doomed, poison, *kept)
    assert isinstance(doomed.exception(), sqlite3.IntegrityError)
    assert isinstance(poison.exception(), sqlite3.IntegrityError)
    assert [k.result()[0] for k in kept] == [[Committed(None, c)] for c in (1, 2, 3)]
    assert db.groups_committed - groups == 3  # the holder's group, then [k1, k2], then [k3]
    assert await read_snapshot_clock(db, "d") == 2
    await assert_cache_matches_disk(store, path, "d")
    await wait(store.close())
    await wait(db.close())
