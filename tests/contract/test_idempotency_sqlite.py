"""The idempotency-key contract on the embedded SQLite backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cv_server.queue import IdempotencyStore
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.idempotency import SQLiteIdempotencyStore, create_schema
from tests.contract.idempotency_contract import RETENTION, IdempotencyContract, KillOwner


class TestSQLiteIdempotencyStore(IdempotencyContract):
    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[IdempotencyStore]:
        db = await SQLiteDatabase.open(tmp_path / "keys.db", schema=create_schema)
        store = SQLiteIdempotencyStore(db, retention=RETENTION)
        yield store
        await store.close()
        await db.close()

    @pytest.fixture
    def kill_owner(self, store: IdempotencyStore) -> KillOwner:
        """One process serves the file: an owner dies with its server, and the restarted server
        frees every key still in progress before it serves (what `open_stores` runs)."""
        assert isinstance(store, SQLiteIdempotencyStore)
        sqlite_store = store

        async def kill(workspace_id: str, key: str) -> None:
            await sqlite_store.abandon_all_in_progress()

        return kill


def test_a_retention_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="retention"):
        SQLiteIdempotencyStore(None, retention=0)  # type: ignore[arg-type]
