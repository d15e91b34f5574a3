"""The op-log contract on the embedded SQLite backend, plus what only SQLite can show."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest

import cv_server
from cv_mutations import new_op_id
from cv_server.oplog import Committed, OpLogStore
from cv_server.sqlite.engine import SQLiteDatabase, Transaction
from cv_server.sqlite.oplog import (
    OPS_TABLE,
    REJECTIONS_TABLE,
    SNAPSHOTS_TABLE,
    SQLiteOpLogStore,
    create_schema,
)
from tests.contract.compare_and_set_contract import CompareAndSetContract
from tests.contract.oplog_contract import (
    DOC,
    WS,
    LogRows,
    OpenStore,
    OpLogContract,
    Reopen,
    all_entries,
    append_one,
    field_value,
    increment,
)

T = TypeVar("T")

#: Bound on every wait for the writer thread in these tests.
WAIT_SECONDS = 30.0


class TestSQLiteOpLogStore(OpLogContract, CompareAndSetContract):
    @pytest.fixture
    def db_path(self, tmp_path: Path) -> Path:
        return tmp_path / "oplog.db"

    @pytest.fixture
    async def store(self, db_path: Path) -> AsyncIterator[OpLogStore]:
        store = await SQLiteOpLogStore.open(db_path, snapshot_every=self.SNAPSHOT_EVERY)
        yield store
        await store.close()

    @pytest.fixture
    async def reopen(self, db_path: Path) -> AsyncIterator[Reopen]:
        opened: list[OpLogStore] = []

        async def reopen(store: OpLogStore) -> OpLogStore:
            await store.close()
            new = await SQLiteOpLogStore.open(db_path, snapshot_every=self.SNAPSHOT_EVERY)
            opened.append(new)
            return new

        yield reopen
        for store in opened:
            await store.close()

    @pytest.fixture
    async def open_store(self, db_path: Path) -> AsyncIterator[OpenStore]:
        opened: list[OpLogStore] = []

        async def open_store(**kwargs: Any) -> OpLogStore:
            # `open` takes no cache_limit: it is a setting of the store, set once opened.
            cache_limit = kwargs.pop("cache_limit", None)
            store = await SQLiteOpLogStore.open(db_path, **kwargs)
            if cache_limit is not None:
                store.cache_limit = cache_limit
            opened.append(store)
            return store

        yield open_store
        for store in opened:
            await store.close()

    @pytest.fixture
    def log_rows(self, db_path: Path) -> LogRows:
        return SQLiteLogRows(db_path)


class SQLiteLogRows:
    """`LogRows` on the SQLite file, through a connection of its own (as another process)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def snapshot_clock(self) -> int | None:
        def read() -> int | None:
            with contextlib.closing(sqlite3.connect(self.path)) as conn:
                row = conn.execute(
                    f"SELECT clock FROM {SNAPSHOTS_TABLE} WHERE workspace_id = ? AND sub_doc = ?",
                    (WS, DOC),
                ).fetchone()
            return None if row is None else int(row[0])

        return await asyncio.to_thread(read)

    async def delete_ops(self, where: str) -> None:
        def delete() -> None:
            with contextlib.closing(sqlite3.connect(self.path)) as conn, conn:
                conn.execute(f"DELETE FROM {OPS_TABLE} WHERE {where}")

        await asyncio.to_thread(delete)

    async def drop_op_id_records(self) -> None:
        def drop() -> None:
            with contextlib.closing(sqlite3.connect(self.path)) as conn, conn:
                conn.execute(f"UPDATE {OPS_TABLE} SET op_id = NULL")
                conn.execute(f"DELETE FROM {REJECTIONS_TABLE}")

        await asyncio.to_thread(drop)

    def cached_sub_docs(self, store: OpLogStore) -> int:
        assert isinstance(store, SQLiteOpLogStore)
        return len(store._docs)


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[SQLiteDatabase]:
    db = await SQLiteDatabase.open(tmp_path / "shared.db", schema=create_schema)
    yield db
    await db.close()


async def wait(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, WAIT_SECONDS)


async def disk_answers(path: Path, snapshot_every: int) -> tuple[int, dict[str, Any]]:
    """Head and state as a store freshly opened on `path` rebuilds them from disk."""
    store = await SQLiteOpLogStore.open(path, snapshot_every=snapshot_every)
    try:
        clock, state = await store.get_state(WS, DOC)
        return clock, state.to_json()
    finally:
        await store.close()


async def read_snapshot_clock(db: SQLiteDatabase) -> int | None:
    def read(conn: sqlite3.Connection) -> int | None:
        row = conn.execute(
            f"SELECT clock FROM {SNAPSHOTS_TABLE} WHERE workspace_id = ? AND sub_doc = ?",
            (WS, DOC),
        ).fetchone()
        return None if row is None else int(row[0])

    return await db.read(read)


@contextlib.asynccontextmanager
async def writer_paused(db: SQLiteDatabase) -> AsyncIterator[None]:
    """Keep the writer thread busy for the block; the jobs queued in it then form one group."""
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


# -- group commit and durability settings --------------------------------------------------------


async def test_appends_queued_while_the_writer_is_busy_commit_in_one_transaction(
    db: SQLiteDatabase,
) -> None:
    store = SQLiteOpLogStore(db)
    groups, jobs = db.groups_committed, db.jobs_committed
    async with writer_paused(db):
        appends = [
            asyncio.ensure_future(store.append(WS, DOC, [increment(new_op_id())]))
            for _ in range(200)
        ]
    results = await wait(asyncio.gather(*appends))
    clocks = [o.clock for outcomes, _ in results for o in outcomes if isinstance(o, Committed)]
    assert sorted(clocks) == list(range(1, 201))
    assert db.jobs_committed - jobs == 201  # the 200 appends and the job that held the writer
    assert db.groups_committed - groups == 2
    await store.close()


async def test_many_concurrent_appends_share_transactions(db: SQLiteDatabase) -> None:
    store = SQLiteOpLogStore(db)
    groups, jobs = db.groups_committed, db.jobs_committed
    results = await wait(
        asyncio.gather(*(store.append(WS, DOC, [increment(new_op_id())]) for _ in range(200)))
    )
    clocks = [o.clock for outcomes, _ in results for o in outcomes if isinstance(o, Committed)]
    assert sorted(clocks) == list(range(1, 201))
    assert db.jobs_committed - jobs == 200
    assert db.groups_committed - groups < 200


async def test_the_database_runs_in_wal_mode_with_synchronous_full(db: SQLiteDatabase) -> None:
    def pragmas(tx: Transaction) -> tuple[str, int]:
        return (
            tx.execute("PRAGMA journal_mode").fetchone()[0],
            tx.execute("PRAGMA synchronous").fetchone()[0],
        )

    journal_mode, synchronous = await db.write(pragmas)
    assert journal_mode == "wal"
    assert synchronous == 2  # FULL


# -- the cache never runs ahead of the disk ------------------------------------------------------


async def test_an_append_whose_insert_fails_leaves_cache_and_disk_unchanged(
    db: SQLiteDatabase, tmp_path: Path
) -> None:
    store = SQLiteOpLogStore(db, snapshot_every=1000)
    await append_one(store, increment(new_op_id()))
    poison = new_op_id()

    def add_trigger(tx: Transaction) -> None:
        tx.execute(
            f"CREATE TRIGGER refuse_poison BEFORE INSERT ON {OPS_TABLE}"
            f" WHEN NEW.op_id = '{poison}' BEGIN SELECT RAISE(ABORT, 'refused'); END"
        )

    await db.write(add_trigger)
    with pytest.raises(sqlite3.IntegrityError, match="refused"):
        await store.append(WS, DOC, [increment(new_op_id()), increment(poison), increment()])
    assert (await store.get_state(WS, DOC))[0] == 1
    assert await field_value(store) == 1
    assert await store.head(WS, DOC) == 1
    # The cache agrees with the log: the next op takes the next clock, with no gap.
    assert await append_one(store, increment()) == Committed(None, 2)
    assert [e.clock for e in await all_entries(store)] == [1, 2]
    await store.close()
    await db.close()
    assert await disk_answers(tmp_path / "shared.db", 1000) == (
        2,
        {"nodes": {"root": {"parent": None, "children": [], "fields": {"n": 2}}}},
    )


async def test_a_failed_group_commit_rolls_the_cache_back(
    db: SQLiteDatabase, tmp_path: Path
) -> None:
    store = SQLiteOpLogStore(db, snapshot_every=2)
    await append_one(store, increment(new_op_id()))

    def add_deferred_check(tx: Transaction) -> None:
        # A deferred foreign key is checked at COMMIT, so it fails the whole group, not a job.
        tx.execute("CREATE TABLE parent_rows (id INTEGER PRIMARY KEY)")
        tx.execute(
            "CREATE TABLE child_rows (parent INTEGER"
            " REFERENCES parent_rows(id) DEFERRABLE INITIALLY DEFERRED)"
        )

    await db.write(add_deferred_check)

    retried = new_op_id()
    async with writer_paused(db):
        append = asyncio.ensure_future(
            store.append(WS, DOC, [increment(retried), increment(), increment()])
        )
        poison = asyncio.ensure_future(
            db.write(lambda tx: tx.execute("INSERT INTO child_rows VALUES (42)"))
        )
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
        await wait(append)
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
        await wait(poison)

    # That batch crossed a snapshot boundary; the snapshot was rolled back with the rest.
    assert (await store.get_state(WS, DOC))[0] == 1
    assert await field_value(store) == 1
    outcomes, _ = await store.append(WS, DOC, [increment(retried), increment()])
    assert outcomes == [Committed(retried, 2), Committed(None, 3)]
    # The snapshot schedule was rolled back too: the next one is due, and taken, at clock 3.
    assert await read_snapshot_clock(db) == 3
    await store.close()
    await db.close()
    assert await disk_answers(tmp_path / "shared.db", 2) == (
        3,
        {"nodes": {"root": {"parent": None, "children": [], "fields": {"n": 3}}}},
    )


# -- snapshots and restart -----------------------------------------------------------------------


async def test_a_snapshot_is_written_every_snapshot_every_ops(db: SQLiteDatabase) -> None:
    store = SQLiteOpLogStore(db, snapshot_every=5)
    seen = []
    for _ in range(12):
        await append_one(store, increment())
        seen.append(await read_snapshot_clock(db))
    assert seen == [None] * 4 + [5] * 5 + [10] * 3
    await store.close()


async def test_committed_at_comes_from_the_injected_clock(db: SQLiteDatabase) -> None:
    store = SQLiteOpLogStore(db, now=lambda: 1_700_000_000.25)
    await store.append(WS, DOC, [increment(), increment()])

    def read(conn: sqlite3.Connection) -> list[int]:
        return [row[0] for row in conn.execute(f"SELECT committed_at FROM {OPS_TABLE}")]

    assert await db.read(read) == [1_700_000_000_250, 1_700_000_000_250]
    await store.close()


async def test_a_store_closes_quietly_after_its_shared_database_closed(tmp_path: Path) -> None:
    db = await SQLiteDatabase.open(tmp_path / "shared.db", schema=create_schema)
    store = SQLiteOpLogStore(db)
    await append_one(store, increment())
    await db.close()
    await store.close()
    with pytest.raises(RuntimeError, match="closed"):
        await store.head(WS, DOC)


def test_snapshot_every_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="snapshot_every"):
        SQLiteOpLogStore(None, snapshot_every=0)  # type: ignore[arg-type]


# -- the pipeline is a pure core -----------------------------------------------------------------


def test_the_commit_pipeline_imports_no_io_module() -> None:
    # The `cv_server` package itself may import the web stack; the pipeline must not, so load it
    # with the package's own __init__ left out.
    package_dir = str(Path(cv_server.__file__).parent)
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('cv_server')\n"
        f"pkg.__path__ = [{package_dir!r}]\n"
        "sys.modules['cv_server'] = pkg\n"
        "import cv_server.oplog.pipeline\n"
        "bad = [m for m in ('asyncio', 'aiohttp', 'websockets', 'sqlite3', 'asyncpg')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
