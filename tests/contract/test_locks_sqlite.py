"""The compute-lock contract on the embedded SQLite backend, plus what only SQLite can show."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cv_server.locks import Acquired, ComputeLockStore
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.locks import TABLE, SQLiteComputeLockStore, create_schema
from tests.contract.locks_contract import LocksContract


class TestSQLiteComputeLockStore(LocksContract):
    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[ComputeLockStore]:
        db = await SQLiteDatabase.open(tmp_path / "locks.db", schema=create_schema)
        store = SQLiteComputeLockStore(db)
        yield store
        await store.close()
        await db.close()


async def count_rows(db: SQLiteDatabase) -> int:
    def read(conn: sqlite3.Connection) -> int:
        (count,) = conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()
        return int(count)

    return await db.read(read)


async def test_the_sweep_of_other_keys_is_bounded_per_acquisition(tmp_path: Path) -> None:
    db = await SQLiteDatabase.open(tmp_path / "locks.db", schema=create_schema)
    try:
        store = SQLiteComputeLockStore(db, sweep_limit=3)
        for i in range(10):
            outcome = await store.acquire("ws", "job", f"dead-{i}", "w", 1.0, 0.0)
            assert isinstance(outcome, Acquired)
        assert await count_rows(db) == 10
        assert isinstance(await store.acquire("ws", "job", "new", "w", 60.0, 5.0), Acquired)
        assert await count_rows(db) == 10 - 3 + 1
        # Each later acquisition sweeps another batch, so dead rows do not accumulate.
        for i in range(3):
            await store.acquire("ws", "job", f"new-{i}", "w", 60.0, 5.0)
        assert await count_rows(db) == 1 + 3
    finally:
        await db.close()


async def test_the_acquired_key_is_cleaned_even_when_sweeping_is_off(tmp_path: Path) -> None:
    db = await SQLiteDatabase.open(tmp_path / "locks.db", schema=create_schema)
    try:
        store = SQLiteComputeLockStore(db, sweep_limit=0)
        await store.acquire("ws", "job", "other", "w", 1.0, 0.0)
        old = await store.acquire("ws", "job", "task", "crashed", 1.0, 0.0)
        # Exactly at its expiry time the old lock is dead (expires_at <= now).
        new = await store.acquire("ws", "job", "task", "bob", 60.0, 1.0)
        assert isinstance(old, Acquired)
        assert isinstance(new, Acquired)
        assert await count_rows(db) == 2
    finally:
        await db.close()


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


async def test_tokens_come_from_the_injected_minter(tmp_path: Path) -> None:
    tokens = iter(["t-1", "t-2"])
    db = await SQLiteDatabase.open(tmp_path / "locks.db", schema=create_schema)
    try:
        store = SQLiteComputeLockStore(db, new_token=lambda: next(tokens))
        first = await store.acquire("ws", "job", "a", "w", 60.0, 0.0)
        second = await store.acquire("ws", "job", "b", "w", 60.0, 0.0)
        assert first == Acquired(token="t-1", expires_at=60.0)
        assert second == Acquired(token="t-2", expires_at=60.0)
    finally:
        await db.close()


def test_a_negative_sweep_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="sweep_limit"):
        SQLiteComputeLockStore(None, sweep_limit=-1)  # type: ignore[arg-type]
