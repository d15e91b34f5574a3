"""The idempotency-key contract on the embedded SQLite backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cv_server.queue import IdempotencyStore
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.idempotency import SQLiteIdempotencyStore, create_schema
from tests.contract.idempotency_contract import (
    RETENTION,
    IdempotencyContract,
    KillOwner,
    NewStore,
)


class TestSQLiteIdempotencyStore(IdempotencyContract):
    @pytest.fixture
    async def database(self, tmp_path: Path) -> AsyncIterator[SQLiteDatabase]:
        db = await SQLiteDatabase.open(tmp_path / "keys.db", schema=create_schema)
        yield db
        await db.close()

    @pytest.fixture
    async def store(self, database: SQLiteDatabase) -> AsyncIterator[IdempotencyStore]:
        store = SQLiteIdempotencyStore(database, retention=RETENTION)
        yield store
        await store.close()

    @pytest.fixture
    async def new_store(self, database: SQLiteDatabase) -> AsyncIterator[NewStore]:
        opened: list[SQLiteIdempotencyStore] = []

        def new_store(**kwargs: Any) -> IdempotencyStore:
            opened.append(SQLiteIdempotencyStore(database, **kwargs))
            return opened[-1]

        yield new_store
        for store in opened:
            await store.close()

    @pytest.fixture
    def kill_owner(self, store: IdempotencyStore) -> KillOwner:
        """One process serves the file: an owner dies with its server, and the restarted server
        frees every key still in progress before it serves (what `open_stores` runs)."""
        assert isinstance(store, SQLiteIdempotencyStore)
        sqlite_store = store

        async def kill(workspace_id: str, key: str) -> None:
            await sqlite_store.abandon_all_in_progress()

        return kill
