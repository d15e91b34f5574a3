"""The compute-lock contract on the embedded SQLite backend, plus what only SQLite can show."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cv_server.locks import Acquired, ComputeLockStore
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.locks import TABLE, SQLiteComputeLockStore, create_schema
from tests.contract.locks_contract import CountRows, LocksContract, NewStore


class TestSQLiteComputeLockStore(LocksContract):
    @pytest.fixture
    async def database(self, tmp_path: Path) -> AsyncIterator[SQLiteDatabase]:
        db = await SQLiteDatabase.open(tmp_path / "locks.db", schema=create_schema)
        yield db
        await db.close()

    @pytest.fixture
    async def store(self, database: SQLiteDatabase) -> AsyncIterator[ComputeLockStore]:
        store = SQLiteComputeLockStore(database)
        yield store
        await store.close()

    @pytest.fixture
    async def new_store(self, database: SQLiteDatabase) -> AsyncIterator[NewStore]:
        opened: list[SQLiteComputeLockStore] = []

        def new_store(**kwargs: Any) -> ComputeLockStore:
            opened.append(SQLiteComputeLockStore(database, **kwargs))
            return opened[-1]

        yield new_store
        for store in opened:
            await store.close()

    @pytest.fixture
    def count_rows(self, database: SQLiteDatabase) -> CountRows:
        async def count() -> int:
            return await count_rows(database)

        return count


async def count_rows(db: SQLiteDatabase) -> int:
    def read(conn: sqlite3.Connection) -> int:
        (count,) = conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()
        return int(count)

    return await db.read(read)


async def test_a_lock_survives_a_reopen_of_the_database(tmp_path: Path) -> None:
    path = tmp_path / "locks.db"
    db = await SQLiteDatabase.open(path, schema=create_schema)
    held = await SQLiteComputeLockStore(db).acquire("ws", "job", "task", "alice", 60.0, 0.0)
    await db.close()
    assert isinstance(held, Acquired)

    db = await SQLiteDatabase.open(path, schema=create_schema)  # the schema is idempotent
    try:
        lock = await SQLiteComputeLockStore(db).get("ws", "job", "task", 1.0)
        assert lock is not None
        assert lock.token == held.token
    finally:
        await db.close()
