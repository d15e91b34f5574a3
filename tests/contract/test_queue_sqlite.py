"""The work-queue contract on the embedded SQLite backend, plus what only SQLite can show."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest
import sqlite_utils

from cv_server.config import ServerConfig
from cv_server.queue import BlobStore, IdempotencyStore, QueueStore, RequestEvent
from cv_server.sqlite import blobs as blobs_sqlite
from cv_server.sqlite import idempotency as idempotency_sqlite
from cv_server.sqlite import queue as sqlite
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.idempotency import SQLiteIdempotencyStore
from cv_server.sqlite.queue import (
    CLAIM_PROBES,
    PURGE_BATCH,
    TABLE,
    SQLiteQueueStore,
    claimable_sql,
)
from tests.contract.claimable_contract import ClaimableContract
from tests.contract.concurrency_keys_contract import ConcurrencyKeysContract
from tests.contract.enqueue_many_contract import EnqueueManyContract
from tests.contract.queue_contract import LEASE, STAGE, WS, QueueContract, request
from tests.contract.queue_lifecycle_contract import QueueLifecycleContract
from tests.contract.then_claim_contract import ThenClaimContract

CONFIG = ServerConfig()


def schema(db: sqlite_utils.Database) -> None:
    sqlite.create_schema(db)
    idempotency_sqlite.create_schema(db)
    blobs_sqlite.create_schema(db)


class TestSQLiteQueueStore(
    QueueContract,
    ThenClaimContract,
    EnqueueManyContract,
    ClaimableContract,
    QueueLifecycleContract,
    ConcurrencyKeysContract,
):
    @pytest.fixture
    def db_path(self, tmp_path: Path) -> Path:
        return tmp_path / "queue.db"

    @pytest.fixture
    async def database(self, db_path: Path) -> AsyncIterator[SQLiteDatabase]:
        db = await SQLiteDatabase.open(db_path, schema=schema)
        yield db
        await db.close()

    @pytest.fixture
    async def store(self, database: SQLiteDatabase) -> AsyncIterator[QueueStore]:
        store = SQLiteQueueStore(database)
        yield store
        await store.close()

    @pytest.fixture
    async def peer_store(self, store: QueueStore, db_path: Path) -> AsyncIterator[QueueStore]:
        # A second database object on the same file: its own writer connection, as a second
        # server process would have. SQLite's file lock is then all that keeps claims apart.
        db = await SQLiteDatabase.open(db_path, schema=schema)
        yield SQLiteQueueStore(db)
        await db.close()

    @pytest.fixture
    async def idempotency_store(self, database: SQLiteDatabase) -> IdempotencyStore:
        return SQLiteIdempotencyStore(database, retention=CONFIG.idempotency_retention_seconds)

    @pytest.fixture
    async def blob_store(self, database: SQLiteDatabase) -> BlobStore:
        return blobs_sqlite.SQLiteBlobStore(database, retention=CONFIG.blob_retention_seconds)

    @pytest.fixture
    async def unbindable_store(self, database: SQLiteDatabase) -> AsyncIterator[QueueStore]:
        # sqlite3 cannot bind an arbitrary object: the claim's UPDATE raises inside the job.
        store = SQLiteQueueStore(database, new_token=lambda: cast(str, object()))
        yield store
        await store.close()


async def test_the_completion_is_on_disk_when_listeners_hear_of_it(tmp_path: Path) -> None:
    path = tmp_path / "queue.db"
    db = await SQLiteDatabase.open(path, schema=schema)
    try:
        store = SQLiteQueueStore(db)
        on_disk: list[tuple[str, str]] = []

        def listener(event: RequestEvent) -> None:
            # A brand-new connection sees only committed data: the announcement came after COMMIT.
            with sqlite3.connect(path) as conn:
                (status,) = conn.execute(
                    f"SELECT status FROM {TABLE} WHERE request_id = ?", (event.request_id,)
                ).fetchone()
            on_disk.append((event.status, status))

        store.add_listener(listener)
        await store.enqueue(request(), 1.0)
        held = await store.claim(STAGE, "w", LEASE, 2.0)
        assert held is not None
        await store.complete(held.request_id, held.claim_token or "", {"ok": True}, 3.0)
        assert on_disk == [("pending", "pending"), ("in_progress", "in_progress"), ("done", "done")]
    finally:
        await db.close()


async def test_requests_survive_a_reopen_of_the_database(tmp_path: Path) -> None:
    path = tmp_path / "queue.db"
    db = await SQLiteDatabase.open(path, schema=schema)
    row, _ = await SQLiteQueueStore(db).enqueue(request(input={"big": "x" * 1000}), 1.0)
    await db.close()

    db = await SQLiteDatabase.open(path, schema=schema)  # the schema is idempotent
    try:
        store = SQLiteQueueStore(db)
        assert await store.get(WS, row.request_id) == row
        assert await store.claim(STAGE, "w", LEASE, 2.0) is not None
    finally:
        await db.close()


async def test_claim_tokens_come_from_the_injected_minter(tmp_path: Path) -> None:
    tokens = iter(["t-1", "t-2"])
    db = await SQLiteDatabase.open(tmp_path / "queue.db", schema=schema)
    try:
        store = SQLiteQueueStore(db, new_token=lambda: next(tokens))
        await store.enqueue(request("a"), 1.0)
        await store.enqueue(request("b"), 1.0)
        first = await store.claim(STAGE, "w", LEASE, 2.0)
        second = await store.claim(STAGE, "w", LEASE, 2.0)
        assert (first and first.claim_token, second and second.claim_token) == ("t-1", "t-2")
    finally:
        await db.close()


async def test_every_claim_probe_is_an_index_seek(tmp_path: Path) -> None:
    db = await SQLiteDatabase.open(tmp_path / "queue.db", schema=schema)
    try:

        def plans(conn: sqlite3.Connection) -> dict[str, list[str]]:
            return {
                name: [
                    str(step[3])
                    for step in conn.execute(f"EXPLAIN QUERY PLAN {sql}", ["x"] * sql.count("?"))
                ]
                for name, sql in CLAIM_PROBES.items()
            }

        for name, steps in (await db.read(plans)).items():
            # No temp b-tree for ORDER BY, no second scan: one seek of the probe's index, and
            # the concurrency key's count (rows with a limit only) a seek of the running keys.
            main, *key_count = steps
            assert main.startswith(f"SEARCH {TABLE} USING INDEX"), (name, steps)
            assert key_count[0].startswith("CORRELATED SCALAR SUBQUERY"), (name, steps)
            assert key_count[1:] == [
                f"SEARCH k USING INDEX {TABLE}_running_key"
                " (workspace_id=? AND concurrency_key=? AND lease_expires_at>?)"
            ], (name, steps)
    finally:
        await db.close()


async def test_the_claimable_check_is_an_index_seek(tmp_path: Path) -> None:
    """The idle poll's check (`has_claimable`) seeks each status's partial index, for any number
    of classes and workspaces, also on a table never analyzed (where the planner, left to
    itself, walked the status index: every pending row)."""
    db = await SQLiteDatabase.open(tmp_path / "queue.db", schema=schema)
    try:

        def plans(conn: sqlite3.Connection) -> dict[tuple[int, int | None], list[str]]:
            found = {}
            for classes, workspaces in ((1, None), (3, None), (1, 1), (3, 40)):
                query = claimable_sql(classes, workspaces)
                params = ["x"] * query.count("?")
                steps = conn.execute(f"EXPLAIN QUERY PLAN {query}", params)
                found[classes, workspaces] = [str(step[3]) for step in steps]
            return found

        for scope, steps in (await db.read(plans)).items():
            searches = [step for step in steps if step.startswith("SEARCH")]
            indexes = [step.split(" USING ")[1].split(" (")[0] for step in searches]
            pending = "pending" if scope[1] is None else "pending_workspace"
            # Each probe's concurrency-key count (rows with a limit only) seeks the running keys.
            assert indexes == [
                f"INDEX {TABLE}_{pending}",
                f"INDEX {TABLE}_running_key",
                f"INDEX {TABLE}_leased",
                f"INDEX {TABLE}_running_key",
            ], (scope, steps)
            assert not [step for step in steps if step.startswith(f"SCAN {TABLE}")], steps
    finally:
        await db.close()


async def test_a_file_made_before_cancelling_existed_gains_the_column(tmp_path: Path) -> None:
    path = tmp_path / "queue.db"
    db = await SQLiteDatabase.open(path, schema=schema)
    row, _ = await SQLiteQueueStore(db).enqueue(request(), 1.0)
    await db.close()
    with sqlite3.connect(path) as conn:  # the table as an older release made it
        conn.execute(f"ALTER TABLE {TABLE} DROP COLUMN cancel_requested")
    db = await SQLiteDatabase.open(path, schema=schema)
    try:
        store = SQLiteQueueStore(db)
        assert await store.get(WS, row.request_id) == row
        assert (await store.cancel(row.request_id, 2.0)).status == "cancelled"
    finally:
        await db.close()


async def test_a_file_made_before_concurrency_keys_gains_the_columns(tmp_path: Path) -> None:
    path = tmp_path / "queue.db"
    db = await SQLiteDatabase.open(path, schema=schema)
    row, _ = await SQLiteQueueStore(db).enqueue(request(), 1.0)
    await db.close()
    with sqlite3.connect(path) as conn:  # the table as an older release made it
        conn.execute(f"DROP INDEX {TABLE}_running_key")
        conn.execute(f"ALTER TABLE {TABLE} DROP COLUMN concurrency_key")
        conn.execute(f"ALTER TABLE {TABLE} DROP COLUMN max_running_per_key")
    db = await SQLiteDatabase.open(path, schema=schema)
    try:
        store = SQLiteQueueStore(db)
        assert await store.get(WS, row.request_id) == row
        limited = dataclasses.replace(request("keyed"), concurrency_key="k", max_running_per_key=1)
        await store.enqueue(limited, 2.0)
        await store.enqueue(
            dataclasses.replace(request("keyed-2"), concurrency_key="k", max_running_per_key=1), 3.0
        )
        claimed = await store.claim_many(STAGE, "w", 60.0, 10.0, limit=5)
        assert [r.job_id for r in claimed] == ["job-1", "keyed"]
    finally:
        await db.close()


async def test_a_file_made_before_enqueue_with_the_commit_gains_the_column(
    tmp_path: Path,
) -> None:
    path = tmp_path / "queue.db"
    db = await SQLiteDatabase.open(path, schema=schema)
    row, _ = await SQLiteQueueStore(db).enqueue(request(), 1.0)
    await db.close()
    with sqlite3.connect(path) as conn:  # the table as an older release made it
        conn.execute(f"ALTER TABLE {TABLE} DROP COLUMN caused_by_clock")
    db = await SQLiteDatabase.open(path, schema=schema)
    try:
        store = SQLiteQueueStore(db)
        found = await store.get(WS, row.request_id)
        assert found == row
        assert found.caused_by_clock is None  # enqueued on its own, as every older row was
        other, _ = await store.enqueue(request("job-2"), 2.0)
        assert other.caused_by_clock is None
    finally:
        await db.close()


async def test_the_purge_is_an_index_seek(tmp_path: Path) -> None:
    """A purge batch seeks the partial index of finished rows: its cost is the batch, not the
    queue's whole history (`PURGE_BATCH`)."""
    db = await SQLiteDatabase.open(tmp_path / "queue.db", schema=schema)
    try:

        def plan(conn: sqlite3.Connection) -> list[str]:
            steps = conn.execute(f"EXPLAIN QUERY PLAN {PURGE_BATCH}", (1.0, 10))
            return [str(step[3]) for step in steps]

        assert await db.read(plan) == [
            f"SEARCH {TABLE} USING INDEX {TABLE}_finished (finished_at<?)"
        ]
    finally:
        await db.close()
